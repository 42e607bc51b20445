"""EAGLE-2's dynamic draft tree (arXiv 2406.16858, section 4), for any drafter that drafts one level at a time.

Expand: the root's top_k tokens form depth 1.  At each further depth the
current frontier (the top_k nodes of the previous depth by cumulative
log-probability) is fed to the drafter in one batch, each node seeing the
real context and its own ancestors only; every node proposes its top_k
children, all of which join the pool, and the top_k of them by cumulative
log-probability become the next frontier.
Rerank: the pool's best `total_tokens` nodes form the tree.  A child's
cumulative log-probability never exceeds its parent's, and ties go to the
shallower node, so the kept set always contains each node's ancestors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.heads.decoding.tree import DraftTree


@dataclass
class TreeSettings:
    depth: int = 5
    """Draft levels (the longest path a step can accept)."""
    top_k: int = 8
    """Children per expanded node, and nodes expanded per level."""
    total_tokens: int = 32
    """Nodes kept after reranking (the target verifies this many at once)."""

    def __post_init__(self):
        if min(self.depth, self.top_k, self.total_tokens) < 1:
            raise ValueError(f"tree depth, top_k and total_tokens must be >= 1, got {self}")
        if self.depth > 64 or self.top_k > 1024 or self.total_tokens > 4096:
            raise ValueError(f"tree depth is at most 64, top_k at most 1024 and total_tokens at most 4096 (the target "
                             f"verifies total_tokens at once; EAGLE-2 uses 6, 10 and 60), got {self}")

    @classmethod
    def chain(cls, length: int) -> TreeSettings:
        return cls(depth=length, top_k=1, total_tokens=length)


def grow(step, root_hidden: torch.Tensor, root_logprobs: torch.Tensor, settings: TreeSettings,
         first_slot: int, draft_to_target: torch.Tensor) -> DraftTree:
    """Grow a tree under the root, one batched decision per depth (no per-node loop, no host sync until the end).

    step(hidden [k, H], draft_tokens [k], depths [k], visible [k, fed]) -> (hidden [k, H], logprobs [k, v])
    feeds k nodes to the drafter at once (each at cache slot first_slot + fed-so-far)
    and returns their outputs; `visible[j]` marks which earlier drafted slots node j
    may see (its ancestors; the real context is always visible).
    root_hidden: [H]; root_logprobs: [v] over the draft vocabulary.

    The pool holds every node ever proposed, in depth order (so index order is depth order):
    tokens, cumulative log-probability `score` and parent index (-1: the root).
    """
    device = root_hidden.device
    k = min(settings.top_k, root_logprobs.numel())
    capacity = k + (settings.depth - 1) * k * k
    tokens = torch.zeros(capacity, dtype=torch.long, device=device)
    scores = torch.zeros(capacity, dtype=torch.float32, device=device)
    parents = torch.full((capacity,), -1, dtype=torch.long, device=device)
    slot_of = torch.full((capacity,), -1, dtype=torch.long, device=device)      # drafter-cache slot once fed
    fed_hidden = root_hidden.new_zeros(max(1, (settings.depth - 1) * k), root_hidden.shape[-1])   # [fed, H]
    ancestors = torch.zeros(max(1, (settings.depth - 1) * k), max(1, (settings.depth - 1) * k), dtype=torch.bool,
                            device=device)                        # [fed, fed] row j: slots node j sees (itself too)
    top = root_logprobs.topk(k)
    tokens[:k], scores[:k] = top.indices, top.values.float()
    size = k
    frontier = torch.arange(k, device=device)                                    # [k] pool indices
    fed = 0
    for depth in range(2, settings.depth + 1):
        # a node is fed with its parent's output (the root's for depth 1) and its own token
        parent = parents[frontier]                                                 # [k]
        parent_slot = slot_of[parent.clamp(min=0)]
        is_root_child = (parent < 0)[:, None]
        hidden = torch.where(is_root_child, root_hidden[None], fed_hidden[parent_slot.clamp(min=0)])   # [k, H]
        visible = ancestors[parent_slot.clamp(min=0), :fed] & ~is_root_child     # [k, fed]
        depths = torch.full((k,), depth - 1, device=device)
        out_hidden, logprobs = step(hidden, tokens[frontier], depths, visible)
        rows = torch.arange(fed, fed + k, device=device)
        slot_of[frontier] = rows
        fed_hidden[rows] = out_hidden.to(fed_hidden.dtype)
        ancestors[rows, :fed] = visible
        ancestors[rows, rows] = True
        fed += k
        children = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)             # [k, c]
        c = children.indices.shape[1]
        new = slice(size, size + k * c)
        tokens[new] = children.indices.reshape(-1)
        scores[new] = (scores[frontier][:, None] + children.values.float()).reshape(-1)
        parents[new] = frontier.repeat_interleave(c)
        frontier = size + scores[new].topk(min(k, k * c)).indices
        size += k * c
    # rerank: best total_tokens by score; a stable sort keeps ties in index (= depth) order, so a parent
    # (never scored below its child) always precedes it and the kept set is a tree
    order = torch.sort(scores[:size], descending=True, stable=True).indices
    kept = order[: settings.total_tokens].sort().values                          # depth order
    position = torch.full((size,), -1, dtype=torch.long, device=device)
    position[kept] = torch.arange(kept.numel(), device=device)
    kept_parents = parents[kept]
    tree_parents = torch.where(kept_parents >= 0, position[kept_parents.clamp(min=0)], kept_parents)
    return DraftTree(tokens=draft_to_target[tokens[kept]].cpu(), parents=tree_parents.cpu())
