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

from .tree import DraftTree


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

    @classmethod
    def chain(cls, length: int) -> TreeSettings:
        return cls(depth=length, top_k=1, total_tokens=length)


@dataclass
class _Node:
    token: int             # draft-vocabulary id
    parent: int            # node index, -1 for the root
    score: float           # cumulative log-probability
    depth: int
    slot: int = -1         # drafter-cache slot once fed
    hidden: torch.Tensor | None = None   # the drafter's output after feeding it


def grow(step, root_hidden: torch.Tensor, root_logprobs: torch.Tensor, settings: TreeSettings,
         first_slot: int, draft_to_target: torch.Tensor) -> DraftTree:
    """Grow a tree under the root.

    step(hidden [k, H], draft_tokens [k], depths [k], visible [k, slots]) -> (hidden [k, H], logprobs [k, v])
    feeds k nodes to the drafter at once (each at cache slot first_slot + fed-so-far)
    and returns their outputs; `visible[j]` marks which earlier drafted slots node j
    may see (its ancestors; the real context is always visible).
    root_hidden: [H]; root_logprobs: [v] over the draft vocabulary.
    """
    nodes: list[_Node] = []
    top = root_logprobs.topk(min(settings.top_k, root_logprobs.numel()))
    frontier = []
    for value, index in zip(top.values.tolist(), top.indices.tolist()):
        nodes.append(_Node(index, -1, value, 1))
        frontier.append(len(nodes) - 1)
    fed = 0
    for depth in range(2, settings.depth + 1):
        # a node is fed with its parent's output (the root's for depth 1) and its own token
        hidden = torch.stack([root_hidden if nodes[n].parent < 0 else nodes[nodes[n].parent].hidden
                              for n in frontier])                                            # [k, H]
        tokens = torch.tensor([nodes[n].token for n in frontier], device=root_hidden.device)
        visible = torch.zeros(len(frontier), fed, dtype=torch.bool, device=root_hidden.device)
        for j, n in enumerate(frontier):
            parent = nodes[n].parent
            while parent >= 0:
                visible[j, nodes[parent].slot - first_slot] = True
                parent = nodes[parent].parent
        depths = torch.full((len(frontier),), depth - 1, device=root_hidden.device)
        out_hidden, logprobs = step(hidden, tokens, depths, visible)
        for j, n in enumerate(frontier):
            nodes[n].slot, nodes[n].hidden = first_slot + fed + j, out_hidden[j]
        fed += len(frontier)
        children = logprobs.topk(min(settings.top_k, logprobs.shape[-1]), dim=-1)
        candidates = []
        for j, n in enumerate(frontier):
            for value, index in zip(children.values[j].tolist(), children.indices[j].tolist()):
                nodes.append(_Node(index, n, nodes[n].score + value, depth))
                candidates.append(len(nodes) - 1)
        candidates.sort(key=lambda c: -nodes[c].score)
        frontier = candidates[: settings.top_k]
    ranked = sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth, n))
    kept = sorted(ranked[: settings.total_tokens], key=lambda n: (nodes[n].depth, n))
    position = {n: i for i, n in enumerate(kept)}
    tokens = draft_to_target[torch.tensor([nodes[n].token for n in kept], device=draft_to_target.device)]
    parents = torch.tensor([position[nodes[n].parent] if nodes[n].parent >= 0 else -1 for n in kept])
    return DraftTree(tokens=tokens.cpu(), parents=parents)
