"""`--dry-run` for `data` and `train`: what a run would read, make and cost, from a short measured
probe on this machine, writing nothing.

The counts are exact (the source is read and cut as a run would cut it); token counts are estimated
from a seeded sample of 32 conversations (regeneration: the rendered prompts plus `max_new_tokens`
per reply, an upper bound); the minutes come from timing the target on that sample here (a batch
regenerated for 16 tokens, or prefilled) and two drafter training steps on it.
"""
from __future__ import annotations

import math
import random
import time

import torch
from draftsmith.heads.files import free_bytes, human_size

PROBE_CONVERSATIONS = 32
PROBE_TOKENS = 32


@torch.no_grad()
def _data_rate(target, sample_ids: list[list[int]], settings) -> tuple[float, str]:
    """Tokens per second the data step makes here, measured on the sample."""
    from draftsmith.data.generate import generate_batch

    batch = sample_ids[: min(settings.batch_size, len(sample_ids))]
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


def _training_rate(recipe, target, rows: list[list[int]], masks: list[list[int]]) -> float:
    """Training tokens per second here: two drafter steps on the sample (features computed online)."""
    from draftsmith.heads.drafter import registry
    from draftsmith.train.batches import collate

    drafter = registry()[recipe.method](recipe.drafter, target)
    drafter.attach_backbone()
    drafter.train()
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-6)
    batch = collate([{"input_ids": r, "loss_mask": m} for r, m in zip(rows, masks)][: recipe.train.batch_size])
    batch = {k: v.to(target.device) for k, v in batch.items()}
    layers = drafter.required_layers
    features = target.features(batch["input_ids"], batch["attention_mask"], layers) if layers else {}
    seconds = []
    for _ in range(2):
        start = time.time()
        drafter.loss({**batch, "features": features}).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.time() - start)
    return int(batch["attention_mask"].sum()) / max(seconds[-1], 1e-6)


def dry_run(recipe, target, verb: str) -> dict:
    """The plan of `draftsmith data|train RECIPE`, printed and returned; nothing is written."""
    from draftsmith.data import features as feature_cache
    from draftsmith.data import sources
    from draftsmith.data.chat import tokenize_chat
    from draftsmith.data.distill import columns
    from draftsmith.train.batches import feature_layers

    settings = recipe.data
    convs = list(sources.conversations(settings.source, columns=columns(settings)))
    taken = len(convs) if settings.max_conversations is None else min(len(convs), settings.max_conversations)
    batches = math.ceil(taken / settings.batch_size)
    taken = min(len(convs), batches * settings.batch_size)
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
    tokens = int(taken * (mean_prompt + reply))
    layers = feature_layers(recipe, target) if recipe.train.features == "cache" else ()
    cache_bytes = feature_cache.estimate_bytes(tokens, layers, target.hidden_size) if layers else 0
    free = free_bytes(recipe.out)
    rate, probe = _data_rate(target, prompt_ids, settings)
    made = taken * (mean_prompt if settings.mode == "prefill" else reply)
    data_minutes = made / rate / 60
    capped = settings.max_minutes is not None and data_minutes > settings.max_minutes
    lines = [f"{verb} --dry-run: {recipe.out} (nothing written)",
             f"  source {settings.source}: {len(convs)} conversations, {taken} taken ({batches} batches of "
             f"{settings.batch_size}; data.max_conversations {settings.max_conversations})",
             f"  tokens: about {tokens:,} ({mean_prompt:.0f} per prompt in a sample of {len(sample)}"
             + (f", + up to {reply} per reply: an upper bound)" if reply else ", prefilled as written)"),
             f"  feature cache: about {human_size(cache_bytes)} (layers {list(layers)}, bf16) against {human_size(free)} free"
             + ("" if cache_bytes < free else "  -- TOO LITTLE DISK: the run would be refused"),
             f"  data: {rate:,.0f} tokens/s measured here ({probe}): about {data_minutes:.1f} min"
             + (f", cut at data.max_minutes {settings.max_minutes}" if capped else "")]
    plan = {"conversations": len(convs), "taken": taken, "estimated_tokens": tokens, "cache_bytes": cache_bytes,
            "free_bytes": free, "data_tokens_per_second": rate, "data_minutes": min(data_minutes, settings.max_minutes
                                                                                 or data_minutes)}
    if verb == "train":
        train_rate = _training_rate(recipe, target, rows, masks)
        held = 1 - recipe.train.heldout_fraction
        train_minutes = tokens * held * recipe.train.epochs / train_rate / 60
        cap = recipe.train.max_minutes
        lines.append(f"  training: {train_rate:,.0f} tokens/s measured here (2 steps, features computed online; "
                     "the cache is faster): about "
                     f"{train_minutes:.1f} min for {recipe.train.epochs:g} epochs"
                     + (f", cut at train.max_minutes {cap}" if cap is not None and train_minutes > cap else ""))
        plan.update(training_tokens_per_second=train_rate, training_minutes=min(train_minutes, cap or train_minutes))
    print("\n".join(lines))
    return plan
