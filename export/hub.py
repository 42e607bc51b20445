"""Hub conventions for a checkpoint: the folder `draftsmith push` uploads (an allowlist of checked regular
files, exports beside it, no secrets and no local paths), and `Drafter.from_pretrained` for a directory or a Hub repository."""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import yaml

from draftsmith.heads.card import ADAPTER_DIR, CARD_FILE, LAST_EVAL_FILE, WEIGHTS_FILE, model_card, pushed_files
from draftsmith.heads.drafter import checkpoint_target, load_drafter, read_config
from draftsmith.heads.infra.device import resolve_device
from draftsmith.heads.infra.files import StorageError, human_size
from draftsmith.heads.infra import strict_yaml
from draftsmith.heads.runtime.assets import looks_like_hub_id

from .core import export
from .redaction import clean, clean_text
from .staging import PushError, adapter_limit, check_safetensors, check_text, check_weights, regular_file


def push_folder(checkpoint: Path, staging: Path, export_formats: tuple[str, ...] = (),
                dtype: str = "bfloat16", recipe_settings=None) -> tuple[Path, list[str]]:
    """The folder `draftsmith push` uploads, staged without touching the checkpoint, and the redactions made.

    Push uploads what it writes, not what it finds: an allowlist (weights, config, card, recipe, last eval,
    the adapter's config and safetensors) of regular files with one link, the weights checked as tensors and
    copied, every text file parsed and written anew from its cleaned structure (export/redaction.py): the
    recipe from its typed settings, the JSON files from their parse, the card from those cleaned files; an
    export per format in `export-FORMAT/`, treated the same way.  A file that does not parse as its kind
    is refused, and nothing is uploaded.  recipe_settings(raw dict) -> the recipe's typed settings as a dict,
    raising ValueError for what is not a recipe (the CLI passes train's; export does not import train)."""
    checkpoint, staging = Path(checkpoint), Path(staging)
    config = read_config(checkpoint)              # a damaged checkpoint is named before anything is copied
    shutil.rmtree(staging, ignore_errors=True)
    found: list[str] = []
    try:
        staging.mkdir(parents=True)
        for name in pushed_files():
            if regular_file(checkpoint / name, name):
                _stage(checkpoint / name, name, staging / name, config, checkpoint, found,
                       recipe_settings=recipe_settings)
        adapter = checkpoint / ADAPTER_DIR
        if regular_file(adapter, ADAPTER_DIR + "/"):
            (staging / ADAPTER_DIR).mkdir()
            for source in sorted(adapter.iterdir()):
                if source.name == "adapter_config.json" or source.suffix == ".safetensors":
                    name = f"{ADAPTER_DIR}/{source.name}"
                    regular_file(source, name)
                    _stage(source, name, staging / name, config, checkpoint, found)
        (staging / CARD_FILE).write_text(_card(checkpoint, staging, found), encoding="utf-8")
        for fmt in export_formats:   # written beside the staging (an export never lands in a checkpoint), then moved
            written = export(checkpoint, fmt, staging.with_name(f"{staging.name}-export-{fmt}"), dtype=dtype)
            for path in sorted(p for p in written.rglob("*") if p.is_file()):
                name = f"export-{fmt}/{path.relative_to(written)}"
                regular_file(path, name)
                _stage(path, name, path, config, checkpoint, found, capped=False)
            written.rename(staging / f"export-{fmt}")
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise StorageError(errno.ENOSPC, f"the disk is full staging the upload in '{staging.parent}' (the "
                               f"temporary directory: {human_size(shutil.disk_usage(staging.parent).free)} free); "
                               "free space there or point TMPDIR at a larger disk, then push again; nothing was "
                               "uploaded and the checkpoint is unchanged") from None
        raise
    return staging, found


def _stage(source: Path, name: str, dest: Path, config: dict, checkpoint: Path, found: list[str],
           capped: bool = True, recipe_settings=None) -> None:
    """One allowed file into the staging: tensors checked and copied; text parsed, cleaned and written anew.
    capped: an adapter's safetensors is at most adapter_limit (an export's weights are the drafter's own)."""
    if source.suffix == ".safetensors":
        if source.name == WEIGHTS_FILE and "/" not in name:
            check_weights(source, config)
        else:
            check_safetensors(source, name, adapter_limit(config) if capped else None)
        if dest != source:
            shutil.copyfile(source, dest)
        return
    text = check_text(source, name)
    if source.suffix not in (".json", ".yaml", ".md"):
        raise PushError(f"'{name}' is neither tensors nor a JSON, YAML or Markdown file draftsmith writes, so push "
                        "cannot check what it holds; remove it; nothing was uploaded")
    if source.suffix == ".md":
        dest.write_text(clean_text(text, name, found, checkpoint), encoding="utf-8")
        return
    parsed = _parse(text, name, recipe_settings)
    cleaned = clean(parsed, name, found, checkpoint)
    dest.write_text(json.dumps(cleaned, indent=1) + "\n" if source.suffix == ".json" else
                    yaml.safe_dump(cleaned, sort_keys=False), encoding="utf-8")


def _parse(text: str, name: str, recipe_settings=None):
    """The structure a text file holds; recipe.yaml through the typed settings (what a recipe can hold)."""
    if name.endswith(".json"):
        return json.loads(text)
    raw = strict_yaml.load(text) if name == "recipe.yaml" else yaml.safe_load(text)
    if name != "recipe.yaml" or recipe_settings is None:
        return raw
    try:
        return recipe_settings(raw if isinstance(raw, dict) else {"?": raw})
    except (ValueError, TypeError) as err:
        raise PushError(f"'recipe.yaml' in the checkpoint is not a draftsmith recipe ({str(err)[:160]}): push "
                        "uploads the recipe draftsmith saved; restore it, or remove it; nothing was uploaded") from None


def _card(checkpoint: Path, staging: Path, found: list[str]) -> str:
    """The model card, made from the cleaned files (and the cleaned progress): it says nothing they do not."""
    source = staging.with_name(staging.name + "-card")
    shutil.rmtree(source, ignore_errors=True)
    (source / "state").mkdir(parents=True)
    for name in pushed_files():
        if (staging / name).is_file() and not name.endswith(".safetensors"):
            shutil.copyfile(staging / name, source / name)
    progress = checkpoint / "state" / "progress.json"
    if regular_file(progress, "state/progress.json"):
        _stage(progress, "state/progress.json", source / "state" / "progress.json", {}, checkpoint, [])
    try:
        card = model_card(source)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise PushError(f"the model card cannot be made from '{checkpoint}' ({type(err).__name__}: "
                        f"{str(err)[:80]}): its {LAST_EVAL_FILE} or recipe.yaml is not what draftsmith wrote; "
                        "evaluate it again or restore them; nothing was uploaded") from None
    finally:
        shutil.rmtree(source, ignore_errors=True)
    return clean_text(card, CARD_FILE, found, checkpoint)


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
