"""The draft vocabulary, one helper for every drafter: which target tokens it scores, and back.

`draft_to_target` [v] (ascending target ids) is a buffer saved with the drafter's weights;
`target_to_draft` [V] (-1 for tokens outside the draft vocabulary) is derived from it, a
non-persistent buffer: it moves with `.to()` and is never written to a checkpoint.  After every
change (`set_draft_map`, or `load_state_dict` through a public post-hook) the derived map is
rebuilt and the drafter's `vocabulary_changed()` drops whatever it cached from the old one.

Which tokens (`draft_vocabulary`, from the training data): a drafter that scores only the most
frequent tokens of the target's replies costs a fraction of one that scores the whole vocabulary (on SmolLM2's 49k
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
from torch import nn


def add_draft_vocabulary(module: nn.Module, size: int, target_vocab_size: int) -> None:
    """Give `module` the identity map over the first `size` target ids, and keep the inverse in step."""
    if size > target_vocab_size:
        raise ValueError(f"draft_vocab_size={size} is larger than the target's vocabulary ({target_vocab_size}); "
                         f"use at most {target_vocab_size}, or null for all of it")
    if size < 1:
        raise ValueError(f"draft_vocab_size must be >= 1 or null, got {size}")
    module.register_buffer("draft_to_target", torch.arange(size))
    module.register_buffer("target_to_draft", torch.full((target_vocab_size,), -1, dtype=torch.long),
                           persistent=False)
    module.register_load_state_dict_post_hook(lambda m, _keys: _rebuild(m))
    _rebuild(module)


def set_draft_map(module: nn.Module, draft_to_target: torch.Tensor) -> None:
    """Score these target ids (ascending, as many as the drafter's draft vocabulary holds)."""
    ids = draft_to_target.to(module.draft_to_target.device, torch.long)
    if ids.shape != module.draft_to_target.shape:
        raise ValueError(f"a draft vocabulary of {ids.numel()} ids for a drafter built for "
                         f"{module.draft_to_target.numel()}")
    if ids.numel() > 1 and not ids.is_meta and bool((ids.diff() <= 0).any()):
        raise ValueError("draft vocabulary ids must be strictly ascending target ids")
    module.draft_to_target.copy_(ids)
    _rebuild(module)


def _rebuild(module: nn.Module) -> None:
    inverse = torch.full_like(module.target_to_draft, -1)
    inverse[module.draft_to_target.to(inverse.device)] = torch.arange(module.draft_to_target.numel(),
                                                                      device=inverse.device)
    module.target_to_draft.copy_(inverse)
    module.vocabulary_changed()          # DrafterBase: a no-op unless the drafter caches something


# -- choosing it from the training data, and the serving stacks' encodings of it ---------------

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
