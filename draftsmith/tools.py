"""The verbs around a run: list and show recipes, import exports, push checkpoints to the Hub.

Like cli.py, each verb imports what it runs inside its function (see cli.py)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from .recipe_files import resolve_recipe


def add_tool_parsers(sub) -> None:
    """The sub-commands of this file: recipes, show, import, push."""
    sub.add_parser("recipes", help="list the recipes shipped with draftsmith")
    p = sub.add_parser("import", help="read a drafter exported for a serving stack back into a draftsmith checkpoint")
    p.add_argument("source", help="the export's directory")
    p.add_argument("--from", dest="fmt", required=True,
                   help="the layout it is in: a format its drafter declares (docs/formats.md; eagle: the EAGLE "
                        "repository's own EAGLE-3 layout, give --target)")
    p.add_argument("out_dir")
    p.add_argument("--target", default=None, help="the target it drafts for (default: the one the export names)")
    p.add_argument("--device", default="auto")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier import in OUT_DIR (never anything else)")
    p = sub.add_parser("push", help="upload a checkpoint with its model card to the Hugging Face Hub")
    p.add_argument("checkpoint")
    p.add_argument("repo_id", help="owner/name on the Hub (created if missing)")
    p.add_argument("--export", default=None, help="also upload exports, e.g. vllm or vllm,sglang (in export-FORMAT/)")
    p.add_argument("--private", action="store_true", help="create the repository private")
    p = sub.add_parser("show", help="print a recipe as a run reads it: overrides applied, defaults filled in, "
                                    "each field with its help")
    p.add_argument("recipe", help="a recipe YAML or a shipped recipe name")
    p.add_argument("overrides", nargs="*", help="key=value or section.key=value")


def shipped_recipes() -> dict[str, Path]:
    folder = resources.files("draftsmith.recipes")
    return {p.name.removesuffix(".yaml"): Path(str(p)) for p in sorted(folder.iterdir(), key=lambda p: p.name)
            if p.name.endswith(".yaml")}


def recipe_summary(path: Path) -> tuple[str, str]:
    """(the command its header gives, the first sentence of its description) from a recipe's comments."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    command = lines[0] if lines else ""
    prose = " ".join(lines[lines.index(""):] if "" in lines else lines[1:]).strip()
    sentence = prose.split(". ")[0].rstrip(".") + "." if prose else ""
    return command, sentence


def cmd_recipes(args) -> dict:
    recipes = shipped_recipes()
    for name, path in recipes.items():
        command, sentence = recipe_summary(path)
        print(f"{name}\n    {sentence}\n    {command}")
    return {"recipes": list(recipes)}


def cmd_show(args) -> dict:
    """The recipe as a run would read it (overrides applied, defaults filled in), each field with its help."""
    import yaml

    from draftsmith.heads.infra.config import field_help
    from draftsmith.heads.registry import registry
    from draftsmith.train.settings import SECTIONS, Recipe, load_recipe

    recipe = load_recipe(resolve_recipe(args.recipe), args.overrides)
    resolved = recipe.to_dict()
    helps = {"": field_help(Recipe), "drafter": field_help(registry()[recipe.method].config_class),
             **{name: field_help(cls) for name, cls in SECTIONS.items()}}

    def line(key, value, indent, section):
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=10 ** 6).strip()[1:-1]
        note = helps[section].get(key, "")
        return f"{' ' * indent}{text}" + (f"    # {note}" if note else "")

    print(f"# {args.recipe}" + (f" with {' '.join(args.overrides)}" if args.overrides else "")
          + ": what a run reads, every default filled in")
    for key, value in resolved.items():
        if isinstance(value, dict) and key in helps:
            print(f"{key}:" + (f"    # {helps[''][key]}" if helps[""].get(key) else ""))
            for sub_key, sub_value in value.items():
                print(line(sub_key, sub_value, 2, key))
        else:
            print(line(key, value, 0, ""))
    return resolved


def cmd_import(args) -> dict:
    """A drafter written for a serving stack, read back as a draftsmith checkpoint (warm starts)."""
    from draftsmith.export.importers import ImportError_, check_format, import_checkpoint, read_export_config
    from draftsmith.heads.infra.device import resolve_device
    from draftsmith.heads.infra.files import require_writable
    from draftsmith.heads.infra.outputs import guard_output
    from draftsmith.heads.runtime.target import Target

    source = Path(args.source)
    named = read_export_config(source)
    check_format(source, named, args.fmt)                 # a --from the export contradicts, before anything loads
    guard_output(args.out_dir, "import", "imported checkpoint", sources=[source], overwrite=args.overwrite)
    verifier = named.get("speculators_config", {})
    verifier = verifier.get("verifier", {}) if isinstance(verifier, dict) else {}
    target_path = args.target or (verifier.get("name_or_path") if isinstance(verifier, dict) else None) \
        or named.get("base_model_name_or_path")
    if not target_path:
        raise ImportError_(f"'{source}' does not name its target: give it with --target PATH")
    require_writable(Path(args.out_dir).parent, "the output directory's parent")
    target = Target.load(target_path, "float32", resolve_device(args.device), layers=False)
    out = import_checkpoint(source, args.fmt, args.out_dir, target)
    print(f"imported {args.fmt} export {source} as a draftsmith checkpoint in {out} (target {target.name}); "
          f"fine-tune from it with drafter.init_from={out}")
    return {"checkpoint": str(out)}


def cmd_push(args) -> dict:
    """Upload a checkpoint (an allowlist: card, weights, config, recipe, last eval, exports; never the resume
    state) to the Hub.  The token is checked before anything is staged; the checkpoint is never changed."""
    import tempfile

    from huggingface_hub import HfApi, get_token

    from draftsmith.export.hub import push_folder
    from draftsmith.export.staging import PushError
    from draftsmith.heads.drafter import read_config
    from draftsmith.heads.infra.files import human_size
    from draftsmith.train.settings import recipe_from_dict

    read_config(Path(args.checkpoint))                      # not a checkpoint: named before anything else
    if not get_token():
        raise PushError("no Hugging Face token: log in with `hf auth login` or set HF_TOKEN; nothing was uploaded")
    formats = tuple(f for f in (args.export or "").split(",") if f)
    with tempfile.TemporaryDirectory(prefix="draftsmith-push-") as tmp:
        folder, redactions = push_folder(Path(args.checkpoint), Path(tmp) / "folder", formats,
                                         recipe_settings=lambda raw: recipe_from_dict(raw).to_dict())
        files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        total = sum((folder / f).stat().st_size for f in files)
        for line in redactions:
            print(f"redacted {line}")
        print(f"uploading {len(files)} files, {human_size(total)} in all: {', '.join(files)}")
        api = HfApi()
        try:
            api.create_repo(args.repo_id, private=args.private, exist_ok=True)
            info = api.upload_folder(folder_path=str(folder), repo_id=args.repo_id,
                                     commit_message=f"draftsmith push of {Path(args.checkpoint).name}")
        except Exception as err:          # offline, a bad token, no rights: huggingface_hub's many error types
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise PushError(f"the upload to '{args.repo_id}' failed ({type(err).__name__}: {first}); nothing was "
                            "uploaded: check the network, the token's write access and the repository name, then "
                            "push again") from None
    print(f"pushed {len(files)} files to https://huggingface.co/{args.repo_id}")
    return {"repo_id": args.repo_id, "files": files, "commit": str(getattr(info, "oid", info))}
