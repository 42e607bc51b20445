"""The import rules of the layout (docs/design.md, "Layout and data flow"), read from the source files:
which folder may import which, no private name imported from another module, and no import cycle
between files (imports inside functions included: they hide a cycle, they do not break it)."""
import ast
from pathlib import Path

import draftsmith
import draftsmith.heads

# which packages each package may import from; "cli" is the draftsmith/ package itself (the verbs)
ALLOWED = {"heads": {"heads"}, "data": {"heads", "data"}, "export": {"heads", "export"},
           "train": {"heads", "data", "train"}, "eval": {"heads", "data", "export", "eval"},
           "cli": {"heads", "data", "export", "train", "eval", "cli"},
           "scripts": {"heads", "data", "export", "train", "eval", "cli"}}
PACKAGES = ("heads", "data", "export", "train", "eval")


def source_files() -> dict[str, Path]:
    """dotted module name -> file, for every module of draftsmith and for scripts/."""
    root = Path(draftsmith.heads.__file__).resolve().parents[1]      # the checkout, or site-packages/draftsmith
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root / package).with_suffix("").parts
            modules[".".join(("draftsmith", package, *parts)).removesuffix(".__init__")] = path
    for path in sorted(Path(draftsmith.__file__).resolve().parent.glob("*.py")):
        modules["draftsmith" if path.stem == "__init__" else f"draftsmith.{path.stem}"] = path
    for path in sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py")):
        modules[f"scripts.{path.stem}"] = path
    return modules


def group(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "scripts":
        return "scripts"
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "cli"


def imports(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for every import statement in the file, at any depth."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((name, [alias.name for alias in node.names]))
    return found


def edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of this code base it imports (`from package import module` counts as the module)."""
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for name, names in imports(module, path):
            for used in [name] + [f"{name}.{n}" for n in names]:
                if used in modules and used != module:
                    graph[module].add(used)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one file (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_folder_imports_only_what_the_layout_allows():
    modules = source_files()
    assert {"draftsmith.cli", "draftsmith.heads.registry", "draftsmith.heads.runtime.target"} <= set(modules)
    broken = []
    for module, path in modules.items():
        for name, _ in imports(module, path):
            if name == "draftsmith" or name.startswith("draftsmith."):
                used = group(name) if name != "draftsmith" else "cli"
                if used not in ALLOWED[group(module)]:
                    broken.append(f"{module}: imports {name}")
    assert not broken, "\n".join(broken)


def test_no_private_name_is_imported_from_another_module():
    modules = source_files()
    broken = [f"{module}: {name}.{n}" for module, path in modules.items() for name, names in imports(module, path)
              if name in modules for n in names if n.startswith("_") and not n.startswith("__")]
    assert not broken, "\n".join(broken)


def test_no_two_files_import_each_other_even_through_others():
    found = cycles(edges(source_files()))
    assert not found, "import cycles between files:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle_put_back():
    """The checker itself: a cycle hidden inside a function is still a cycle."""
    graph = edges(source_files())
    graph["draftsmith.data.shards"].add("draftsmith.data.distill")       # as data/features.py once read shards
    assert any({"draftsmith.data.distill", "draftsmith.data.shards"} <= set(c) for c in cycles(graph))
