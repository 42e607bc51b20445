"""The draft vocabulary, one helper for every drafter: which target tokens it scores, and back.

`draft_to_target` [v] (ascending target ids) is a buffer saved with the drafter's weights;
`target_to_draft` [V] (-1 for tokens outside the draft vocabulary) is derived from it, a
non-persistent buffer: it moves with `.to()` and is never written to a checkpoint.  After every
change (`set_draft_map`, or `load_state_dict` through a public post-hook) the derived map is
rebuilt and the drafter's `vocabulary_changed()` drops whatever it cached from the old one.
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
