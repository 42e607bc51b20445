"""The traffic `draftsmith bench` replays: a seeded sample of requests, per category.

Sources: MT-bench (its eight categories), HumanEval (`code`), or the user's JSONL (chats or prompts,
an optional `category` and `max_tokens` per line), or several of them joined by commas. At most
`limit` requests per category are drawn, seeded; the first user turn of each is the request. JSONL
lines without a prompt are skipped and counted.
"""
from __future__ import annotations

import collections
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from draftsmith.data import sources
from draftsmith.data.chat import fit_context, prompt_ids

UNCATEGORIZED = "uncategorized"


class TrafficError(ValueError):
    """A traffic source that cannot be replayed."""


class _Row(NamedTuple):
    """One request of a source before sampling: the whole chat, not yet tokenized."""
    id: str
    category: str
    messages: list[dict]
    max_tokens: int


@dataclass
class Request:
    id: str
    category: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Traffic:
    requests: list[Request]
    available: dict[str, int]         # category -> requests in the source
    skipped_without_prompt: int = 0   # JSONL lines with no prompt, messages or conversations


def _record_max_tokens(record: dict, where: str, default: int) -> int:
    value = record.get("max_tokens", default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise TrafficError(f"{where}: max_tokens must be a whole number >= 1, got {value!r}")
    return value


def _jsonl_traffic(path: Path, max_tokens: int) -> tuple[list[_Row], int]:
    """The rows of every line with a prompt, and how many lines had none."""
    if not path.exists():
        raise TrafficError(f"traffic file '{path}' does not exist; give mt-bench, humaneval or a JSONL file")
    stats, rows, skipped = sources.SourceStats(), [], 0
    try:
        with sources.open_source(path) as f:    # streamed, each line bounded: no file is held whole
            for number, _, line in sources.text_lines(f, path):
                skipped += _traffic_row(line, number, path, max_tokens, stats, rows)
    except sources.DataError as err:
        raise TrafficError(str(err)) from None
    return rows, skipped


def _traffic_row(line: str, number: int, path: Path, max_tokens: int, stats, rows: list) -> int:
    """Add the request on one line to `rows`: 0, or 1 when the line holds no prompt."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TrafficError(f"{path}:{number}: invalid JSON ({err.msg} at column {err.colno})") from None
    if isinstance(record, dict) and not ({"prompt", "messages", "conversations"} & record.keys()):
        return 1
    try:
        turns, rid, category = sources.record_turns(record, f"{path}:{number}")
    except sources.DataError:
        return 1
    conv = sources.normalize(turns, rid if rid is not None else f"{path.stem}-{number}", stats, category)
    if conv is None or not any(m["role"] == "user" for m in conv.messages):
        return 1
    limit = _record_max_tokens(record, f"{path}:{number}", max_tokens) if isinstance(record, dict) else max_tokens
    rows.append(_Row(conv.id, conv.category or UNCATEGORIZED, conv.messages, limit))
    return 0


def load_traffic(tokenizer, source: str, limit: int, seed: int, max_tokens: int, context: int | None = None,
                 long_prompts: str = "truncate") -> Traffic:
    """At most `limit` requests per category, drawn with `seed`; the first user turn is the request.

    source: mt-bench, humaneval or a JSONL file, or several of them joined by commas (one sample).
    context: the target's context length; a request that does not fit is cut or refused (fit_context)."""
    rows, skipped = [], 0
    for name in [part.strip() for part in source.split(",") if part.strip()]:
        if name in sources.PROMPT_SETS:
            rows += [_Row(c.id, c.category or ("code" if name == "humaneval" else UNCATEGORIZED), c.messages,
                          max_tokens) for c in sources.conversations(name)]
        else:
            found, without_prompt = _jsonl_traffic(Path(name).expanduser(), max_tokens)
            rows += found
            skipped += without_prompt
    counts = collections.Counter(row.id for row in rows)
    if any(n > 1 for n in counts.values()):
        twice = sorted(str(i) for i, n in counts.items() if n > 1)[:3]
        raise TrafficError(f"request ids repeat across '{source}' (e.g. {', '.join(twice)}): give each "
                           "source once, and each JSONL line its own 'id'")
    if not rows:
        raise TrafficError(f"no requests in '{source}' ({skipped} lines without a prompt); each line needs a "
                           "'prompt', 'messages' or 'conversations' field")
    by_category: dict[str, list] = {}
    for row in rows:
        by_category.setdefault(row.category, []).append(row)
    rng = random.Random(seed)
    requests = []
    for category in sorted(by_category):
        chosen = list(by_category[category])
        rng.shuffle(chosen)
        for row in sorted(chosen[:limit], key=lambda r: r.id):
            first_user = next(i for i, m in enumerate(row.messages) if m["role"] == "user")
            requests.append(Request(row.id, category, prompt_ids(tokenizer, row.messages[:first_user + 1]),
                                    row.max_tokens))
    if context:
        fitted = fit_context([(r.id, r.prompt, r.max_tokens) for r in requests], context, long_prompts,
                             "the traffic (--long-prompts)")
        for request, prompt in zip(requests, fitted):
            request.prompt = prompt
    return Traffic(requests, {c: len(v) for c, v in by_category.items()}, skipped)
