"""The README and docs/ say only what exists: every link and every named file is there, every `make`
target is in the Makefile, every `draftsmith` verb and flag is one the CLI takes, every shipped recipe
it names is shipped, and the README stays a user's page (about 250 lines)."""
import re
import shlex
from pathlib import Path

import pytest

import draftsmith
import draftsmith.heads
from draftsmith.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]                 # the checkout (or the copy make test-wheel makes)
PACKAGE_ROOT = Path(draftsmith.heads.__file__).resolve().parents[1]
PACKAGES = ("heads", "data", "train", "eval", "export", "recipes")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def exists(relative: str, page: Path) -> bool:
    """A path as a page names it: beside the page, at the root, or inside the installed package."""
    relative = relative.split("#")[0].rstrip("/")
    if not relative:
        return True
    first = relative.split("/")[0]
    candidates = [page.parent / relative, ROOT / relative]
    if first in PACKAGES:
        candidates.append(PACKAGE_ROOT / relative)
    if first == "draftsmith":
        candidates.append(Path(draftsmith.__file__).resolve().parent / relative.partition("/")[2])
    return any(c.exists() for c in candidates)


def code_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S)


def commands(text: str) -> list[list[str]]:
    """Each shell line of the page's code blocks, as words (comments and continuations handled)."""
    found = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                try:
                    found.append(shlex.split(line))
                except ValueError:
                    continue
    return found


def test_the_readme_is_a_users_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines: move the detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_and_named_file_exists(page):
    text = page.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    missing = [link for link in links if not re.match(r"https?://|mailto:|#", link) and not exists(link, page)]
    named = re.findall(r"`((?:heads|data|train|eval|export|scripts|recipes|draftsmith|docs|tests)/[\w./-]+\.(?:py|md|"
                       r"yaml|sh))`", text)
    missing += [path for path in named if not exists(path, page)]
    assert not missing, f"{page.name} names what does not exist: {missing}"


def subcommands():
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return action.choices


def test_every_command_in_the_readme_names_a_real_target_verb_flag_and_recipe():
    text = (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    verbs = subcommands()
    recipes = {p.stem for p in (PACKAGE_ROOT / "recipes").glob("*.yaml")}
    checked, wrong = 0, []
    for words in commands(text):
        if words[0] == "make":
            checked += 1
            wrong += [f"make {t}" for t in words[1:] if not re.search(rf"^{re.escape(t)}:", makefile, flags=re.M)]
        elif words[0] == "draftsmith":
            checked += 1
            verb = words[1]
            if verb not in verbs:
                wrong.append(f"draftsmith {verb}")
                continue
            flags = {s for a in verbs[verb]._actions for s in a.option_strings}
            wrong += [f"draftsmith {verb} {w}" for w in words[2:] if w.startswith("--") and w not in flags]
            wrong += [f"recipe {w}" for w in words[2:3] if w.endswith("-smollm2-135m") and w not in recipes]
        elif words[0] == "python" and len(words) > 1 and words[1].endswith(".py"):
            checked += 1
            wrong += [words[1]] if not exists(words[1], ROOT / "README.md") else []
    assert checked >= 8 and not wrong, wrong


def test_docs_list_every_format_a_drafter_declares():
    from draftsmith.heads.registry import registry

    text = (ROOT / "docs" / "formats.md").read_text()
    declared = {f.name for cls in registry().values() for f in cls.formats}
    assert declared and not [name for name in declared if f"`{name}`" not in text]
