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
from draftsmith.heads.runtime.target import Target

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
    """Left-pad the prompts into one batch and run them through the engine in chunks."""
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
