"""Reading back a file draftsmith wrote earlier: a data manifest, a checkpoint's progress and scheduler state,
a run's last evaluation, an export's report.  Such a file may have been cut by a full disk, edited by hand or
copied half-way; it is parsed and its shape checked before any of it is used, and a bad one is named in one
line with what to do (docs/errors.md lists every such file and its fix).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

NUMBER = (int, float)


class KeptFileError(ValueError):
    """A file draftsmith wrote earlier and reads back, damaged: not JSON, or not the shape it was written in."""


def _fits(value, kind) -> bool:
    if kind is NUMBER or kind in (int, float):
        wanted = NUMBER if kind is float or kind is NUMBER else int
        return (isinstance(value, wanted) and not isinstance(value, bool)
                and (not isinstance(value, float) or math.isfinite(value)))
    return isinstance(value, kind)


def read_kept_json(path: str | Path, what: str, fix: str, shape: dict | None = None) -> dict:
    """The JSON object in `path`, with each key of `shape` present and of its type (a type or a tuple of
    types; int and float are finite numbers, never booleans); else KeptFileError naming the file, what it
    is (`what`), what is wrong with it and `fix`."""
    path = Path(path)

    def bad(problem: str) -> KeptFileError:
        return KeptFileError(f"{path} ({what}) is damaged: {problem}. {fix}")

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise bad(f"not UTF-8 text (byte {err.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise bad(f"not JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
    if not isinstance(value, dict):
        raise bad(f"a JSON {type(value).__name__}, not an object")
    for key, kind in (shape or {}).items():
        if key not in value:
            raise bad(f"it has no '{key}'")
        if not _fits(value[key], kind):
            raise bad(f"'{key}' is {json.dumps(value[key])[:40]}, not {_name(kind)}")
    return value


def _name(kind) -> str:
    if kind is NUMBER or kind is float:
        return "a finite number"
    if isinstance(kind, tuple):
        return " or ".join(_name(k) for k in kind)
    return {int: "an integer", str: "a string", dict: "an object", list: "a list", bool: "true or false"}.get(
        kind, kind.__name__)
