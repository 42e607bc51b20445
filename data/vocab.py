"""The draft vocabulary: the tokens a drafter may propose.

A drafter that scores only the most frequent tokens of the target's replies
costs a fraction of one that scores the whole vocabulary (on SmolLM2's 49k
vocabulary the projection is most of a head's work), and loses only the
proposals of rare tokens.  EAGLE-3 (arXiv 2503.01840) uses the
`draft_vocab_size` most frequent tokens at assistant positions, kept in
ascending id order, with
  d2t[i] = used[i] - i          (target_id = draft_id + d2t[draft_id])
  t2d = bool mask over the target vocabulary.
vLLM's Medusa takes the same set as `token_map` (the target ids themselves).
"""
from __future__ import annotations

import torch


def assistant_token_counts(input_ids, loss_masks, vocab_size: int) -> torch.Tensor:
    """How often each token appears at assistant positions: [vocab_size] long."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in zip(input_ids, loss_masks):
        ids = torch.as_tensor(ids)
        mask = torch.as_tensor(mask, dtype=torch.bool)
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocabulary(counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The `size` most frequent target ids (plus `always`, e.g. end-of-turn tokens), ascending: [size] long."""
    vocab_size = counts.numel()
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft_vocab_size={size} must be between 1 and the target vocabulary size {vocab_size}")
    if size == vocab_size:
        return torch.arange(vocab_size)
    scores = counts.double().clone()
    scores[list(always)] = float("inf")
    # stable: among equal counts (e.g. tokens never seen) the lower id wins, so the choice is deterministic
    chosen = torch.argsort(scores, descending=True, stable=True)[:size]
    return chosen.sort().values


def d2t_offsets(draft_to_target: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's d2t: offsets such that target_id = draft_id + d2t[draft_id]."""
    return draft_to_target - torch.arange(draft_to_target.numel())


def t2d_mask(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[draft_to_target] = True
    return mask


def coverage(counts: torch.Tensor, draft_to_target: torch.Tensor) -> float:
    """Fraction of assistant tokens the draft vocabulary contains."""
    total = counts.sum().item()
    return counts[draft_to_target].sum().item() / total if total else 0.0
