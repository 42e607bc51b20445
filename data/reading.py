"""The one way draftsmith opens and bounds a source file (data/sources.py reads chats through it): a
regular file only, gzip checked by its magic bytes, every record at most MAX_LINE_BYTES, UTF-8 errors named
with the file and the line or byte."""
from __future__ import annotations

import codecs
import gzip
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

MAX_LINE_BYTES = 8 << 20       # one JSONL record: 2M tokens or so, beyond any target's context


class DataError(ValueError):
    """Input data that cannot be read as conversations."""


def open_source(path: Path):
    """The one way a source file is opened for reading (JSON, JSONL, gzip): a regular file (a FIFO, a device or
    a directory under a data file's name is refused before anything reads it), in binary, through gzip when
    named .gz (and refused by name when it is not gzip).  Records are then bounded by MAX_LINE_BYTES and
    decoded as UTF-8 with the file and line or byte named (jsonl, iter_json_array)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"data file '{path}' does not exist") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"data file '{path}' is not a regular file (a pipe, device or directory): give a file")
    if path.suffix == ".gz":
        with open(path, "rb") as f:
            if f.read(2) != b"\x1f\x8b":
                raise DataError(f"'{path}' is named .gz but is not gzip-compressed: rename it (.jsonl) or compress "
                                "it (gzip FILE)")
        return gzip.open(path, "rb")
    return open(path, "rb")


def iter_json_array(path: Path, chunk_size: int = 1 << 20) -> Iterator[object]:
    """Stream the elements of a top-level JSON array, each at most MAX_LINE_BYTES.

    A file cut off mid-record ends the stream quietly; the generator's return
    value (StopIteration.value) is True in that case, False at a proper "]".
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    read = 0

    def more_text(f) -> str:
        nonlocal read
        raw = f.read(chunk_size)
        try:
            text = utf8.decode(raw, final=not raw)
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 ({err.reason} near byte {read + err.start}); re-encode the file as "
                            "UTF-8") from None
        read += len(raw)
        return text if raw else None

    with open_source(path) as f:
        buffer = more_text(f) or ""
        pos = buffer.find("[")
        if pos < 0:
            raise DataError(f"{path}: not a JSON array")
        pos += 1
        eof, count = False, 0
        while True:
            while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buffer) and buffer[pos] == "]":
                return False
            try:
                item, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                if eof:
                    return True   # cut off mid-record
                if len(buffer) - pos > MAX_LINE_BYTES:
                    raise DataError(f"{path}: record {count} is more than {MAX_LINE_BYTES >> 20} MiB: a conversation "
                                    "or prompt this long is refused (no context holds it); remove or split it") from None
                more = more_text(f)
                eof = more is None
                buffer = buffer[pos:] + (more or "")
                pos = 0
                continue
            yield item
            count += 1
            pos = end
            if pos > chunk_size:
                buffer, pos = buffer[pos:], 0


def read_line(f, path: Path) -> bytes:
    """One line of at most MAX_LINE_BYTES + 1 bytes; a broken gzip stream named with the file."""
    try:
        return f.readline(MAX_LINE_BYTES + 1)
    except (OSError, EOFError) as err:            # gzip.BadGzipFile is an OSError
        raise DataError(f"'{path}' is not a readable gzip stream ({err}): re-compress it, or give the "
                        "uncompressed .jsonl") from None


def text_lines(f, path: Path) -> Iterator[tuple[int, bytes, str]]:
    """(line number, bytes, text) of each non-blank line of a file from open_source: at most MAX_LINE_BYTES,
    UTF-8; a DataError names the file, the line and the fix."""
    number = 0
    while raw := read_line(f, path):
        number += 1
        if len(raw) > MAX_LINE_BYTES:
            raise DataError(f"{path}:{number}: the line is more than {MAX_LINE_BYTES >> 20} MiB: a conversation "
                            "or prompt this long is refused (no context holds it); remove or split it")
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start}); "
                            "re-encode the file as UTF-8") from None
        yield number, raw, text


def only_blank_after(f) -> bool:
    """Nothing but whitespace is left in the file (read in bounded pieces)."""
    while piece := f.read(1 << 20):
        if piece.strip():
            return False
    return True
