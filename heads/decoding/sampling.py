"""The one definition of "the target's distribution" under temperature and top-p.

Data generation, plain decoding and every acceptance rule draw from the
distribution `probabilities` returns, so speculative sampling preserves
exactly what plain sampling would draw.
"""
from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution over the vocabulary: [..., v] logits -> [..., v] probabilities (float32).

    temperature 0 means greedy: a one-hot at the argmax.
    top_p < 1 keeps the smallest set of tokens whose mass reaches top_p
    (the token that crosses the threshold is kept), then renormalises.
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs          # mass of strictly better tokens
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row: [..., v] -> [...] (long)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def next_token(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Greedy argmax or a sample from `probabilities`: [..., v] -> [...]."""
    if temperature <= 0:
        return logits.argmax(-1)
    return sample(probabilities(logits, temperature, top_p), generator)
