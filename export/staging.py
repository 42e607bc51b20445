"""What `draftsmith push` lets leave the machine: regular files with one link only, each a real file of its kind
and of a sane size, and no absolute local path (docs/export.md, "What push uploads"); the secrets go by
structure (export/redaction.py).

Every check refuses by name before anything is uploaded; the checkpoint itself is never changed.
"""
from __future__ import annotations

import json
import os
import re
import stat
import struct
from pathlib import Path

import yaml

from draftsmith.heads.infra.files import human_size, sha256_file

TEXT_LIMIT = 16 << 20            # a config, recipe, eval report or card: far below this
HEADER_LIMIT = 100 << 20         # safetensors' own cap on a header
REDACTED = "<redacted>"


class PushError(ValueError):
    """A push that cannot start, or an upload that failed (nothing uploaded)."""


def regular_file(path: Path, name: str) -> bool:
    """True for a regular file; False if absent.  A symbolic link (to anything, even inside the checkpoint),
    a device, a pipe or a socket under an uploaded name is refused: its content is not the checkpoint's."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        raise PushError(f"'{name}' in the checkpoint is a symbolic link (to '{os.readlink(path)}'): push uploads "
                        "regular files only; replace the link by the file itself, or remove it; nothing was uploaded")
    if stat.S_ISDIR(info.st_mode) and not name.endswith("/"):
        raise PushError(f"'{name}' in the checkpoint is a directory, where push expects a file; nothing was uploaded")
    if not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode):
        raise PushError(f"'{name}' in the checkpoint is not a regular file (a device, pipe or socket): push uploads "
                        "regular files only; remove it; nothing was uploaded")
    if stat.S_ISREG(info.st_mode) and info.st_nlink != 1:
        raise PushError(f"'{name}' in the checkpoint has {info.st_nlink} hard links: its bytes are also another "
                        "file's, elsewhere on this machine, so push does not take it for the checkpoint's own; "
                        "replace it by a copy (cp --no-preserve=links) or remove it; nothing was uploaded")
    return True


def check_safetensors(path: Path, name: str, limit: int | None = None) -> int:
    """The file is a safetensors file: a JSON header of tensors whose data exactly fills the rest of the file
    (no trailing bytes), under `limit` bytes when given.  Returns the size."""
    size = path.stat().st_size
    if limit is not None and size > limit:
        raise PushError(f"'{name}' is {human_size(size)}, far more than a file of its kind for this checkpoint "
                        f"(at most {human_size(limit)}); remove it or push the right file; nothing was uploaded")
    with open(path, "rb") as f:
        head = f.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        problem = None
        if not 2 <= length <= min(HEADER_LIMIT, size - 8):
            problem = f"its header length ({length}) does not fit a file of {size} bytes"
        else:
            try:
                header = json.loads(f.read(length))
                ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
                starts = sorted(int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__")
                if not ends or max(ends) != size - 8 - length or starts[0] != 0:
                    problem = (f"its tensors cover {max(ends, default=0)} bytes of the {size - 8 - length} after "
                               "the header")
            except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
                problem = f"its header is not a safetensors header ({type(err).__name__})"
    if problem:
        raise PushError(f"'{name}' is not a valid safetensors file: {problem}; nothing was uploaded")
    return size


def check_text(path: Path, name: str) -> str:
    """A JSON, YAML or Markdown file under TEXT_LIMIT that parses as its kind."""
    size = path.stat().st_size
    if size > TEXT_LIMIT:
        raise PushError(f"'{name}' is {human_size(size)}, far more than a {path.suffix} file of a checkpoint "
                        f"holds (at most {human_size(TEXT_LIMIT)}); nothing was uploaded")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            json.loads(text)
        elif path.suffix == ".yaml":
            yaml.safe_load(text)
    except (UnicodeDecodeError, ValueError, yaml.YAMLError) as err:
        raise PushError(f"'{name}' does not parse as {path.suffix[1:].upper()} ({type(err).__name__}); fix or "
                        "remove it; nothing was uploaded") from None
    return text


def adapter_limit(config: dict) -> int:
    """An upper bound on a LoRA adapter's bytes: the whole target in fp32, twice over (an adapter is a
    fraction of it)."""
    t = config.get("target") or {}
    hidden, layers, vocab = (int(t.get(k) or 0) for k in ("hidden_size", "num_layers", "vocab_size"))
    return 2 * 4 * (24 * hidden * hidden * layers + 2 * vocab * hidden) or (1 << 30)


def check_weights(path: Path, config: dict) -> None:
    """The drafter's weights are the file its config names by digest."""
    check_safetensors(path, path.name)
    expected = config.get("weights_sha256")
    if expected and sha256_file(path) != expected:
        raise PushError(f"'{path.name}' is not the file this checkpoint was saved with (its SHA-256 differs from "
                        "config.json's weights_sha256): it changed on disk; train again or restore it; nothing was "
                        "uploaded")


# -- local paths ------------------------------------------------------------------------------------------

_SEGMENT = r"[^\s/\\\"'`<>|(){}\[\],;]+"
PATH_PATTERNS = (
    # Windows-looking: C:\dir\file, C:/dir, JSON-escaped C:\\dir, and UNC \\server\share
    re.compile(r"(?<![\w])[A-Za-z]:(?:\\\\|\\|/)(?:[^\"'`<>|\n\\/]+(?:\\\\|\\|/))*[^\"'`<>|\n\\/,;)]*"),
    re.compile(r"(?<![\w\\])\\\\(?:\\\\)?[\w.$-]+(?:\\{1,2}[^\s\\\"'`<>|]+)+\\?"),
    # ~ and ~user
    re.compile(r"(?<![\w/])~[\w.-]*(?:/" + _SEGMENT + r")+/?"),
    # POSIX: a / not part of a URL, a relative path or a fraction, then one or more segments
    re.compile(r"(?<![\w.~:/\\-])/" + _SEGMENT + r"(?:/" + _SEGMENT + r")*/?"),
)
QUOTED_PATH = re.compile(r"""(?P<q>["'`])(?P<path>(?:/|~|[A-Za-z]:[\\/]|\\\\)[^"'`\n]*?)(?P=q)""")
YAML_PATH = re.compile(r"(?m)^(?P<lead>\s*(?:- |[\w.-]+:\s+))(?P<path>(?:/|~/|[A-Za-z]:[\\/]|\\\\)[^\n#]*?)\s*$")


def last_part(path: str) -> str:
    parts = [p for p in re.split(r"[\\/]+", path.strip()) if p and p != "~" and not re.fullmatch(r"[A-Za-z]:", p)]
    return parts[-1] if parts else "."


def scrub(text: str, checkpoint: Path) -> str:
    """`text` with no absolute local path, existing here or not: the checkpoint's own becomes relative to it
    (.), any other its last part.  Quoted paths (JSON strings, YAML and Markdown quotes) and YAML values are
    taken whole, spaces included; a bare path in prose ends at a space."""
    root = str(Path(checkpoint).resolve())
    for form in {root, str(checkpoint), str(Path(checkpoint).absolute())}:
        if form.startswith("/"):
            text = text.replace(form + "/", "./").replace(form + "\"", ".\"")
    text = QUOTED_PATH.sub(lambda m: m.group("q") + last_part(m.group("path")) + m.group("q"), text)
    text = YAML_PATH.sub(lambda m: m.group("lead") + last_part(m.group("path")), text)
    for pattern in PATH_PATTERNS:
        text = pattern.sub(lambda m: last_part(m.group(0)), text)
    return text


def local_paths(text: str) -> list[str]:
    """Absolute local paths still in `text` (the check after scrubbing)."""
    return [m.group(0) for pattern in PATH_PATTERNS for m in pattern.finditer(text)]
