"""Read a drafter written for a serving stack back into a draftsmith checkpoint: the inverse of
export, for warm starts from published drafters (`draftsmith import`, then
`drafter.init_from=CHECKPOINT` in a recipe).

Each drafter declares the formats it reads (`formats`, heads/formats.py: `read` and `recognizes`).
This module finds the drafter an export holds, checks `--from` against draftsmith's own export
manifest and against what the export's config says it is, reads safetensors only, and writes the
checkpoint through a temporary directory.  The readers convert layer-id conventions and check the
vocabulary maps and any carried target matrices against the target.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.heads.card import write_card
from draftsmith.heads.drafter import save_drafter
from draftsmith.heads.formats import ExportFormat, ImportFormatError, import_formats
from draftsmith.heads.infra.files import as_disk_full, swap_directory
from draftsmith.heads.infra.outputs import EXPORT_MARK, IMPORT_KEY, export_manifest
from draftsmith.heads.registry import registry
from draftsmith.heads.runtime.identity import TargetError, TargetIdentity
from draftsmith.heads.runtime.target import Target


class ImportError_(ImportFormatError):
    """An export that cannot be read as a draftsmith drafter for this target."""


def _weights(source: Path) -> dict[str, torch.Tensor]:
    files = sorted(source.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in source.glob("*.bin")) + sorted(p.name for p in source.glob("*.pt"))
        raise ImportError_(f"'{source}' holds no .safetensors weights"
                           + (f" (only {', '.join(pickled[:3])}: pickled files are never loaded; convert them to "
                              "safetensors where you trust them, then import)" if pickled else ""))
    weights = {}
    for f in files:
        weights.update({k: v.float() if v.is_floating_point() else v for k, v in _load(f).items()})
    return weights


def _load(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors file; a truncated or garbled one is named."""
    try:
        return load_file(str(path))
    except Exception as err:          # safetensors raises its own error type
        raise ImportError_(f"'{path}' cannot be read as safetensors ({str(err).splitlines()[0]}); the export is "
                           "damaged or incomplete: export or download it again") from None


def read_export_config(source: Path) -> dict:
    """The export's config.json, as a JSON object (each problem named with the file)."""
    path = Path(source) / "config.json"
    if not path.is_file():
        raise ImportError_(f"'{source}' is not an export: no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ImportError_(f"{path} is not valid JSON ({err}); the export is damaged: export it again") from None
    if not isinstance(config, dict):
        raise ImportError_(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def _declaring() -> list[type]:
    """The drafter classes that declare their own formats (a subclass that inherits them, like Medusa-2's
    heads saved as Medusa, reads back as its parent)."""
    return [cls for cls in registry().values() if "formats" in vars(cls)]


def _manifest(source: Path) -> dict:
    """draftsmith's export manifest ({} for an export draftsmith did not write); a damaged one is named."""
    manifest, problem = export_manifest(source)
    if problem:
        raise ImportError_(f"'{source}' has a damaged draftsmith export manifest ({problem}): export it again, or "
                           f"delete {EXPORT_MARK} to import the export by its config alone")
    return manifest or {}


def check_format(source: Path, config: dict, fmt: str) -> bool:
    """--from must agree with what the export says it is: draftsmith's own manifest, and the drafter whose
    formats recognise its config.  True when draftsmith's manifest confirms the format."""
    written = _manifest(source).get("format")
    if written and written != fmt:
        raise ImportError_(f"'{source}' was exported by draftsmith as '{written}' ({EXPORT_MARK}), not '{fmt}': "
                           f"import it with --from {written}")
    _reader(source, config, fmt)
    return bool(written and written == fmt)


def _reader(source: Path, config: dict, fmt: str) -> ExportFormat:
    """The format declaration that reads this export as `fmt`, or an error naming the --from it needs."""
    offering = [f for cls in _declaring() for f in cls.formats if f.name == fmt and f.read is not None]
    if not offering:
        raise ImportError_(f"unknown format '{fmt}': draftsmith imports {', '.join(import_formats())}")
    if recognised := [f for f in offering if f.recognizes(config)]:
        return recognised[0]
    elsewhere = [(cls, f) for cls in _declaring() for f in cls.formats if f.read is not None and f.recognizes(config)]
    if elsewhere:
        cls = elsewhere[0][0]
        layouts = [f.name for owner, f in elsewhere if owner is cls]
        raise ImportError_(f"'{source}' holds {cls.title} in the {' / '.join(layouts)} layout, which no '{fmt}' export "
                           f"of {cls.title} can be; import it with --from {' or --from '.join(layouts)}")
    if len(offering) == 1:          # nothing recognises it: the one reader says what is wrong
        return offering[0]
    raise ImportError_(f"'{source}' does not look like an export any drafter reads as '{fmt}' (config.json names "
                       f"{config.get('architectures') or config.get('model_type') or 'no architecture'})")


def import_drafter(source: str | Path, fmt: str, target: Target):
    """The drafter an export in `fmt` holds, built for `target` (weights checked name by name)."""
    source = Path(source)
    config = read_export_config(source)
    confirmed = check_format(source, config, fmt)
    reader = _reader(source, config, fmt)
    one = source / reader.weights_file if reader.weights_file else None
    weights = ({k: v.float() if v.is_floating_point() else v for k, v in _load(one).items()}
               if one is not None and one.is_file() else _weights(source))
    made_for = _manifest(source).get("target")
    if isinstance(made_for, dict):        # draftsmith's own export names the target it was made for
        try:
            TargetIdentity.from_dict(made_for).require_same(target.identity, f"the export '{source}'")
        except TargetError as err:
            raise ImportError_(str(err)) from None
    try:
        return reader.read(config, weights, target, confirmed)
    except ImportFormatError as err:
        raise ImportError_(str(err)) from None


def import_checkpoint(source: str | Path, fmt: str, out_dir: str | Path, target: Target) -> Path:
    """Write the imported drafter as a draftsmith checkpoint (config.json, model.safetensors, README.md)."""
    out_dir = Path(out_dir)
    drafter = import_drafter(source, fmt, target)
    drafter.metadata[IMPORT_KEY] = {"path": str(Path(source).resolve()), "format": fmt}
    tmp = out_dir.with_name(out_dir.name + ".tmp-import")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_drafter(drafter, tmp)
        write_card(tmp)
        swap_directory(tmp, out_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise as_disk_full(err, tmp, "the imported checkpoint", "free some space or choose another directory, then "
                           "import again (nothing was written)") from None
    return out_dir
