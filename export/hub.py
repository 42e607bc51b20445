"""Hub conventions for a checkpoint: the folder `draftsmith push` uploads (an allowlist, exports beside
it, no local paths), and `Drafter.from_pretrained` for a directory or a Hub repository."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from draftsmith.heads.card import ADAPTER_DIR, CARD_FILE, model_card, pushed_files
from draftsmith.heads.drafter import checkpoint_target, load_drafter, read_config
from draftsmith.heads.infra.device import resolve_device
from draftsmith.heads.runtime.assets import looks_like_hub_id

from .core import export


def push_folder(checkpoint: Path, staging: Path, export_formats: tuple[str, ...] = (), dtype: str = "bfloat16") -> Path:
    """The folder `draftsmith push` uploads, staged without touching the checkpoint: an allowlist (weights,
    config, card, recipe, last eval, the adapter's config and safetensors), an export per format in
    `export-FORMAT/`, and no absolute local path in any of it (`_scrub`)."""
    checkpoint, staging = Path(checkpoint), Path(staging)
    read_config(checkpoint)                       # a damaged checkpoint is named before anything is copied
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in pushed_files():
        if (checkpoint / name).is_file():
            shutil.copy2(checkpoint / name, staging / name)
    adapter = checkpoint / ADAPTER_DIR
    for source in sorted(adapter.glob("*")) if adapter.is_dir() else ():
        if source.is_file() and (source.name == "adapter_config.json" or source.suffix == ".safetensors"):
            (staging / ADAPTER_DIR).mkdir(exist_ok=True)
            shutil.copy2(source, staging / ADAPTER_DIR / source.name)
    (staging / CARD_FILE).write_text(model_card(checkpoint))          # the card as it is now, in the staging only
    for fmt in export_formats:       # written beside the staging (an export never lands in a checkpoint), then moved
        written = export(checkpoint, fmt, staging.with_name(f"{staging.name}-export-{fmt}"), dtype=dtype)
        written.rename(staging / f"export-{fmt}")
    for path in staging.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".yaml", ".md"):
            path.write_text(_scrub(path.read_text(encoding="utf-8"), checkpoint))
    return staging


def _scrub(text: str, checkpoint: Path) -> str:
    """`text` with no absolute local path: the checkpoint's own becomes relative to it (.), any other
    absolute path that exists here its last part, the home directory ~."""
    root = str(checkpoint.resolve())
    text = text.replace(root + "/", "./").replace(root, ".")

    def local(match):
        found = match.group(0)
        return Path(found).name if Path(found).exists() and found != "/" else found

    text = re.sub(r"(?<![\w.~])/(?:[\w.+-]+/)*[\w.+-]+", local, text)
    return text.replace(str(Path.home()), "~")


class Drafter:
    """Loading a drafter the way Hub users expect."""

    @staticmethod
    def from_pretrained(path_or_repo: str | Path, target=None, dtype: str = "auto", device: str = "auto",
                        revision: str | None = None):
        """A drafter from a checkpoint directory or a Hub repository holding one (`draftsmith push`), on
        its target: `target` if given (checked against the checkpoint's identity), else the one the
        checkpoint names."""
        directory = Path(path_or_repo).expanduser()
        if not directory.is_dir():
            directory = _snapshot(str(path_or_repo), revision)
        config = read_config(directory)
        if target is None:
            target = checkpoint_target(config, dtype, resolve_device(device))
        return load_drafter(directory, target)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download  # only when a drafter comes from the Hub

    if not looks_like_hub_id(repo_id):
        raise FileNotFoundError(f"'{repo_id}' is neither a checkpoint directory nor a Hub repository id (owner/name)")
    try:
        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=[*pushed_files(), "adapter/*"]))
    except Exception as err:  # noqa: BLE001 - offline, missing, private: one message with the cause
        raise FileNotFoundError(f"drafter '{repo_id}' could not be fetched from the Hugging Face Hub "
                                f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}); "
                                "give a local checkpoint directory, or check the id, the network and HF_TOKEN") from None
