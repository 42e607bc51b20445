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

import datasets

from draftsmith.heads.infra.files import swap_directory, write_atomic
from draftsmith.heads.infra.kept import read_kept_json
from draftsmith.heads.runtime.target import Target

from . import features as feature_cache
from . import sources, vllm_backend
from .chat import check_thinking_switch, tokenize_turns
from .health import Health, HealthWatch, judge, reasoning_of
from .progress import Launch, Progress, launch_from_environment
from .regenerate import Regenerator, ShardWork, regenerate_with_vllm
from .settings import COLUMN_DEFAULTS, DataSettings, columns
from .shards import read_shard, shard_parts, shard_paths
from .space import JSONL_BYTES_PER_TOKEN, auto_rows, check_space

log = logging.getLogger(__name__)


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
    health: dict | None = None          # data/health.py figures over every reply (health.json: per shard too)

    @property
    def tokens_per_second(self) -> float:
        """Tokens the target produced or read per second of data making (generated + prefilled)."""
        return (self.generated_tokens + self.prefilled_tokens) / self.seconds if self.seconds else 0.0


def fingerprint(settings: DataSettings, seed: int, target_identity: dict, chat: dict | None = None) -> str:
    """What the shards depend on: a resumed run, and training on them, must agree on all of it."""
    keys = asdict(settings)
    free = ["max_minutes", "max_conversations", "regenerate", "streaming",      # these may change between resumes
            "memory_gb", "shard_mb", "vllm", "health", "allow_degenerate"]      # nor do these change a shard
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


def batch_regenerates(settings: DataSettings, index: int) -> bool:
    """Whether batch `index` is regenerated (else prefilled): mix spreads its share evenly over the batches."""
    if settings.mode != "mix":
        return settings.mode == "regenerate"
    return int((index + 1) * settings.regenerate_share) > int(index * settings.regenerate_share)


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


AUTO_SHARD_CONVERSATIONS = 64     # a shard's conversations when data.batch_size is auto


def shard_conversations(settings: DataSettings) -> int:
    return settings.batch_size if isinstance(settings.batch_size, int) else AUTO_SHARD_CONVERSATIONS


def write_shard(target: Target, out_dir: Path, index: int, records: list[dict], capture_layers,
                features_dir: Path, name: str | None = None, max_tokens: int | None = None,
                shard_mb: float | None = None, pending_feature_values: int = 0) -> None:
    """Features first, then the shard (its existence marks the shard done), each atomically.
    `name`: a part of the shard (kept at a time cap; see `shard_parts`) instead of the shard itself.
    `max_tokens`: features are kept for the tokens training reads (data.max_seq_len), the shard whole.
    `shard_mb`: records past that many megabytes on disk go to parts of the shard, written first, counting
    `pending_feature_values` per token for features a later pass computes (vLLM's feature pass)."""
    if capture_layers and target.layers_loaded and any(r.get("features") is None for r in records):
        # prefill shards: one forward of the target over every token training reads
        computed = feature_cache.compute_features(target, records, capture_layers, max_tokens=max_tokens)
        for record, feats in zip(records, computed):
            record["features"] = feats[:max_tokens] if max_tokens else feats
    pieces = [records] if name or shard_mb is None else _split_by_bytes(records, shard_mb * 1e6, max_tokens,
                                                                         pending_feature_values)
    for number, piece in enumerate(pieces):
        last = number == len(pieces) - 1
        piece_name = name or (f"shard-{index:05d}" if last else
                              f"shard-{index:05d}.part{len(shard_parts(out_dir, index))}")
        if capture_layers and all(r.get("features") is not None for r in piece):
            feature_cache.write_shard(features_dir / f"{piece_name}.safetensors",
                                      [r.pop("features") for r in piece], capture_layers,
                                      target.identity.weights_sha256, max_tokens)
        for r in piece:
            r.pop("features", None)
        write_atomic(out_dir / "shards" / f"{piece_name}.jsonl",
                     "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in piece))


def _split_by_bytes(records: list[dict], limit: float, max_tokens: int | None,
                    pending_feature_values: int = 0) -> list[list[dict]]:
    """Consecutive groups of records, each under `limit` bytes on disk (a record larger alone is one group)."""
    groups, size = [[]], 0
    for r in records:
        feats = r.get("features")
        kept = min(len(r["input_ids"]), max_tokens or len(r["input_ids"]))
        values = pending_feature_values if feats is None else feats[0].numel()
        bytes_ = len(r["input_ids"]) * JSONL_BYTES_PER_TOKEN + kept * values * feature_cache.BYTES_PER_VALUE
        if groups[-1] and size + bytes_ > limit:
            groups.append([])
            size = 0
        groups[-1].append(r)
        size += bytes_
    return groups


def make_data(target: Target, settings: DataSettings, out_dir: Path, seed: int, progress: bool = True,
              capture_layers=(), launch: Launch | None = None, full_target=None) -> DataReport | None:
    """Build (or resume) the shards in out_dir, their feature cache (capture_layers) and `tokenized/`.

    launch: this process's rank among the launch's (it makes shards r, r + world, ...; the main rank
    indexes them all once every rank is done; the others return None).  full_target: loads the whole
    target, when `target` holds only its embedding and head (data.backend=vllm: the feature pass)."""
    launch = launch or Launch()
    context = target.context_length
    if context and settings.max_seq_len > context:
        raise ValueError(f"data.max_seq_len={settings.max_seq_len} is larger than the context of target "
                         f"'{target.name}', {context} positions (max_position_embeddings in its config): "
                         f"set data.max_seq_len={context} or less")
    if settings.thinking != "template":
        check_thinking_switch(target.tokenizer, settings.thinking, settings.thinking_switch)
    out_dir = Path(out_dir)
    (out_dir / "shards").mkdir(parents=True, exist_ok=True)
    if launch.main:
        _check_manifest(out_dir, settings, seed, target)
        for stale in [*(out_dir / "shards").glob("*.tmp-*"), *(out_dir / "features").glob("*/*.tmp-*")]:
            stale.unlink()              # a write cut by a kill: its shard is made again below
    else:
        check_same_data(out_dir, settings, seed, target)
    launch.barrier()                    # nothing is written before the stale files are gone
    stats = sources.SourceStats()
    convs = list(sources.conversations(settings.source, stats=stats, columns=columns(settings)))
    log.info("source %s: %s", settings.source, stats.summary())
    per_shard = shard_conversations(settings)
    batches = plan_batches(convs, per_shard, seed)
    if settings.max_conversations is not None:
        # whole batches only, so a resume with another max_conversations reuses every shard as it is
        batches = batches[: -(-settings.max_conversations // per_shard)]
    capture_layers = sorted(set(capture_layers))
    features_dir = feature_cache.cache_dir(out_dir, capture_layers)
    check_space(target, settings, out_dir, batches, capture_layers, features_dir)
    done = [i for i in range(len(batches)) if (out_dir / "shards" / f"shard-{i:05d}.jsonl").exists()]
    todo = [i for i in range(len(batches)) if launch.owns(i) and i not in set(done)]
    counts = {"generated_tokens": 0, "prefilled_tokens": 0, "skipped_long_prompts": 0, "truncated_prompts": 0}
    start = time.time()
    deadline = start + settings.max_minutes * 60 if settings.max_minutes is not None else None
    bar = Progress(out_dir, sum(len(b) for b in batches), sum(len(batches[i]) for i in done), launch, deadline,
                   progress, f"data ({settings.mode}, {settings.backend})")
    watch = HealthWatch(settings, target)
    run = _Run(target, settings, out_dir, seed, batches, capture_layers, features_dir, counts, bar, watch,
               deadline)
    if settings.backend == "vllm" and settings.mode != "prefill":
        run.with_vllm([i for i in todo if batch_regenerates(settings, i)], launch)
        if not target.layers_loaded and (capture_layers or any(not batch_regenerates(settings, i) for i in todo)):
            run.target = target = full_target()          # the engine is gone: the target's turn
        run.prefill([i for i in todo if not batch_regenerates(settings, i)])
        if capture_layers:
            mine = [p for p in shard_paths(out_dir) if launch.owns(int(p.name[6:11]))]
            began = time.time()
            built = feature_cache.build_missing(target, mine, capture_layers, features_dir,
                                                progress=progress and launch.main, max_tokens=settings.max_seq_len,
                                                verify="never")
            tokens = sum(min(len(r["input_ids"]), settings.max_seq_len) for p in mine for r in read_shard(p))
            log.info("feature pass: %d shards, %d tokens in %.1f s (%.0f tokens/s)", built, tokens,
                     time.time() - began, tokens / max(time.time() - began, 1e-6))
    else:
        run.with_transformers(todo)
    capped = deadline is not None and time.time() > deadline
    bar.close(counts)
    bar.wait_for_ranks()               # as long as the slowest rank works (its heartbeat fresh), naming it
    launch.barrier()                   # every rank's shards are written
    if capped:
        _report_cap(out_dir, settings)
    if not launch.main:
        return None
    return finish(out_dir, settings, stats, bar.totals() if launch.world > 1 else counts, time.time() - start,
                  target)


def _report_cap(out_dir: Path, settings: DataSettings) -> None:
    """After data.max_minutes: a warning that the finished conversations are kept, or an error when none had
    finished (checked after the launch's barrier, on the shared output_dir, so every rank agrees)."""
    if not any((out_dir / "shards").glob("shard-*.jsonl")):
        raise sources.DataError(
            f"data.max_minutes={settings.max_minutes} passed before any conversation finished: nothing was written "
            f"(a batch of {settings.batch_size} rows, up to {settings.max_new_tokens} new tokens each, takes longer "
            "here); raise data.max_minutes, or lower data.batch_size or data.max_new_tokens")
    log.warning("data.max_minutes=%s reached: every finished conversation is kept; rerun to continue",
                settings.max_minutes)


class _Run:
    """The shards one process makes: through draftsmith's engine, vLLM, or one prefill forward each."""

    def __init__(self, target, settings, out_dir, seed, batches, capture_layers, features_dir, counts, bar,
                 watch, deadline):
        self.target, self.settings, self.out_dir, self.seed, self.batches = target, settings, out_dir, seed, batches
        self.capture_layers, self.features_dir, self.counts, self.bar = capture_layers, features_dir, counts, bar
        self.watch, self.deadline = watch, deadline

    def on_tokens(self, n: int) -> None:
        self.bar.update(tokens=n)

    def write(self, index: int, records: list[dict], capture=True) -> None:
        """capture=False: the features come later, from the feature pass (vLLM), one file per shard or part."""
        self.watch.add(records)
        pending = 0 if capture else len(set(self.capture_layers)) * self.target.hidden_size
        write_shard(self.target, self.out_dir, index, records, self.capture_layers if capture else (),
                    self.features_dir, max_tokens=self.settings.max_seq_len, shard_mb=self.settings.shard_mb,
                    pending_feature_values=pending)
        self.bar.update(conversations=len(self.batches[index]))
        self.watch.check()

    def write_part(self, index: int, records: list[dict]) -> None:
        self.watch.add(records)
        name = f"shard-{index:05d}.part{len(shard_parts(self.out_dir, index))}"
        write_shard(self.target, self.out_dir, index, records, self.capture_layers, self.features_dir, name,
                    self.settings.max_seq_len)

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def kept(self, index: int) -> set[str]:
        """Conversations of shard `index` already written as parts of it (a cap, or data.shard_mb)."""
        return {r["id"].split("#turn")[0] for part in shard_parts(self.out_dir, index) for r in read_shard(part)}

    def prefill(self, indices) -> None:
        for index in indices:
            if self.out_of_time():
                return
            kept = self.kept(index)
            records = [r for c in self.batches[index] if c.id not in kept
                       for r in _as_is(self.target, c, self.settings, self.seed)]
            tokens = sum(len(r["input_ids"]) for r in records)
            self.write(index, records)                    # the forward runs here, then the tokens count
            self.counts["prefilled_tokens"] += tokens
            self.on_tokens(tokens)

    def with_transformers(self, todo) -> None:
        """draftsmith's engine keeps one batch full across shards (data/stream.py)."""
        engine = None
        if self.settings.mode != "prefill":
            rows = (self.settings.batch_size if isinstance(self.settings.batch_size, int)
                    else auto_rows(self.target, self.settings, self.capture_layers))
            engine = Regenerator(self.target, self.settings, self.seed, self.counts, self.on_tokens,
                                 self.capture_layers, self.write, self.deadline, self.write_part, rows=rows)
        for index in todo:
            if self.out_of_time():
                break
            if not batch_regenerates(self.settings, index):
                self.prefill([index])
                continue
            engine.admit(index, self.batches[index], self.kept(index))
            if engine.out_of_time:
                break
        if engine is not None:
            engine.finish()
            if engine.inflight:
                log.info("data.max_minutes: %d shards were in flight at the cap; their %d finished conversations "
                         "are kept as parts, and a rerun makes the rest", len(engine.inflight), engine.kept_parts)

    def with_vllm(self, todo, launch: Launch) -> None:
        """vLLM: chunks of data.vllm.chunk_shards shards, each turn of a chunk one engine call; the shards
        are written without features (the feature pass follows, once the engine is shut down).  A time cap
        is checked between chunks."""
        if not todo:
            return
        chunk = vllm_backend.engine_settings(self.settings.vllm)["chunk_shards"]
        engine = vllm_backend.Engine(self.target, self.settings, launch.world, launch_from_environment()[2])
        try:
            for start in range(0, len(todo), chunk):
                if self.out_of_time():
                    break
                works = [ShardWork(self.target, i, self.batches[i], self.settings, self.seed, self.counts,
                                   exclude=self.kept(i)) for i in todo[start:start + chunk]]
                regenerate_with_vllm(engine, works, self.on_tokens)
                for work in works:
                    self.write(work.index, work.result(), capture=False)
        finally:
            engine.close()


def _as_is(target: Target, conv: sources.Conversation, settings: DataSettings, seed: int) -> list[dict]:
    """A conversation as the source wrote it, every assistant turn marked, cut to max_seq_len: one
    record, or more where the template rewrites earlier turns (data/chat.py: tokenize_turns)."""
    kwargs = settings.template_kwargs(conv.id, seed)
    rows = tokenize_turns(target.tokenizer, conv.messages, max_length=settings.max_seq_len, kwargs=kwargs)
    thinking = {} if kwargs is None else {"thinking": kwargs[settings.thinking_switch]}
    return [{"id": conv.id if n == 0 else f"{conv.id}#turn{n}", "messages": conv.messages,
             "input_ids": chat.input_ids, "loss_mask": chat.loss_mask, **thinking}
            for n, chat in enumerate(rows) if sum(chat.loss_mask)]


def rendered_template(target: Target) -> str:
    """The chat template every row was rendered with, as the tokenizer holds it: the target's own (its
    chat_template.jinja, or tokenizer_config.json), or the recipe's target.chat_template.  Part of what the data
    depends on: an edited template changes every prompt's tokens."""
    template = getattr(target.tokenizer, "chat_template", None)
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def read_manifest(out_dir: Path) -> dict:
    """The data's manifest.json (what made it: settings, seed, target, prompt format), its shape checked."""
    return read_kept_json(out_dir / "manifest.json", "the data's manifest: the settings and target that made it",
                          f"Delete it and run `draftsmith data` again with the recipe that made {out_dir}: the manifest "
                          "is written again and the shards already made are kept",
                          {"fingerprint": str, "target": dict})


def check_same_data(out_dir: Path, settings: DataSettings, seed: int, target: Target) -> None:
    """Refuse data on disk made with other settings (source, mode, lengths, seed, target), naming what differs."""
    manifest_path = Path(out_dir) / "manifest.json"
    if not manifest_path.exists():
        return
    manifest = read_manifest(Path(out_dir))
    key = fingerprint(settings, seed, target.identity.to_dict(), target.chat)
    saved_template, template = manifest.get("template_sha256"), rendered_template(target)
    same_template = saved_template in (None, template)          # None: data made before it was recorded
    if manifest.get("fingerprint") == key and same_template:
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
    if not same_template:
        diffs.append(f"the chat template the target renders (its own chat_template.jinja or tokenizer_config.json, "
                     f"or target.chat_template): sha256 {saved_template} on disk, {template} now")
    raise ValueError(
        f"{out_dir} holds data made with other settings ({'; '.join(diffs) or 'fingerprint ' + str(manifest.get('fingerprint'))})."
        f" Use another output_dir, or delete {out_dir} to make it again with the recipe's settings")


def _check_manifest(out_dir: Path, settings: DataSettings, seed: int, target: Target) -> None:
    check_same_data(out_dir, settings, seed, target)
    key = fingerprint(settings, seed, target.identity.to_dict(), target.chat)
    manifest_path = out_dir / "manifest.json"
    write_atomic(manifest_path, json.dumps({"fingerprint": key, "settings": asdict(settings), "seed": seed,
                                            "target": target.identity.to_dict(), "target_chat": target.chat,
                                            "template_sha256": rendered_template(target)},
                                           indent=1))


def finish(out_dir: Path, settings: DataSettings, stats, counts: dict, seconds: float, target: Target) -> DataReport:
    """Index every shard's records into `tokenized/` (cut to max_seq_len); measure their health, per shard
    and in total, into `health.json` (data/health.py), and stop past its limits."""
    rows = {"id": [], "input_ids": [], "loss_mask": [], "shard": [], "row": []}
    reasoning = reasoning_of(target.tokenizer)
    total, per_shard = Health(reasoning), {}
    for shard in shard_paths(out_dir):
        health = Health(reasoning)
        for row, record in enumerate(read_shard(shard)):
            health.add_record(record, target.eos_token_ids)
            mask = record["loss_mask"][: settings.max_seq_len]
            if sum(mask) == 0:
                continue
            rows["id"].append(record["id"])
            rows["input_ids"].append(record["input_ids"][: settings.max_seq_len])
            rows["loss_mask"].append(mask)
            rows["shard"].append(shard.stem)
            rows["row"].append(row)
        total.merge(health)
        per_shard[shard.stem] = health.figures()
    if not rows["id"]:
        raise ValueError(f"no conversations were produced from source '{settings.source}' ({stats.summary()}; "
                         f"{counts['skipped_long_prompts']} prompts longer than data.max_prompt_tokens="
                         f"{settings.max_prompt_tokens} skipped)")
    table = datasets.Dataset.from_dict(rows)
    figures = judge(out_dir, settings, total, per_shard, target.tokenizer)
    tmp = out_dir / "tokenized.tmp"
    table.save_to_disk(str(tmp))
    swap_directory(tmp, out_dir / "tokenized")
    return DataReport(
        conversations=len(rows["id"]), generated_tokens=counts["generated_tokens"],
        prefilled_tokens=counts["prefilled_tokens"], seconds=seconds,
        skipped_long_prompts=counts["skipped_long_prompts"], truncated_prompts=counts["truncated_prompts"],
        source_summary=stats.summary(), training_tokens=sum(len(x) for x in rows["input_ids"]),
        assistant_tokens=sum(sum(m) for m in rows["loss_mask"]), health=figures)


