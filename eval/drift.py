"""Drift: how far base + a trained adapter (Medusa-2) is from the original model, on the same prompts.

Medusa-2 trains the backbone, so speculative decoding is exact for the ADAPTED model only.  Three
numbers say what that costs, measured greedily on the evaluation's own prompts:
- token_agreement: over the adapted model's greedy reply, both models reading the same text
  (teacher-forced, one full forward each), the fraction of positions where their greedy choices are
  the same token (comparing two forwards of the same kind, so numerical noise between the engine's
  incremental decode and a full forward does not count as drift);
- mean_kl: the mean KL(original || adapted) of the next-token distributions at those positions (nats);
- identical_replies: the fraction of prompts whose whole greedy replies are identical.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.runtime.target import Target


@torch.no_grad()
def drift(adapted: Target, original: Target, prompts: list[tuple[str, list[int]]], max_new_tokens: int) -> dict:
    agree = positions = identical = 0
    kl = 0.0
    for _, prompt in prompts:
        reply = decode(adapted, prompt, max_new_tokens).tokens
        identical += reply == decode(original, prompt, max_new_tokens).tokens
        if not reply:
            continue
        ids = torch.tensor([prompt + reply], device=adapted.device)
        scored = slice(len(prompt) - 1, len(prompt) - 1 + len(reply))          # positions predicting the reply
        log_q = F.log_softmax(adapted.model(input_ids=ids, use_cache=False).logits[0, scored].float(), -1)
        log_p = F.log_softmax(original.model(input_ids=ids.to(original.device), use_cache=False)
                              .logits[0, scored].float(), -1).to(log_q.device)
        kl += F.kl_div(log_q, log_p, log_target=True, reduction="sum").item()
        agree += int((log_p.argmax(-1) == log_q.argmax(-1)).sum())      # both read the same text
        positions += len(reply)
    return {"prompts": len(prompts), "token_agreement": agree / max(1, positions),
            "mean_kl": kl / max(1, positions), "identical_replies": identical / max(1, len(prompts))}
