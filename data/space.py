"""How much disk a data run needs, from measured lengths: the shards made so far, else a probe of the
source's own conversations (never the per-conversation maximum, which asks for terabytes at 8B)."""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.heads.infra.files import free_bytes, human_size, require_free_space
from draftsmith.heads.runtime.target import Target

from . import features as feature_cache
from .chat import tokenize_chat
from .generate import PREFILL_CHUNK
from .settings import DataSettings
from .shards import read_shard, shard_paths

log = logging.getLogger(__name__)


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


def check_space(target: Target, settings: DataSettings, out_dir: Path, batches, capture_layers, features_dir):
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


def auto_rows(target: Target, settings: "DataSettings", capture_layers, free: int | None = None) -> int:
    """data.batch_size=auto: the rows of draftsmith's engine that fit data.memory_gb (else 80% of the memory
    free now), each row counted at its largest (max_prompt_tokens + max_new_tokens): its KV cache twice (a
    refill builds the repacked cache beside the old one), its features twice (held until the shard is
    written), its logits and one prefill chunk's attention scores.  The choice is logged."""
    config = getattr(target, "config", None)
    heads = int(getattr(config, "num_attention_heads", 1))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or target.hidden_size // heads)
    element = torch.empty((), dtype=target.dtype).element_size()
    tokens = settings.max_prompt_tokens + settings.max_new_tokens + 1
    kv = 2 * target.num_layers * kv_heads * head_dim * element * tokens
    features = len(set(capture_layers)) * target.hidden_size * 2 * tokens
    logits = target.vocab_size * 4
    scores = heads * PREFILL_CHUNK * tokens * 4
    per_row = 2 * kv + 2 * features + logits + scores
    if settings.memory_gb is not None:
        budget, where = settings.memory_gb * 2 ** 30, f"data.memory_gb={settings.memory_gb}"
    else:
        free = available_memory(target.device) if free is None else free
        budget, where = 0.8 * free, f"80% of the {human_size(free)} free on {target.device}"
    rows = int(max(1, min(MAX_AUTO_ROWS, budget // per_row)))
    log.info("data.batch_size=auto: %d rows (%s per row at %d tokens: KV cache %s x2, features %s x2; %s)", rows,
             human_size(per_row), tokens, human_size(kv), human_size(features), where)
    return rows


MAX_AUTO_ROWS = 512


def available_memory(device) -> int:
    """Bytes free now: on a GPU what the CUDA driver reports, on a CPU MemAvailable."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
