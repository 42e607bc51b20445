"""Batched generation with draftsmith's engine, for self-distillation.

Prompts are left-padded into one batch; padding slots are marked invalid in
the engine cache, so every row attends only to its own tokens and sees the
same positions it would see alone.  Rows leave the batch when they finish,
so the batch shrinks instead of decoding padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.heads.decoding.sampling import next_token
from draftsmith.heads.runtime.engine import EngineCache, merge_recurrent
from draftsmith.heads.runtime.target import BlockOutput, Target

PREFILL_CHUNK = 256   # prompt tokens per prefill forward: bounds the attention scores' memory


@dataclass
class Generation:
    token_ids: list[int]     # generated tokens, the stop token included when it was produced
    stopped: bool            # True if an end-of-turn token ended it (False: max_new_tokens)
    features: torch.Tensor | None = None
    """[prompt + generated tokens, layers, d] hidden states at capture_layers; the last generated
    token is never fed back, so its row is zeros (no drafter reads a feature after the last token)."""


@torch.no_grad()
def generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, generator: torch.Generator | None = None,
                   on_tokens=None, capture_layers=()) -> list[Generation]:
    """Continue every prompt until an end-of-turn token or `max_new_tokens`; `on_tokens(n)` reports progress.

    With capture_layers, the hidden states the forwards compute anyway are kept (the feature cache)."""
    capture_layers = sorted(set(capture_layers))
    device = target.device
    batch = len(prompts)
    prefilled = prefill_prompts(target, prompts, max_new_tokens, capture_layers)
    cache, out, positions, prompt_features = (prefilled.cache, prefilled.last, prefilled.positions,
                                              prefilled.features)
    longest = positions.shape[1]
    step_features = []                                   # (rows, [live, layers, d]) per decode step
    stop_ids = torch.tensor(target.eos_token_ids, device=device)
    rows = torch.arange(batch, device=device)          # [live] which prompt each live row continues
    next_pos = positions[:, -1] + 1                     # [live]
    finished = torch.zeros(batch, dtype=torch.bool, device=device)   # [live] stopped, still in the batch
    outputs: list[list[int]] = [[] for _ in range(batch)]
    stopped = [False] * batch
    logits = out.logits[:, -1]                          # [live, v]
    for step in range(max_new_tokens):
        tokens = next_token(logits, temperature, top_p, generator)            # [live]
        recording = ~finished
        for row, token in zip(rows[recording].tolist(), tokens[recording].tolist()):
            outputs[row].append(token)
            if token in target.eos_token_ids:
                stopped[row] = True
        if on_tokens is not None:
            on_tokens(int(recording.sum()))
        finished = finished | torch.isin(tokens, stop_ids)
        if step == max_new_tokens - 1 or bool(finished.all()):
            break
        # Shrinking the batch copies the cache, which costs about a step: do it
        # once a quarter of the rows has finished; until then they decode unread.
        if int(finished.sum()) * 4 >= len(rows):
            keep = (~finished).nonzero().squeeze(1)
            cache.select_rows(keep)
            rows, tokens, next_pos, finished = rows[keep], tokens[keep], next_pos[keep], finished[keep]
        out = target.forward_block(cache, tokens[:, None], next_pos[:, None], logits="last",
                                   layer_ids=capture_layers)
        if capture_layers:
            step_features.append((rows.tolist(), stack_layers(out, capture_layers)[:, 0]))
        logits = out.logits[:, -1]
        next_pos = next_pos + 1
    results = [Generation(outputs[r], stopped[r]) for r in range(batch)]
    if capture_layers:
        _attach_features(results, prompts, longest, prompt_features, step_features)
    return results


@dataclass
class Prefilled:
    cache: object                  # EngineCache holding the prompts
    last: object                   # BlockOutput of the last chunk (its last logits start decoding)
    positions: torch.Tensor        # [b, longest] position ids (0 on padding)
    features: list                 # per chunk [b, chunk, layers, d] when capturing


def prefill_prompts(target: Target, prompts: list[list[int]], max_new_tokens: int, capture_layers) -> Prefilled:
    """Left-pad the prompts into one batch and run them through the engine in chunks.

    A target with recurrent layers would read the padding as tokens: each prompt is prefilled alone, and
    the caches are merged (merge_rows), left-padded as a batch's would be."""
    if target.recurrent and len(prompts) > 1:
        return _prefill_one_by_one(target, prompts, max_new_tokens, capture_layers)
    device = target.device
    batch, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, longest), 0, dtype=torch.long, device=device)
    valid = torch.zeros(batch, longest, dtype=torch.bool, device=device)
    positions = torch.zeros(batch, longest, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        pad = longest - len(prompt)
        ids[row, pad:] = torch.tensor(prompt, device=device)
        valid[row, pad:] = True
        positions[row, pad:] = torch.arange(len(prompt), device=device)
    cache = target.new_cache(batch, longest + max_new_tokens)
    features = []                                        # [batch, chunk, layers, d] per prefill chunk
    for start in range(0, longest, PREFILL_CHUNK):
        chunk = slice(start, start + PREFILL_CHUNK)
        out = target.forward_block(cache, ids[:, chunk], positions[:, chunk], valid=valid[:, chunk], logits="last",
                                   layer_ids=capture_layers)
        if capture_layers:
            features.append(stack_layers(out, capture_layers))
    return Prefilled(cache, out, positions, features)


def _prefill_one_by_one(target: Target, prompts: list[list[int]], max_new_tokens: int, capture_layers) -> Prefilled:
    device = target.device
    singles = [prefill_prompts(target, [prompt], max_new_tokens, capture_layers) for prompt in prompts]
    one = torch.zeros(1, dtype=torch.long, device=device)
    cache = merge_rows([(single.cache, one) for single in singles], max_new_tokens)
    longest = max(len(p) for p in prompts)
    positions = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        positions[row, longest - len(prompt):] = torch.arange(len(prompt), device=device)
    logits = torch.cat([single.last.logits for single in singles])
    last = BlockOutput(logits=logits, hidden_states={})
    features = []
    if capture_layers:
        own = [torch.cat(single.features, dim=1)[0] for single in singles]                   # [len, L, d]
        padded = own[0].new_zeros(len(prompts), longest, *own[0].shape[1:])
        for row, part in enumerate(own):
            padded[row, longest - part.shape[0]:] = part
        features = [padded]
    return Prefilled(cache, last, positions, features)


def merge_rows(parts: list[tuple[EngineCache, torch.Tensor]], extra: int) -> EngineCache:
    """A new cache holding `rows` of each part's cache, each row's valid slots left-padded to a common
    length; room for `extra` more slots.  parts: (cache, row indices [r]) in the new row order."""
    lengths = [int(cache.valid[rows, :cache.length].sum(1).max()) for cache, rows in parts]
    length = max(lengths)
    first = parts[0][0]
    device = first.valid.device
    total = sum(int(rows.numel()) for _, rows in parts)
    recurrent = merge_recurrent(parts) if first.recurrent is not None else None
    merged = EngineCache(total, length + extra, first.num_layers, device=device, recurrent=recurrent,
                         attention_layers=first.attention_layers)
    merged.length = length
    start = 0
    for cache, rows in parts:
        r = int(rows.numel())
        valid = cache.valid[rows, :cache.length]                                    # [r, old]
        count = valid.sum(1)                                                         # [r]
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)          # valid slots first, in order
        source = torch.arange(length, device=device)[None] - (length - count)[:, None]   # [r, length]
        kept = source >= 0
        index = torch.gather(order, 1, source.clamp(0, cache.length - 1))            # [r, length] old slot
        dst = slice(start, start + r)
        merged.valid[dst, :length] = kept
        merged.positions[dst, :length] = torch.gather(cache.positions[rows, :cache.length], 1, index) * kept
        for layer in range(cache.num_layers):
            for store, mine in ((cache.keys, merged.keys), (cache.values, merged.values)):
                if store[layer] is None:             # a recurrent layer: no keys or values
                    continue
                old = store[layer][rows.to(store[layer].device)]                     # [r, h, c, d]
                if mine[layer] is None:
                    b_h_d = (total, old.shape[1], merged.capacity, old.shape[3])
                    mine[layer] = old.new_zeros(b_h_d)
                slots = index.to(old.device)[:, None, :, None].expand(r, old.shape[1], length, old.shape[3])
                gathered = torch.gather(old, 2, slots)          # a spread target: on this layer's own device
                mine[layer][dst, :, :length] = gathered
        start += r
    return merged


def stack_layers(out, layers) -> torch.Tensor:
    return torch.stack([out.hidden_states[i] for i in layers], dim=2).to(torch.bfloat16)   # [b, n, layers, d]


def _attach_features(results, prompts, longest, prompt_features, step_features) -> None:
    prompt_part = torch.cat(prompt_features, dim=1)                                          # [batch, longest, L, d]
    per_row_steps: dict[int, list[torch.Tensor]] = {}
    for rows, feats in step_features:
        for j, row in enumerate(rows):
            per_row_steps.setdefault(row, []).append(feats[j])
    for row, result in enumerate(results):
        fed = per_row_steps.get(row, [])[: len(result.token_ids) - 1]      # generated tokens fed back in
        own_prompt = prompt_part[row, longest - len(prompts[row]):]
        last = torch.zeros_like(prompt_part[row, :1])                       # the final token: never fed
        result.features = torch.cat([own_prompt] + [f[None] for f in fed] + [last])
