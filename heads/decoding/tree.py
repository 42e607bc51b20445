"""Draft trees: the candidates one target forward verifies.

A tree hangs under the root, the last committed token (not yet in the KV
cache).  Nodes are numbered so a parent comes before its children, which
makes every root-to-node path ascend in index.  Node i sits at depth
`depths[i]` (root children: 1) and is verified at position root + depth; it
attends to the root and its own ancestors only (Medusa, arXiv 2401.10774,
section 2.3.2).  A chain is the tree in which every node has one child.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A proposal: n candidate tokens and their tree."""

    tokens: torch.Tensor          # [n] long
    parents: torch.Tensor         # [n] long, parent node index or -1 for the root
    draft_probs: torch.Tensor | None = None   # [n, v] drafter distribution each node was drawn from (chains)

    def __post_init__(self):
        self.depths = depths_of(self.parents)
        self._mask = None

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    def attention_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool over (root, nodes): row i sees itself and its ancestors."""
        if self._mask is None:
            self._mask = ancestor_mask(self.parents)
        return self._mask


def depths_of(parents: torch.Tensor) -> torch.Tensor:
    depths = torch.zeros(parents.numel(), dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        if p >= i:
            raise ValueError(f"tree node {i} has parent {p}: a parent must come before its children")
        depths[i] = 1 if p < 0 else depths[p] + 1
    return depths


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    n = parents.numel()
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True                       # everyone sees the root
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            mask[i + 1] |= mask[p + 1]
    return mask


@dataclass
class TreeShape:
    """A static tree of (depth, rank) choices: node = the rank-th candidate of position `depth`.

    `paths` lists each node as the tuple of ranks from the root, e.g. (0, 1) is
    the second candidate at depth 2 under the top candidate at depth 1.  Every
    prefix of a path must itself be a path.
    """

    paths: list[tuple[int, ...]]

    def __post_init__(self):
        self.paths = sorted({tuple(p) for p in self.paths}, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(self.paths)}
        missing = [p for p in self.paths if len(p) > 1 and p[:-1] not in index]
        if missing or any(len(p) == 0 for p in self.paths):
            raise ValueError(f"tree paths must be non-empty and prefix-closed; missing parents for {missing[:5]}")
        self.parents = torch.tensor([index[p[:-1]] if len(p) > 1 else -1 for p in self.paths], dtype=torch.long)
        self.depths = depths_of(self.parents)
        self.ranks = torch.tensor([p[-1] for p in self.paths], dtype=torch.long)

    @property
    def size(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def max_rank(self) -> int:
        return max(max(p) for p in self.paths) + 1

    @classmethod
    def chain(cls, length: int) -> TreeShape:
        return cls([(0,) * d for d in range(1, length + 1)])

    @classmethod
    def best(cls, topk_accuracy: list[list[float]], size: int) -> TreeShape:
        """The `size` paths of highest estimated acceptance probability (Medusa's sparse tree construction).

        topk_accuracy[d][r]: how often the rank-r candidate at depth d+1 is the
        target's token, measured on held-out data.  A path is accepted with the
        product of its nodes' rates (the heads treated as independent), and the
        expected accepted length of a tree is the sum of its paths' rates, so
        the best tree of a given size takes the paths with the largest products.
        Every path's prefixes have larger products, so the result is prefix-closed.
        """
        heap = [(-rate, (rank,)) for rank, rate in enumerate(topk_accuracy[0])]
        heapq.heapify(heap)
        chosen = []
        while heap and len(chosen) < size:
            neg_score, path = heapq.heappop(heap)
            chosen.append(path)   # best-first: a path is taken only after its parent, so the set stays a tree
            if len(path) < len(topk_accuracy):
                for rank, rate in enumerate(topk_accuracy[len(path)]):
                    heapq.heappush(heap, (neg_score * rate, path + (rank,)))
        return cls(chosen)

    def expected_accepted(self, topk_accuracy: list[list[float]]) -> float:
        """Expected accepted draft tokens per step under the independence model above."""
        total = 0.0
        for path in self.paths:
            total += float(torch.tensor([topk_accuracy[d][r] for d, r in enumerate(path)]).prod())
        return total


def all_paths(depth: int, width: int) -> list[tuple[int, ...]]:
    """Full tree of the given depth and branching (tests, small experiments)."""
    return [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
