"""`--dry-run` for `data` and `train`: what a run would read, make and cost, from a short measured
probe on this machine, writing nothing.

The counts are exact (the source is read and cut as a run would cut it); token counts are estimated
from a seeded sample of 32 conversations (regeneration: the rendered prompts plus `max_new_tokens`
per reply, an upper bound); the minutes come from timing the target on that sample here (a batch
regenerated for 16 tokens, or prefilled) and two drafter training steps on it.
"""
from __future__ import annotations

import logging
import math
import os
import random
import re
import time
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights

from draftsmith.data import features as feature_cache
from draftsmith.data import sources
from draftsmith.data.chat import tokenize_chat
from draftsmith.data.distill import columns, shard_conversations
from draftsmith.data.generate import generate_batch
from draftsmith.data.space import estimate_lengths
from draftsmith.heads.infra.device import total_memory
from draftsmith.heads.infra.files import free_bytes, human_size
from draftsmith.heads.registry import drafter_class, registry
from draftsmith.heads.runtime.target import resolve_dtype
from draftsmith.train.batches import collate, feature_layers
from draftsmith.train.settings import RecipeError, loader_workers

log = logging.getLogger("draftsmith")

PROBE_CONVERSATIONS = 32
PROBE_TOKENS = 32
TOKEN_COLUMN_BYTES = 44      # a token's input id and loss mask as the Python lists training holds


@torch.no_grad()
def _data_rate(target, sample_ids: list[list[int]], settings) -> tuple[float, str]:
    """Tokens per second the data step makes here, measured on the sample."""
    batch = sample_ids[: min(shard_conversations(settings), len(sample_ids))]      # data.batch_size auto: a shard's
    start = time.time()
    if settings.mode == "prefill":
        longest = max(len(x) for x in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long, device=target.device)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        target.features(ids, mask, [target.num_layers])
        return sum(len(x) for x in batch) / max(time.time() - start, 1e-6), f"prefill of {len(batch)} conversations"
    generate_batch(target, batch[:2], 2)                        # warm-up: first calls pay for setup
    start = time.time()
    made = sum(len(g.token_ids) for g in generate_batch(target, batch, PROBE_TOKENS))
    # prefill included, over fewer tokens than a real run decodes: a conservative rate
    return made / max(time.time() - start, 1e-6), f"{len(batch)} prompts regenerated for {PROBE_TOKENS} tokens"


@dataclass
class TrainingProbe:
    tokens_per_second: float
    trainable_parameters: int
    saved_bytes_per_token: float     # what autograd keeps for backward, per training token of the probe


def _training_probe(recipe, target, rows: list[list[int]], masks: list[list[int]]) -> TrainingProbe:
    """Training tokens per second here: two drafter steps on the sample (features computed online),
    and the activation bytes autograd saves for backward in them (saved_tensors_hooks, each storage once)."""
    drafter = registry()[recipe.method](recipe.drafter, target)
    drafter.attach_backbone()
    drafter.train()
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6)
    batch = collate([{"input_ids": r, "loss_mask": m} for r, m in zip(rows, masks)][: recipe.train.batch_size])
    batch = {k: v.to(target.device) for k, v in batch.items()}
    layers = drafter.required_layers
    features = target.features(batch["input_ids"], batch["attention_mask"], layers) if layers else {}
    seconds, saved = [], {}

    def pack(tensor):
        if not tensor.requires_grad or tensor.grad_fn is not None:    # activations, not the weights themselves
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    bf16 = recipe.train.mixed_precision == "bf16" or (
        recipe.train.mixed_precision == "auto" and resolve_dtype("auto", target.device) == torch.bfloat16)
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=bf16)   # as training decides
    for _ in range(2):
        start = time.time()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            loss = drafter.loss({**batch, "features": features}).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.time() - start)
    tokens = int(batch["attention_mask"].sum())
    return TrainingProbe(tokens / max(seconds[-1], 1e-6), sum(p.numel() for p in trainable),
                         sum(saved.values()) / max(tokens, 1))


def memory_plan(recipe, target, probe: TrainingProbe, layers) -> dict:
    """Bytes per training process, for cache mode and for online mode: on the device (target, drafter
    weights, gradients and AdamW state in fp32, activations scaled from the probe to batch_size x
    max_seq_len) and on the host (the token columns, the loader's batches in flight)."""
    b, s = recipe.train.batch_size, recipe.data.max_seq_len
    head_bytes = 2 * target.vocab_size * target.hidden_size * 2                  # embedding + lm_head, bf16
    config = target.config
    whole_bytes = _parameter_bytes(target)
    drafter_state = probe.trainable_parameters * (4 + 4 + 8)                     # fp32 weights, grads, Adam m + v
    activations = int(probe.saved_bytes_per_token * b * s)
    batch_features = b * s * len(set(layers)) * target.hidden_size * 2
    intermediate = getattr(config, "intermediate_size", 4 * target.hidden_size)
    online_forward = b * s * (4 * target.hidden_size + 2 * intermediate) * 2 + batch_features
    workers = loader_workers(recipe.train, target.device)
    in_flight = max(1, 2 * workers) * batch_features * (2 if target.device.type == "cuda" else 1)   # + pinned copy
    light = not drafter_class(recipe.method).trains_target_adapter and recipe.train.eval_prompts == 0
    return {
        "cache": {"device": (head_bytes if light else whole_bytes) + drafter_state + activations,
                  "host": in_flight},
        "online": {"device": whole_bytes + drafter_state + activations + online_forward, "host": 0},
        "parts": {"target_whole": whole_bytes, "target_embedding_and_head": head_bytes, "drafter_state": drafter_state,
                  "activations": activations, "batch_features": batch_features, "loader_workers": workers},
    }


def _parameter_bytes(target) -> int:
    model = getattr(target, "model", None)
    if model is not None and target.layers_loaded:
        return sum(p.numel() * p.element_size() for p in model.parameters())
    config = target.config            # loaded without its layers: the layers' size from the config
    h, i = target.hidden_size, getattr(config, "intermediate_size", 4 * target.hidden_size)
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    d = getattr(config, "head_dim", None) or h // heads
    per_layer = h * d * (2 * heads + 2 * kv) + 3 * h * i
    return (target.num_layers * per_layer + 2 * target.vocab_size * h) * 2


def dry_run(recipe, target, verb: str) -> dict:
    """The plan of `draftsmith data|train RECIPE`, printed and returned; nothing is written."""
    settings = recipe.data
    if verb == "train":
        check_drafter_size(recipe, target)             # before the probe allocates it
        check_sequence_memory(recipe, target)
    convs = list(sources.conversations(settings.source, columns=columns(settings)))
    taken = len(convs) if settings.max_conversations is None else min(len(convs), settings.max_conversations)
    per_shard = shard_conversations(settings)           # data.batch_size, or a shard's conversations under auto
    batches = math.ceil(taken / per_shard)
    taken = min(len(convs), batches * per_shard)
    sample = random.Random(recipe.seed).sample(convs, min(PROBE_CONVERSATIONS, len(convs)))
    prompt_ids, rows, masks = [], [], []
    for conv in sample:
        if settings.mode == "prefill":
            chat = tokenize_chat(target.tokenizer, conv.messages, max_length=settings.max_seq_len)
        else:
            first = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
            chat = tokenize_chat(target.tokenizer, conv.messages[: first + 1], add_generation_prompt=True,
                                 max_length=settings.max_prompt_tokens)
        prompt_ids.append(chat.input_ids)
        rows.append(chat.input_ids if settings.mode == "prefill" else chat.input_ids + [0] * 8)
        masks.append(chat.loss_mask if settings.mode == "prefill" else [0] * len(chat.input_ids) + [1] * 8)
    mean_prompt = sum(len(x) for x in prompt_ids) / max(len(prompt_ids), 1)
    reply = 0 if settings.mode == "prefill" else settings.max_new_tokens * settings.max_turns
    lengths = estimate_lengths(target, settings, recipe.out / "data", [convs[:taken]])
    tokens = int(taken * lengths.tokens)
    layers = feature_layers(recipe, target) if recipe.train.features == "cache" else ()
    cache_bytes = feature_cache.estimate_bytes(int(taken * lengths.cached_tokens), layers, target.hidden_size) \
        if layers else 0
    free = free_bytes(recipe.out)
    rate, probe = _data_rate(target, prompt_ids, settings)
    made = taken * (mean_prompt if settings.mode == "prefill" else reply)
    data_minutes = made / rate / 60
    capped = settings.max_minutes is not None and data_minutes > settings.max_minutes
    lines = [f"{verb} --dry-run: {recipe.out} (nothing written)",
             f"  source {settings.source}: {len(convs)} conversations, {taken} taken ({batches} batches of "
             f"{settings.batch_size}; data.max_conversations {settings.max_conversations})",
             f"  tokens: about {tokens:,} ({lengths.tokens:.0f} per conversation, {lengths.cached_tokens:.0f} of them "
             f"within data.max_seq_len {settings.max_seq_len}: {lengths.source}; {mean_prompt:.0f} per prompt)",
             f"  feature cache: about {human_size(cache_bytes)} (layers {list(layers)}, bf16, "
             f"{len(set(layers)) * target.hidden_size * 2:,} bytes per token) against {human_size(free)} free"
             + ("" if cache_bytes < free else "  -- TOO LITTLE DISK: the run would be refused"),
             f"  data: {rate:,.{0 if rate >= 10 else 2}f} tokens/s measured here ({probe}): about {data_minutes:.1f} min"
             + (f", cut at data.max_minutes {settings.max_minutes}" if capped else "")]
    plan = {"conversations": len(convs), "taken": taken, "estimated_tokens": tokens, "cache_bytes": cache_bytes,
            "tokens_per_conversation": lengths.tokens, "length_source": lengths.source,
            "free_bytes": free, "data_tokens_per_second": rate, "data_minutes": min(data_minutes, settings.max_minutes
                                                                                 or data_minutes)}
    if verb == "train":
        probe = _training_probe(recipe, target, rows, masks)
        train_rate = probe.tokens_per_second
        held = 1 - recipe.train.heldout_fraction
        train_minutes = tokens * held * recipe.train.epochs / train_rate / 60
        cap = recipe.train.max_minutes
        lines.append(f"  training: {train_rate:,.{0 if train_rate >= 10 else 2}f} tokens/s measured here (2 steps, features computed online; "
                     "the cache is faster): about "
                     f"{train_minutes:.1f} min for {recipe.train.epochs:g} epochs"
                     + (f", cut at train.max_minutes {cap}" if cap is not None and train_minutes > cap else ""))
        plan.update(training_tokens_per_second=train_rate, training_minutes=min(train_minutes, cap or train_minutes))
        memory = memory_plan(recipe, target, probe, feature_layers(recipe, target))
        rows_host = int(tokens * (1 - 0) * TOKEN_COLUMN_BYTES)
        for mode in ("cache", "online"):
            memory[mode]["host"] += rows_host
        parts = memory["parts"]
        where = "GPU" if target.device.type == "cuda" else "device (here: host) "
        lines.append(f"  memory per training process at batch {recipe.train.batch_size} x {settings.max_seq_len} tokens "
                     f"({probe.trainable_parameters / 1e6:,.1f}M trainable parameters; activations "
                     f"{probe.saved_bytes_per_token / 1024:,.1f} KiB per token, measured in the probe):")
        for mode in ("cache", "online"):
            lines.append(f"    train.features={mode}: {where}{human_size(memory[mode]['device'])}, host "
                         f"{human_size(memory[mode]['host'])} beyond the libraries")
        lines.append(f"    parts: target {human_size(parts['target_whole'])} whole, "
                     f"{human_size(parts['target_embedding_and_head'])} embedding + lm_head; drafter weights, gradients "
                     f"and AdamW {human_size(parts['drafter_state'])} (ZeRO-2/3 and FSDP divide this by the processes); "
                     f"activations {human_size(parts['activations'])}; token columns {human_size(rows_host)}; "
                     f"{parts['loader_workers']} loader workers")
        plan["memory"] = memory
    print("\n".join(lines))
    return plan


TRAINING_BYTES_PER_PARAMETER = 16      # fp32 weight, gradient and AdamW's two moments


def check_drafter_size(recipe, target, world: int = 1) -> int:
    """The drafter the recipe describes, counted with its parameters on the meta device (nothing allocated);
    refused before any allocation when training it needs more memory than the device has in all, even
    sharded over `world` processes (a bound for hopeless sizes, not a fit check: the dry run's probe and
    --dry-run's memory line are that).  Returns its parameter count."""
    fix = "make it smaller (the drafter section: e.g. num_heads, num_layers, intermediate_size)"
    try:
        with init_empty_weights():         # parameters on the meta device; buffers (vocab maps, trees) real
            drafter = registry()[recipe.method](recipe.drafter, target)
    except RuntimeError as err:
        if "can't allocate memory" in str(err) or "out of memory" in str(err):     # one tensor past what exists
            asked = re.search(r"allocate (\d+) bytes", str(err))
            size = f" ({human_size(int(asked.group(1)))})" if asked else ""
            raise RecipeError(f"the drafter this recipe describes ({recipe.method}) holds a tensor{size} larger than "
                              f"this machine can allocate; {fix}") from None
        log.debug("drafter size not checked on the meta device: %s", err)
        return 0
    except (NotImplementedError, TypeError) as err:     # a drafter that cannot be built on meta
        log.debug("drafter size not checked on the meta device: %s", err)
        return 0
    owned = {id(p): p for p in drafter.parameters() if p.is_meta}     # the target's own weights are not counted
    count = sum(p.numel() for p in owned.values())
    needed = count * TRAINING_BYTES_PER_PARAMETER // max(world, 1)
    total = total_memory(target.device)
    if needed > total:
        raise RecipeError(f"the drafter this recipe describes ({recipe.method}, {count:,} parameters) needs about "
                          f"{human_size(needed)} to train (weights, gradients and optimizer state"
                          + (f", sharded over {world} processes" if world > 1 else "")
                          + f"), more than the {human_size(total)} {target.device} has in all; {fix}")
    return count


SEQUENCE_PROBE_TOKENS = (256, 512)     # two short rows whose saved activations fix the per-token slope


def sequence_memory(recipe, target) -> dict | None:
    """What one training process holds at least, at batch_size x data.max_seq_len: the target as training
    loads it, the drafter's weights, gradients and AdamW state, and the activations autograd saves in the
    forward (measured on one row of 256 and one of 512 tokens with random features, and extended to the
    batch's tokens along the line through the two: below the truth where attention's cost grows faster
    than the length, never above it).  None when the drafter cannot be probed this way."""
    seq = recipe.data.max_seq_len
    if drafter_class(recipe.method).trains_target_adapter:       # its probe would put a LoRA into the target
        log.info("training memory at data.max_seq_len not estimated for %s: it trains the target itself",
                 recipe.method)
        return None
    drafter = None
    devices = [target.device] if target.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):     # the run's own random state is left as it was
            torch.manual_seed(0)
            drafter = registry()[recipe.method](recipe.drafter, target)
            if recipe.train.gradient_checkpointing:
                drafter.enable_gradient_checkpointing()
            vocab = recipe.drafter.draft_vocab_size
            if vocab:
                drafter.set_draft_vocabulary(torch.arange(min(vocab, target.vocab_size)))
            drafter.to(target.device).train()
            bf16 = recipe.train.mixed_precision == "bf16" or (
                recipe.train.mixed_precision == "auto" and resolve_dtype("auto", target.device) == torch.bfloat16)
            lengths = sorted({min(seq, n) for n in SEQUENCE_PROBE_TOKENS})
            saved_at = [_saved_bytes(drafter, target, n, bf16) for n in lengths]
            trainable = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    except (RuntimeError, ValueError, KeyError, NotImplementedError, TypeError) as err:
        log.info("training memory at data.max_seq_len not estimated for %s: %s", recipe.method, err)
        return None
    finally:
        del drafter
    if len(lengths) == 1:
        per_row = saved_at[0]
    else:
        slope = max(0.0, (saved_at[1] - saved_at[0]) / (lengths[1] - lengths[0]))
        per_row = saved_at[0] + slope * (seq - lengths[0])
    held_target = _parameter_bytes(target) if target.layers_loaded \
        else 2 * target.vocab_size * target.hidden_size * 2                   # embedding + lm_head, bf16
    return {"activations": int(per_row * recipe.train.batch_size),
            "drafter_state": trainable * TRAINING_BYTES_PER_PARAMETER, "target": held_target, "probe_tokens": lengths, "probe_saved_bytes": saved_at}


def _saved_bytes(drafter, target, length: int, bf16: bool) -> int:
    """Bytes of the activations autograd saves in one forward of the drafter's loss on a row of `length`
    random tokens (each storage counted once; the weights themselves not counted)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, length), generator=generator).to(target.device)
    reply = torch.zeros_like(ids)
    reply[:, length // 10:] = 1
    features = {layer: torch.randn(1, length, target.hidden_size, generator=generator).to(target.device,
                                                                                          target.dtype)
                for layer in drafter.required_layers}
    saved = {}

    def pack(tensor):
        if not tensor.requires_grad or tensor.grad_fn is not None:
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=bf16):
        drafter.loss({"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": reply,
                      "features": features})
    return sum(saved.values())


def check_sequence_memory(recipe, target, world: int = 1) -> dict | None:
    """Refuse, before data is made or the drafter is allocated, a data.max_seq_len (with train.batch_size)
    whose training needs more memory than the device has in all: the lower bound of `sequence_memory`,
    with the processes that share this machine's memory when training runs on the CPU.  Returns the
    estimate (None when it could not be made)."""
    estimate = sequence_memory(recipe, target)
    if estimate is None:
        return None
    sharded = estimate["drafter_state"] // max(world, 1)
    per_process = estimate["target"] + sharded + estimate["activations"]
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torch.device(target.device).type == "cpu" else 1
    needed = per_process * local
    total = total_memory(target.device)
    estimate.update(per_process=per_process, needed=needed, total=total)
    log.info("training memory at batch %d x %d tokens: at least %s per process (activations %s)",
             recipe.train.batch_size, recipe.data.max_seq_len, human_size(per_process),
             human_size(estimate["activations"]))
    if needed > total:
        shared = f" x {local} processes on this machine" if local > 1 else ""
        raise RecipeError(
            f"training at data.max_seq_len {recipe.data.max_seq_len} with train.batch_size {recipe.train.batch_size} "
            f"needs at least {human_size(needed)}{shared} (activations {human_size(estimate['activations'])}, "
            f"measured at {estimate['probe_tokens']} tokens and extended; drafter weights, gradients and AdamW "
            f"{human_size(sharded)}; target {human_size(estimate['target'])}), more than the "
            f"{human_size(total)} {target.device} has in all; lower data.max_seq_len or train.batch_size "
            "(train.grad_accum keeps the batch), or set train.gradient_checkpointing=true")
    return estimate

