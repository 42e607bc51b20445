"""Context lookup: draft tokens copied from the text so far, merged into a drafter's tree.

Prompt-lookup decoding (Saxena 2023; vLLM's and SGLang's `ngram`) needs no
training: find the latest earlier place where the last n tokens (root
included) occurred, and propose the tokens that followed it there.  It wins
where the reply repeats its prompt or itself (code edits, extraction, lists)
and proposes nothing elsewhere.

`WithLookup` wraps any drafter: each step the drafter's tree and the lookup
chain are merged as a trie under the root (a chain token that equals a node
of the tree at the same place reuses that node), so one target forward
verifies both, and the walk of the acceptance rule takes whichever agrees
with the target.  Every node is a deterministic proposal, so greedy output
stays plain greedy output and rejection sampling stays lossless (each
sibling is tried with the point-mass rule, heads/decoding/acceptance.py).  A drafter
that samples its chain (it returns `draft_probs`) is left unmerged: its
acceptance test needs the distribution each node was drawn from.
"""
from __future__ import annotations

import torch

from draftsmith.heads.decoding.tree import DraftTree
from draftsmith.heads.drafter import DraftContext


def lookup(history: list[int], length: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `length` tokens that followed the latest earlier occurrence of the history's last n tokens,
    for the largest n in [min_ngram, max_ngram] that occurs; [] when none does."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        key = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == key:
                return history[start + n:start + n + length]
    return []


def merge_chain(tree: DraftTree, chain: list[int]) -> tuple[DraftTree, int]:
    """The tree with `chain` hung under the root as a trie branch; returns it and the number of nodes added."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    index = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    parent, added = -1, 0
    for token in chain:
        node = index.get((parent, token))
        if node is None:
            tokens.append(token)
            parents.append(parent)
            node = index[(parent, token)] = len(tokens) - 1
            added += 1
        parent = node
    if not added:
        return tree, 0
    return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long)), added


class WithLookup:
    """A drafter whose every proposal also carries the context-lookup chain (see the module docstring)."""

    def __init__(self, drafter, length: int, max_ngram: int = 3):
        if length < 1 or max_ngram < 1:
            raise ValueError(f"context lookup needs length >= 1 and max_ngram >= 1, got {length}, {max_ngram}")
        self.drafter, self.length, self.max_ngram = drafter, length, max_ngram
        self.history: list[int] = []
        # accepted draft tokens by who proposed them ("drafter" also when both did)
        self.accepted = {"drafter": 0, "lookup": 0}
        self._own = 0                   # nodes of the drafter's own last tree: they come first in the merged one

    def __getattr__(self, name):        # everything else (required_layers, kind, metadata, ...) is the drafter's
        if name == "drafter":           # not set yet (a copy in the making): no recursion
            raise AttributeError(name)
        return getattr(self.drafter, name)

    def clear_counts(self) -> None:
        self.accepted = {"drafter": 0, "lookup": 0}

    def describe_proposal(self) -> str:
        return f"{self.drafter.describe_proposal()} + context lookup of {self.length} (n-grams up to {self.max_ngram})"

    def reset(self) -> None:
        self.drafter.reset()
        self.history = []

    def observe(self, path: list[int]) -> None:
        """The verifier's report of the nodes it accepted: the drafter's come first in a merged tree."""
        for node in path:
            self.accepted["drafter" if node < self._own else "lookup"] += 1

    def propose(self, context: DraftContext) -> DraftTree:
        self.history.extend(context.tokens.tolist())
        tree = self.drafter.propose(context)
        self._own = tree.size
        if tree.draft_probs is not None:
            return tree
        merged, _ = merge_chain(tree, lookup(self.history + [context.next_token], self.length, self.max_ngram))
        return merged
