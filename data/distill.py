"""Training data the target labels itself, in three modes (`data.mode`):

- regenerate: the target rewrites the assistant turns (self-distillation: on-policy text, one decode
  step per token, about 200 tokens/s on 2 CPU cores);
- prefill: the target reads the source's own conversations, every assistant turn, in one forward
  per batch (several times faster per token); its own next-token distribution at every reply
  position, recomputed from the final-layer features kept in the cache, is the label;
- mix: a share of the batches regenerated (`data.regenerate_share`), the rest prefilled.
In every mode the labels come from the target: the text may be the source's, the targets never are.

Work is cut into fixed batches (conversation order from the seed, grouped by
prompt length to limit padding).  Each finished batch is one JSONL shard with
the exact token ids the target read and wrote (`input_ids`; `loss_mask` 1 on
reply tokens) and, when the drafter's layers are known, the hidden states
those forwards computed (data/features.py).  Both are written atomically
(temporary file, then rename), the features first, so a run killed at any
point loses at most the batch in flight and a restart skips every finished
shard: no duplicates, nothing lost.  At the time cap (`data.max_minutes`) the
finished conversations of shards still in flight are written as parts of
their shard (`shard-00003.part0.jsonl`); a rerun makes only the rest.  Sampling is seeded per batch, so a
resumed run gives what an uninterrupted one would.  At the end the shards
become an Arrow dataset (`tokenized/`: id, input_ids, loss_mask, shard, row).
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.heads.files import free_bytes, human_size, require_free_space, swap_directory, write_atomic
from draftsmith.heads.target import Target

from . import features as feature_cache
from . import sources
from .chat import tokenize_chat, tokenize_turns
from .regenerate import Regenerator, ShardWork, regenerate_batch

log = logging.getLogger(__name__)


@dataclass
class DataSettings:
    """How training data is made (the recipe's `data:` section)."""

    source: str = "sharegpt"
    """sharegpt, mt-bench, humaneval, a .jsonl/.json/.parquet/.arrow/.csv file, a datasets directory, or a
    dataset id already in the local Hugging Face cache (e.g. HuggingFaceH4/ultrachat_200k)."""
    split: str = "train"
    """The split of a `datasets` source (a file through load_dataset, or a cached dataset id)."""
    messages_field: str | None = None
    """The column holding each chat's turns (OpenAI or ShareGPT style); null: messages or conversations."""
    prompt_field: str | None = None
    """Instead: the column holding one user prompt per record (the target writes the reply)."""
    streaming: bool = False
    """Read a `datasets` source as a stream (large corpora: nothing is converted to Arrow first)."""
    backend: str = "transformers"
    """Who regenerates: transformers (draftsmith's batched engine; keeps the features) or vllm (optional extra)."""
    max_conversations: int | None = 2000
    """Conversations taken from the source (after shuffling with the seed), rounded up to whole batches; null = all."""
    mode: str = "regenerate"
    """regenerate (the target rewrites replies), prefill (the target reads the source's replies, all
    turns, and labels them with its own distribution) or mix (regenerate_share of the batches regenerated)."""
    regenerate_share: float = 0.25
    """mode=mix: the fraction of batches the target regenerates; the rest are prefilled."""
    regenerate: bool | None = None
    """Deprecated: true is mode=regenerate, false is mode=prefill."""
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
    """Stop generating after this many minutes (every finished conversation is kept; a rerun continues);
    null = no cap."""
    max_seq_len: int = 1024
    """Training sequences are cut to this many tokens."""

    def __post_init__(self):
        if self.regenerate is not None:                     # the old switch, kept readable
            self.mode, self.regenerate = ("regenerate" if self.regenerate else "prefill"), None
        if self.mode not in ("regenerate", "prefill", "mix"):
            raise ValueError(f"data.mode must be regenerate, prefill or mix, got '{self.mode}'")
        if not 0 <= self.regenerate_share <= 1:
            raise ValueError(f"data.regenerate_share must be in [0, 1], got {self.regenerate_share}")
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
        if self.max_conversations is not None and self.max_conversations < 1:
            raise ValueError(f"data.max_conversations must be >= 1, or null for the whole source; "
                             f"got {self.max_conversations}")
        if self.messages_field and self.prompt_field:
            raise ValueError(f"data.messages_field ('{self.messages_field}') and data.prompt_field "
                             f"('{self.prompt_field}') name two ways to read a chat: set one")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"data.max_minutes must be > 0, or null for no cap; got {self.max_minutes}")


@dataclass
class DataReport:
    conversations: int
    generated_tokens: int
    prefilled_tokens: int
    seconds: float
    skipped_long_prompts: int
    truncated_prompts: int
    source_summary: str
    training_tokens: int
    assistant_tokens: int

    @property
    def tokens_per_second(self) -> float:
        """Tokens the target produced or read per second of data making (generated + prefilled)."""
        return (self.generated_tokens + self.prefilled_tokens) / self.seconds if self.seconds else 0.0


COLUMN_DEFAULTS = {"split": "train", "messages_field": None, "prompt_field": None, "streaming": False}


def columns(settings: DataSettings) -> sources.Columns:
    return sources.Columns(split=settings.split, messages_field=settings.messages_field,
                           prompt_field=settings.prompt_field, streaming=settings.streaming)


def fingerprint(settings: DataSettings, seed: int, target_identity: dict, chat: dict | None = None) -> str:
    """What the shards depend on: a resumed run, and training on them, must agree on all of it."""
    keys = asdict(settings)
    free = ["max_minutes", "max_conversations", "regenerate", "streaming"]     # these may change between resumes
    if settings.mode == "regenerate":
        free.append("max_seq_len")       # cut when indexed, not in the shards (prefilled shards are cut)
    if settings.mode != "mix":
        free.append("regenerate_share")
    if settings.mode == "prefill":       # nothing is generated
        free += ["backend", "max_turns", "max_prompt_tokens", "long_prompts", "max_new_tokens", "temperature",
                 "top_p"]
    for key in free:
        keys.pop(key)
    for key, default in COLUMN_DEFAULTS.items():     # absent from data made before they existed: same fingerprint
        if keys.get(key) == default:
            keys.pop(key)
    keys["seed"] = seed
    keys["target"] = target_identity["weights_sha256"]
    if target_identity.get("adapter_sha256"):      # a LoRA adapter on the target (absent: the fingerprints of old data)
        keys["target_adapter"] = target_identity["adapter_sha256"]
    if chat:                                        # a chat template, its arguments, stop tokens of the recipe's own
        keys["target_chat"] = chat
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def read_shard(path: Path) -> list[dict]:
    """The records of one finished shard; a damaged file is an error that names it and the fix."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    records.append(json.loads(line))
                    if not {"input_ids", "loss_mask"} <= set(records[-1]):
                        raise ValueError("a record without input_ids or loss_mask")
    except (ValueError, UnicodeDecodeError) as err:
        raise sources.DataError(f"damaged data shard {path} (line {number}: {err}): delete it and run the same "
                                "command again; that shard is made again and the others are kept") from None
    return records


def batch_regenerates(settings: DataSettings, index: int) -> bool:
    """Whether batch `index` is regenerated (else prefilled): mix spreads its share evenly over the batches."""
    if settings.mode != "mix":
        return settings.mode == "regenerate"
    return int((index + 1) * settings.regenerate_share) > int(index * settings.regenerate_share)


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted((Path(data_dir) / "shards").glob("shard-*.jsonl"))


def shard_parts(out_dir: Path, index: int) -> list[Path]:
    """Parts of shard `index` written at a time cap (`shard-00003.part0.jsonl`, ...): each holds finished
    conversations of the shard; the shard itself, written later, holds the rest."""
    return sorted((Path(out_dir) / "shards").glob(f"shard-{index:05d}.part*.jsonl"))


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


def write_shard(target: Target, out_dir: Path, index: int, records: list[dict], capture_layers,
                features_dir: Path, name: str | None = None, max_tokens: int | None = None) -> None:
    """Features first, then the shard (its existence marks the shard done), each atomically.
    `name`: a part of the shard (kept at a time cap; see `shard_parts`) instead of the shard itself.
    `max_tokens`: features are kept for the tokens training reads (data.max_seq_len), the shard whole."""
    name = name or f"shard-{index:05d}"
    if capture_layers and any(r.get("features") is None for r in records):
        # prefill (and vLLM) shards: one forward of the target over every token training reads
        computed = feature_cache.compute_features(target, records, capture_layers, max_tokens=max_tokens)
        for record, feats in zip(records, computed):
            record["features"] = feats
    if capture_layers:
        feature_cache.write_shard(features_dir / f"{name}.safetensors",
                                  [r.pop("features") for r in records], capture_layers,
                                  target.identity.weights_sha256, max_tokens)
    for r in records:
        r.pop("features", None)
    write_atomic(out_dir / "shards" / f"{name}.jsonl",
                 "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def make_data(target: Target, settings: DataSettings, out_dir: Path, seed: int, progress: bool = True,
              capture_layers=()) -> DataReport:
    """Build (or resume) the shards in out_dir, their feature cache (capture_layers) and `tokenized/`."""
    from tqdm import tqdm

    out_dir = Path(out_dir)
    (out_dir / "shards").mkdir(parents=True, exist_ok=True)
    _check_manifest(out_dir, settings, seed, target)
    for stale in [*(out_dir / "shards").glob("*.tmp-*"), *(out_dir / "features").glob("*/*.tmp-*")]:
        stale.unlink()              # a write cut by a kill: its shard is made again below
    stats = sources.SourceStats()
    convs = list(sources.conversations(settings.source, stats=stats, columns=columns(settings)))
    log.info("source %s: %s", settings.source, stats.summary())
    batches = plan_batches(convs, settings.batch_size, seed)
    if settings.max_conversations is not None:
        # whole batches only, so a resume with another max_conversations reuses every shard as it is
        batches = batches[: -(-settings.max_conversations // settings.batch_size)]
    capture_layers = sorted(set(capture_layers))
    features_dir = feature_cache.cache_dir(out_dir, capture_layers)
    _check_space(target, settings, out_dir, batches, capture_layers, features_dir)
    counts = {"generated_tokens": 0, "prefilled_tokens": 0, "skipped_long_prompts": 0, "truncated_prompts": 0}
    start = time.time()
    bar = tqdm(total=sum(len(b) for b in batches), desc=f"data ({settings.mode})",
               unit="conv", disable=not progress, dynamic_ncols=True)
    new_tokens = [0]

    def on_tokens(n):
        new_tokens[0] += n
        bar.set_postfix_str(f"{new_tokens[0] / max(time.time() - start, 1e-6):.0f} tok/s", refresh=False)

    def write(index: int, records: list[dict]) -> None:
        write_shard(target, out_dir, index, records, capture_layers, features_dir, max_tokens=settings.max_seq_len)
        bar.update(len(batches[index]))

    def write_part(index: int, records: list[dict]) -> None:
        name = f"shard-{index:05d}.part{len(shard_parts(out_dir, index))}"
        write_shard(target, out_dir, index, records, capture_layers, features_dir, name, settings.max_seq_len)

    # draftsmith's engine keeps one batch full across shards; vLLM batches on its own (no features)
    deadline = start + settings.max_minutes * 60 if settings.max_minutes is not None else None
    engine = (Regenerator(target, settings, seed, counts, on_tokens, capture_layers, write, deadline, write_part)
              if settings.backend == "transformers" and settings.mode != "prefill" else None)
    for index, batch in enumerate(batches):
        shard = out_dir / "shards" / f"shard-{index:05d}.jsonl"
        if shard.exists():
            bar.update(len(batch))
            continue
        if settings.max_minutes is not None and time.time() - start > settings.max_minutes * 60:
            break
        if not batch_regenerates(settings, index):
            records = [r for c in batch for r in _as_is(target, c, settings)]
            write(index, records)                         # the forward runs here, then the tokens count
            counts["prefilled_tokens"] += sum(len(r["input_ids"]) for r in records)
            on_tokens(sum(len(r["input_ids"]) for r in records))
        elif engine is not None:
            engine.admit(index, batch, {r["id"] for part in shard_parts(out_dir, index) for r in read_shard(part)})
            if engine.out_of_time:
                break
        else:
            write(index, regenerate_batch(target, ShardWork(target, index, batch, settings, seed, counts), on_tokens))
    if engine is not None:
        engine.finish()
        if engine.inflight:
            log.info("data.max_minutes: %d shards were in flight at the cap; their %d finished conversations are "
                     "kept as parts, and a rerun makes the rest", len(engine.inflight), engine.kept_parts)
    if deadline is not None and time.time() > deadline:
        log.warning("data.max_minutes=%s reached: every finished conversation is kept; rerun to continue",
                    settings.max_minutes)
    bar.close()
    seconds = time.time() - start
    return finish(out_dir, settings, stats, counts, seconds)


@dataclass
class LengthEstimate:
    """Tokens per conversation a data run writes: whole (the JSONL shards) and cut to data.max_seq_len
    (the feature cache), with where the figure comes from."""
    tokens: float
    cached_tokens: float
    source: str


PROBE_CONVERSATIONS = 32
PROBE_MARGIN = {"prefill": 1.1, "regenerate": 1.5, "mix": 1.5}   # the target's replies may outrun the source's


def estimate_lengths(target: Target, settings: DataSettings, out_dir: Path, batches) -> LengthEstimate:
    """Measured, never the per-conversation maximum: the shards made so far (up to 16 of them), else a
    probe of the source's own conversations as they will be cut, the source's replies standing in for
    the target's (times a margin, capped at what a reply may be)."""
    made = shard_paths(out_dir)[:16]
    if made:
        records = [r for shard in made for r in read_shard(shard)]
        conversations = max(1, len({r["id"].split("#turn")[0] for r in records}))
        whole = sum(len(r["input_ids"]) for r in records)
        cached = sum(min(len(r["input_ids"]), settings.max_seq_len) for r in records)
        return LengthEstimate(whole / conversations, cached / conversations,
                              f"measured on the {len(made)} shard(s) made so far ({conversations} conversations)")
    pool = [c for b in batches for c in b]
    sample = random.Random(0).sample(pool, min(PROBE_CONVERSATIONS, len(pool)))
    bound = settings.max_prompt_tokens + settings.max_turns * settings.max_new_tokens
    whole = cached = 0.0
    for conv in sample:
        messages, turns = [], 0
        for m in conv.messages:
            if m["role"] == "assistant" and settings.mode != "prefill" and turns == settings.max_turns:
                break
            messages.append(m)
            turns += m["role"] == "assistant"
        try:
            n = len(tokenize_chat(target.tokenizer, messages).input_ids)
        except Exception:  # noqa: BLE001 - a chat the template refuses is skipped by the run too
            continue
        if settings.mode != "prefill":
            n = min(n + (settings.max_new_tokens if turns == 0 else 0), bound)    # a prompt without a reply
        whole += n
        cached += min(n, settings.max_seq_len)
    margin = PROBE_MARGIN[settings.mode]
    count = max(1, len(sample))
    upper = settings.max_seq_len if settings.mode == "prefill" else bound
    return LengthEstimate(min(whole / count * margin, upper), min(cached / count * margin, settings.max_seq_len),
                          f"a probe of {len(sample)} source conversations (their own replies standing in for the "
                          f"target's) x{margin}")


def _check_space(target: Target, settings: DataSettings, out_dir: Path, batches, capture_layers, features_dir):
    """Refuse to start when the disk cannot hold what the unfinished shards will need, from measured
    lengths (`estimate_lengths`): the shards made so far, else a probe of the source.

    Under data.max_minutes only the shards in flight together at the start must fit: the cap stops the
    run long before the source is used up, and a full disk later keeps the finished shards."""
    todo = [len(b) for i, b in enumerate(batches) if not (out_dir / "shards" / f"shard-{i:05d}.jsonl").exists()]
    if not todo:
        return
    lengths = estimate_lengths(target, settings, out_dir, batches)

    def cache(conversations: int) -> int:
        tokens = int(conversations * lengths.cached_tokens)
        return feature_cache.estimate_bytes(tokens, capture_layers, target.hidden_size) if capture_layers else 0

    def bound(conversations: int) -> int:
        return int(conversations * lengths.tokens * JSONL_BYTES_PER_TOKEN) + cache(conversations)

    everything, free = bound(sum(todo)), free_bytes(out_dir)
    log.info("data for %d conversations: about %s (%.0f tokens per conversation, %.0f of them cached: %s)",
             sum(todo), human_size(everything), lengths.tokens, lengths.cached_tokens, lengths.source)
    if capture_layers:
        log.info("feature cache %s: about %s (layers %s, bf16)", features_dir, human_size(cache(sum(todo))),
                 capture_layers)
    what = f"{{}} ({lengths.tokens:.0f} tokens per conversation, {lengths.source})"
    if settings.max_minutes is None or everything <= free:
        require_free_space(out_dir, everything, what.format(f"the data for {sum(todo)} conversations"))
        return
    first = sum(todo[:IN_FLIGHT_SHARDS])
    require_free_space(out_dir, bound(first), what.format(f"the first {first} conversations of data"))
    log.warning("all %d conversations would need about %s at '%s' (%s free); data.max_minutes=%s stops this run "
                "earlier, and if the disk fills first the finished shards are kept", sum(todo),
                human_size(everything), out_dir, human_size(free), settings.max_minutes)


IN_FLIGHT_SHARDS = 4           # the regeneration engine refills one batch from the next shards
JSONL_BYTES_PER_TOKEN = 40     # a token id, its loss mask and the chat text in a shard line, generously


def _as_is(target: Target, conv: sources.Conversation, settings: DataSettings) -> list[dict]:
    """A conversation as the source wrote it, every assistant turn marked, cut to max_seq_len: one
    record, or more where the template rewrites earlier turns (data/chat.py: tokenize_turns)."""
    rows = tokenize_turns(target.tokenizer, conv.messages, max_length=settings.max_seq_len)
    return [{"id": conv.id if n == 0 else f"{conv.id}#turn{n}", "messages": conv.messages,
             "input_ids": chat.input_ids, "loss_mask": chat.loss_mask}
            for n, chat in enumerate(rows) if sum(chat.loss_mask)]


def check_same_data(out_dir: Path, settings: DataSettings, seed: int, target: Target) -> None:
    """Refuse data on disk made with other settings (source, mode, lengths, seed, target), naming what differs."""
    manifest_path = Path(out_dir) / "manifest.json"
    if not manifest_path.exists():
        return
    manifest = json.loads(manifest_path.read_text())
    key = fingerprint(settings, seed, target.identity.to_dict(), target.chat)
    if manifest.get("fingerprint") == key:
        return
    saved = DataSettings(**{k: v for k, v in (manifest.get("settings") or {}).items()
                            if k in DataSettings.__dataclass_fields__})
    diffs = [f"{name}: on disk {getattr(saved, name)!r}, recipe {getattr(settings, name)!r}"
             for name in DataSettings.__dataclass_fields__ if getattr(saved, name) != getattr(settings, name)
             and name not in ("max_minutes", "max_conversations")]
    if manifest.get("seed") != seed:
        diffs.append(f"seed: on disk {manifest.get('seed')}, recipe {seed}")
    if manifest.get("target_chat") != target.chat:
        diffs.append(f"the target's prompt format (target.chat_template, chat_template_kwargs, stop_tokens): on disk "
                     f"{manifest.get('target_chat')}, recipe {target.chat}")
    raise ValueError(
        f"{out_dir} holds data made with other settings ({'; '.join(diffs) or 'fingerprint ' + str(manifest.get('fingerprint'))})."
        f" Use another output_dir, or delete {out_dir} to make it again with the recipe's settings")


def _check_manifest(out_dir: Path, settings: DataSettings, seed: int, target: Target) -> None:
    check_same_data(out_dir, settings, seed, target)
    key = fingerprint(settings, seed, target.identity.to_dict(), target.chat)
    manifest_path = out_dir / "manifest.json"
    write_atomic(manifest_path, json.dumps({"fingerprint": key, "settings": asdict(settings), "seed": seed,
                                            "target": target.identity.to_dict(), "target_chat": target.chat},
                                           indent=1))


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
    swap_directory(tmp, out_dir / "tokenized")
    return DataReport(
        conversations=len(rows["id"]), generated_tokens=counts["generated_tokens"],
        prefilled_tokens=counts["prefilled_tokens"], seconds=seconds,
        skipped_long_prompts=counts["skipped_long_prompts"], truncated_prompts=counts["truncated_prompts"],
        source_summary=stats.summary(), training_tokens=sum(len(x) for x in rows["input_ids"]),
        assistant_tokens=sum(sum(m) for m in rows["loss_mask"]))


