"""The one guard every verb that writes passes its destination through, before any work.

A destination is refused when it holds work of another kind (a checkpoint, a run, an export, a report),
when it is the verb's own source, or when it sits inside a checkpoint (a checkpoint is written only by
the training that made it).  `overwrite` replaces only an earlier output of the same verb.  The kinds
are recognised by the files each verb leaves (`kind_of`).
"""
from __future__ import annotations

import json
from pathlib import Path

EXPORT_MARK = "draftsmith-export.json"      # written by `draftsmith export` into every export
IMPORT_KEY = "imported_from"                 # in the config.json of a checkpoint `draftsmith import` wrote


class OutputError(ValueError):
    """A destination a verb must not write to."""


def _json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


MANIFEST_TARGET = {"name": str, "model_type": str, "vocab_size": int, "hidden_size": int, "num_layers": int,
                   "weights_sha256": str}


def export_manifest(directory: str | Path) -> tuple[dict | None, str]:
    """draftsmith's export manifest in `directory` and "", or None and what is wrong with it ("" when there is
    none).  A manifest names a format, a dtype and the target the export was made for."""
    path = Path(directory) / EXPORT_MARK
    if not path.is_file():
        return None, ""
    if path.stat().st_size > 1 << 20:
        return None, f"{path} is {path.stat().st_size} bytes, not a manifest"
    manifest = _json(path)
    if manifest is None:
        return None, f"{path} is not a JSON object"
    for key, kind in (("format", str), ("dtype", str), ("target", dict)):
        if not isinstance(manifest.get(key), kind):
            return None, f"{path} has no {key} {kind.__name__} (found {str(manifest.get(key))[:60]!r})"
    wrong = [k for k, kind in MANIFEST_TARGET.items() if not isinstance(manifest["target"].get(k), kind)]
    if wrong:
        return None, f"{path}'s target lacks {', '.join(wrong)}"
    return manifest, ""


def kind_of(path: str | Path) -> str | None:
    """What `path` holds: None (missing or an empty directory), "checkpoint", "imported checkpoint",
    "run" (a train/data output_dir), "export", "bench report", "eval report", or "other"."""
    path = Path(path)
    if not path.exists():
        return None
    if path.is_file():
        report = _json(path) if path.suffix == ".json" else None
        return "eval report" if report is not None and "tau" in report and "checkpoint" in report else "other"
    if not any(path.iterdir()):
        return None
    if export_manifest(path)[0] is not None:
        return "export"
    config = _json(path / "config.json") if (path / "config.json").is_file() else None
    if config is not None and {"kind", "drafter", "target"} <= config.keys():
        return "imported checkpoint" if IMPORT_KEY in config else "checkpoint"
    if (path / "checkpoint").is_dir() or (path / "data").is_dir() or (path / "recipe.yaml").is_file():
        return "run"
    if (path / "report.json").is_file() and (path / "report.md").is_file():
        return "bench report"
    return "other"


def checkpoint_around(path: str | Path) -> Path | None:
    """The checkpoint `path` lies inside, if any (the path itself not counted)."""
    for parent in Path(path).resolve().parents:
        if kind_of(parent) in ("checkpoint", "imported checkpoint"):
            return parent
    return None


def holds(destination: Path, source: Path) -> bool:
    """`destination` is `source`, or a directory above it (both resolved)."""
    return destination == source or destination in source.parents


def guard_output(destination: str | Path, verb: str, makes: str, sources=(), overwrite: bool = False,
                 foreign_ok: bool = False) -> None:
    """Refuse `destination` for `verb` (which writes kind `makes`) unless it is new, empty, or (with
    `overwrite`) an earlier output of the same kind; `sources` are the paths the verb reads.
    foreign_ok: a directory of files no verb made is acceptable (the verb adds its own beside them)."""
    destination = Path(destination)
    resolved = destination.expanduser().resolve()
    for source in (Path(s).expanduser().resolve() for s in sources):
        if holds(resolved, source):
            raise OutputError(f"{verb} cannot write to '{destination}': it is (or holds) its own source '{source}'; "
                              "choose a new directory")
    around = checkpoint_around(resolved)
    if around is not None:
        raise OutputError(f"{verb} cannot write to '{destination}': it is inside the checkpoint '{around}', which "
                          "only the training that made it writes; choose a directory outside it")
    found = kind_of(resolved)
    if found is None or (found == "other" and foreign_ok and resolved.is_dir()):
        return
    if found != makes:
        raise OutputError(f"{verb} cannot write to '{destination}': it already holds "
                          + (f"a {found}" if found != "other" else "other files")
                          + f" that {verb} did not make; choose a new or empty "
                          + ("file" if resolved.is_file() else "directory"))
    if not overwrite:
        raise OutputError(f"'{destination}' holds an earlier {found}; pass --overwrite to replace it, or choose a "
                          "new directory")
