"""Hub conventions for a checkpoint: the folder `draftsmith push` uploads (an allowlist of checked regular
files, exports beside it, no secrets and no local paths), and `Drafter.from_pretrained` for a directory or a Hub repository."""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

from draftsmith.heads.card import ADAPTER_DIR, CARD_FILE, LAST_EVAL_FILE, WEIGHTS_FILE, model_card, pushed_files
from draftsmith.heads.drafter import checkpoint_target, load_drafter, read_config
from draftsmith.heads.infra.device import resolve_device
from draftsmith.heads.infra.files import StorageError, human_size
from draftsmith.heads.runtime.assets import looks_like_hub_id

from .core import export
from .staging import PushError, adapter_limit, check_safetensors, check_text, check_weights, redact, regular_file, scrub


def push_folder(checkpoint: Path, staging: Path, export_formats: tuple[str, ...] = (),
                dtype: str = "bfloat16") -> tuple[Path, list[str]]:
    """The folder `draftsmith push` uploads, staged without touching the checkpoint, and the redactions made.
    An allowlist (weights, config, card, recipe, last eval, the adapter's config and safetensors) of regular
    files only, each checked as its kind (export/staging.py), an export per format in `export-FORMAT/`;
    secrets redacted and no absolute local path in any text file."""
    checkpoint, staging = Path(checkpoint), Path(staging)
    config = read_config(checkpoint)              # a damaged checkpoint is named before anything is copied
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        for name in pushed_files():
            if regular_file(checkpoint / name, name):
                _check(checkpoint / name, name, config)
                shutil.copyfile(checkpoint / name, staging / name)
        adapter = checkpoint / ADAPTER_DIR
        if regular_file(adapter, ADAPTER_DIR + "/"):
            for source in sorted(adapter.iterdir()):
                if source.name == "adapter_config.json" or source.suffix == ".safetensors":
                    name = f"{ADAPTER_DIR}/{source.name}"
                    regular_file(source, name)
                    _check(source, name, config)
                    (staging / ADAPTER_DIR).mkdir(exist_ok=True)
                    shutil.copyfile(source, staging / name)
        try:
            card = model_card(checkpoint)                                # the card as it is now, in the staging only
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise PushError(f"the model card cannot be made from '{checkpoint}' ({type(err).__name__}: "
                            f"{str(err)[:80]}): its {LAST_EVAL_FILE} or recipe.yaml is not what draftsmith wrote; "
                            "evaluate it again or restore them; nothing was uploaded") from None
        (staging / CARD_FILE).write_text(card)
        for fmt in export_formats:   # written beside the staging (an export never lands in a checkpoint), then moved
            written = export(checkpoint, fmt, staging.with_name(f"{staging.name}-export-{fmt}"), dtype=dtype)
            written.rename(staging / f"export-{fmt}")
        redactions = []
        for path in sorted(staging.rglob("*")):
            if path.is_file() and path.suffix in (".json", ".yaml", ".md"):
                text, found = redact(check_text(path, str(path.relative_to(staging))), str(path.relative_to(staging)))
                redactions += found
                path.write_text(scrub(text, checkpoint), encoding="utf-8")
                check_text(path, str(path.relative_to(staging)))         # still its kind after the rewrite
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise StorageError(errno.ENOSPC, f"the disk is full staging the upload in '{staging.parent}' (the "
                               f"temporary directory: {human_size(shutil.disk_usage(staging.parent).free)} free); "
                               "free space there or point TMPDIR at a larger disk, then push again; nothing was "
                               "uploaded and the checkpoint is unchanged") from None
        raise
    return staging, redactions


def _check(path: Path, name: str, config: dict) -> None:
    if path.name == WEIGHTS_FILE and "/" not in name:
        check_weights(path, config)
    elif path.suffix == ".safetensors":
        check_safetensors(path, name, adapter_limit(config))
    else:
        check_text(path, name)


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
