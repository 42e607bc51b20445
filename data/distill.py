"""Self-distillation: the target regenerates the assistant turns, so drafters learn what it says.

Work is cut into fixed batches (conversation order from the seed, grouped by
prompt length to limit padding).  Each finished batch is one JSONL shard with
the exact token ids the target read and wrote (`input_ids`; `loss_mask` 1 on
reply tokens) and, when the drafter's layers are known, the hidden states
those forwards computed (data/features.py).  Both are written atomically
(temporary file, then rename), the features first, so a run killed at any
point loses at most the batch in flight and a restart skips every finished
shard: no duplicates, nothing lost.  Sampling is seeded per batch, so a
resumed run gives what an uninterrupted one would.  At the end the shards
become an Arrow dataset (`tokenized/`: id, input_ids, loss_mask, shard, row).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from draftsmith.heads.target import Target

from . import features as feature_cache
from . import sources
from .chat import tokenize_chat
from .generate import generate_batch

log = logging.getLogger(__name__)


@dataclass
class DataSettings:
    """How training data is made (the recipe's `data:` section)."""

    source: str = "sharegpt"
    """sharegpt, mt-bench, humaneval, a .jsonl/.json file, or a datasets directory."""
    backend: str = "transformers"
    """Who regenerates: transformers (draftsmith's batched engine; keeps the features) or vllm (optional extra)."""
    max_conversations: int | None = 2000
    """Conversations taken from the source (after shuffling with the seed), rounded up to whole batches; null = all."""
    regenerate: bool = True
    """Self-distillation: the target rewrites the assistant turns (false: use the source's own)."""
    max_turns: int = 1
    """Assistant turns regenerated per conversation; later turns are dropped."""
    max_prompt_tokens: int = 384
    """Longest rendered prompt (chat so far) given to the target."""
    long_prompts: str = "skip"
    """What to do with longer prompts: skip (counted) or truncate (the user turn is cut)."""
    max_new_tokens: int = 256
    """Longest regenerated assistant turn."""
    temperature: float = 0.0
    """0 = greedy regeneration; > 0 samples (seeded per batch)."""
    top_p: float = 1.0
    """Nucleus sampling mass when temperature > 0."""
    batch_size: int = 64
    """Conversations generated together."""
    max_minutes: float | None = None
    """Stop generating after this many minutes (finished batches are kept); null = no cap."""
    max_seq_len: int = 1024
    """Training sequences are cut to this many tokens."""

    def __post_init__(self):
        if self.backend not in ("transformers", "vllm"):
            raise ValueError(f"data.backend must be transformers or vllm, got '{self.backend}'")
        if self.long_prompts not in ("skip", "truncate"):
            raise ValueError(f"data.long_prompts must be 'skip' or 'truncate', got '{self.long_prompts}'")
        for name in ("max_turns", "max_prompt_tokens", "max_new_tokens", "batch_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"data.top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"data.temperature must be >= 0, got {self.temperature}")


@dataclass
class DataReport:
    conversations: int
    generated_tokens: int
    seconds: float
    skipped_long_prompts: int
    truncated_prompts: int
    source_summary: str
    training_tokens: int
    assistant_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def fingerprint(settings: DataSettings, seed: int, target_identity: dict) -> str:
    """What the shards depend on: a resumed run must agree on all of it."""
    keys = asdict(settings)
    for free in ("max_minutes", "max_seq_len", "max_conversations"):   # these may change between resumes
        keys.pop(free)
    keys["seed"] = seed
    keys["target"] = target_identity["weights_sha256"]
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_shard(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted((Path(data_dir) / "shards").glob("shard-*.jsonl"))


def _fit_prompt(target: Target, messages: list[dict], settings: DataSettings, counts: dict):
    """The prompt's ids and mask (earlier replies marked), or None if it is too long and cannot be cut."""
    chat = tokenize_chat(target.tokenizer, messages, add_generation_prompt=True)
    if len(chat.input_ids) <= settings.max_prompt_tokens:
        return chat
    if settings.long_prompts == "skip":
        counts["skipped_long_prompts"] += 1
        return None
    # truncate: cut the last user turn's text until the rendered prompt fits
    overflow = len(chat.input_ids) - settings.max_prompt_tokens
    content_ids = target.tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
    if overflow + 8 >= len(content_ids):
        counts["skipped_long_prompts"] += 1
        return None
    messages[-1] = dict(messages[-1], content=target.tokenizer.decode(content_ids[: len(content_ids) - overflow - 8]))
    counts["truncated_prompts"] += 1
    chat = tokenize_chat(target.tokenizer, messages, add_generation_prompt=True)
    return chat if len(chat.input_ids) <= settings.max_prompt_tokens else None


def plan_batches(convs: list[sources.Conversation], batch_size: int, seed: int) -> list[list[sources.Conversation]]:
    """Shuffle with the seed, then sort each window of 8 batches by length so a batch pads little."""
    order = list(convs)
    random.Random(seed).shuffle(order)
    window = batch_size * 8
    batches = []
    for start in range(0, len(order), window):
        group = sorted(order[start:start + window], key=lambda c: len(c.messages[0]["content"]))
        batches.extend(group[i:i + batch_size] for i in range(0, len(group), batch_size))
    return batches


def regenerate_batch(target: Target, batch: list[sources.Conversation], settings: DataSettings,
                     generator: torch.Generator, counts: dict, on_tokens, capture_layers=()) -> list[dict]:
    """Rewrite up to max_turns assistant turns of each conversation, turn by turn.

    A record is the last turn's prompt + reply, as ids, with the features of
    that one forward pass when capture_layers is given.
    """
    chats = {c.id: [] for c in batch}
    records: dict[str, dict] = {}
    alive = list(batch)
    for turn in range(settings.max_turns):
        jobs = []
        for conv in alive:
            users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
            if turn >= len(users):
                continue
            head = conv.messages[: users[0]] if turn == 0 else []      # a system turn before the first question
            messages = chats[conv.id] + head + [dict(conv.messages[users[turn]])]
            prompt = _fit_prompt(target, messages, settings, counts)
            if prompt is not None:
                jobs.append((conv, messages, prompt))
        if not jobs:
            break
        prompts = [p.input_ids for _, _, p in jobs]
        if settings.backend == "vllm":
            from . import vllm_backend
            seed = int(torch.randint(0, 2 ** 31, (1,), generator=generator))
            outs = vllm_backend.generate_batch(target, prompts, settings.max_new_tokens, settings.temperature,
                                               settings.top_p, seed, on_tokens)
        else:
            outs = generate_batch(target, prompts, settings.max_new_tokens, settings.temperature, settings.top_p,
                                  generator, on_tokens=on_tokens, capture_layers=capture_layers)
        alive = []
        for (conv, messages, prompt), out in zip(jobs, outs):
            reply_ids = [t for t in out.token_ids if t not in target.eos_token_ids]
            reply = target.tokenizer.decode(reply_ids, skip_special_tokens=True)
            if not reply.strip():
                continue
            counts["generated_tokens"] += len(out.token_ids)
            chats[conv.id] = messages + [{"role": "assistant", "content": reply}]
            records[conv.id] = {"id": conv.id, "messages": chats[conv.id],
                                "input_ids": prompt.input_ids + out.token_ids,
                                "loss_mask": prompt.loss_mask + [1] * len(out.token_ids),
                                "features": out.features}
            if out.stopped:
                alive.append(conv)   # a reply cut at max_new_tokens ends the conversation
    return [records[c.id] for c in batch if c.id in records]


def make_data(target: Target, settings: DataSettings, out_dir: Path, seed: int, progress: bool = True,
              capture_layers=()) -> DataReport:
    """Build (or resume) the shards in out_dir, their feature cache (capture_layers) and `tokenized/`."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    (out_dir / "shards").mkdir(parents=True, exist_ok=True)
    _check_manifest(out_dir, settings, seed, target)
    stats = sources.SourceStats()
    convs = list(sources.conversations(settings.source, stats=stats))
    log.info("source %s: %s", settings.source, stats.summary())
    batches = plan_batches(convs, settings.batch_size, seed)
    if settings.max_conversations is not None:
        # whole batches only, so a resume with another max_conversations reuses every shard as it is
        batches = batches[: -(-settings.max_conversations // settings.batch_size)]
    # vLLM hands back no hidden states: its shards get their features from one forward each, afterwards
    capture_layers = sorted(set(capture_layers)) if settings.regenerate and settings.backend == "transformers" else []
    features_dir = feature_cache.cache_dir(out_dir, capture_layers)
    if capture_layers:
        upper = sum(len(b) for b in batches) * (settings.max_prompt_tokens + settings.max_new_tokens)
        log.info("feature cache %s: at most %.0f MB (layers %s, bf16)", features_dir,
                 feature_cache.estimate_bytes(upper, capture_layers, target.hidden_size) / 1e6, capture_layers)
    counts = {"generated_tokens": 0, "skipped_long_prompts": 0, "truncated_prompts": 0}
    start = time.time()
    bar = tqdm(total=sum(len(b) for b in batches), desc="self-distillation" if settings.regenerate else "reading",
               unit="conv", disable=not progress, dynamic_ncols=True)
    new_tokens = [0]

    def on_tokens(n):
        new_tokens[0] += n
        bar.set_postfix_str(f"{new_tokens[0] / max(time.time() - start, 1e-6):.0f} tok/s", refresh=False)

    for index, batch in enumerate(batches):
        shard = out_dir / "shards" / f"shard-{index:05d}.jsonl"
        if shard.exists():
            bar.update(len(batch))
            continue
        if settings.max_minutes is not None and time.time() - start > settings.max_minutes * 60:
            log.warning("data.max_minutes=%s reached: kept %d finished batches; rerun to continue",
                        settings.max_minutes, index)
            break
        if settings.regenerate:
            generator = torch.Generator(device=target.device).manual_seed(seed * 1_000_003 + index)
            records = regenerate_batch(target, batch, settings, generator, counts, on_tokens, capture_layers)
        else:
            records = [_as_is(target, c, settings) for c in batch]
            records = [r for r in records if r is not None]
        if capture_layers:
            feature_cache.write_shard(features_dir / f"shard-{index:05d}.safetensors",
                                      [r.pop("features") for r in records], capture_layers,
                                      target.identity.weights_sha256)
        for r in records:
            r.pop("features", None)
        write_atomic(shard, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        bar.update(len(batch))
    bar.close()
    seconds = time.time() - start
    return finish(out_dir, settings, stats, counts, seconds)


def _as_is(target: Target, conv: sources.Conversation, settings: DataSettings) -> dict | None:
    chat = tokenize_chat(target.tokenizer, conv.messages)
    if sum(chat.loss_mask) == 0:
        return None
    return {"id": conv.id, "messages": conv.messages, "input_ids": chat.input_ids, "loss_mask": chat.loss_mask}


def _check_manifest(out_dir: Path, settings: DataSettings, seed: int, target: Target) -> None:
    key = fingerprint(settings, seed, target.identity.to_dict()) if settings.regenerate else "source-as-is"
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("fingerprint") != key:
            raise ValueError(
                f"{out_dir} holds data made with other settings (fingerprint {manifest.get('fingerprint')} vs {key}: "
                f"it was {manifest.get('settings')}). Use another output_dir, or delete {out_dir} to start over")
    write_atomic(manifest_path, json.dumps({"fingerprint": key, "settings": asdict(settings), "seed": seed,
                                            "target": target.identity.to_dict()}, indent=1))


def finish(out_dir: Path, settings: DataSettings, stats, counts: dict, seconds: float) -> DataReport:
    """Index every shard's records into `tokenized/` (cut to max_seq_len)."""
    import datasets

    rows = {"id": [], "input_ids": [], "loss_mask": [], "shard": [], "row": []}
    for shard in shard_paths(out_dir):
        for row, record in enumerate(read_shard(shard)):
            mask = record["loss_mask"][: settings.max_seq_len]
            if sum(mask) == 0:
                continue
            rows["id"].append(record["id"])
            rows["input_ids"].append(record["input_ids"][: settings.max_seq_len])
            rows["loss_mask"].append(mask)
            rows["shard"].append(shard.stem)
            rows["row"].append(row)
    if not rows["id"]:
        raise ValueError(f"no conversations were produced from source '{settings.source}' ({stats.summary()}; "
                         f"{counts['skipped_long_prompts']} prompts longer than data.max_prompt_tokens="
                         f"{settings.max_prompt_tokens} skipped)")
    table = datasets.Dataset.from_dict(rows)
    tmp = out_dir / "tokenized.tmp"
    table.save_to_disk(str(tmp))
    _replace_dir(tmp, out_dir / "tokenized")
    return DataReport(
        conversations=len(rows["id"]), generated_tokens=counts["generated_tokens"], seconds=seconds,
        skipped_long_prompts=counts["skipped_long_prompts"], truncated_prompts=counts["truncated_prompts"],
        source_summary=stats.summary(), training_tokens=sum(len(x) for x in rows["input_ids"]),
        assistant_tokens=sum(sum(m) for m in rows["loss_mask"]))


def _replace_dir(tmp: Path, final: Path) -> None:
    import shutil

    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
