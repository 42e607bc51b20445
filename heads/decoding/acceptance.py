"""Acceptance rules: which drafted tokens the target keeps, and the token it adds.

Each rule walks the draft tree from the root.  Row 0 of `logits` is the
target's prediction after the root; row c+1 its prediction after node c.  At
each node the children are tried in index order; the walk stops at the first
node none of whose children is accepted, and the target then supplies one
token of its own (the "bonus"), so every verification step emits accepted+1.

- greedy: accept a child iff it is the target's argmax.  Output = plain
  greedy decoding, token for token.
- rejection sampling (lossless, Leviathan et al. 2023 / Chen et al. 2023):
  the emitted token is distributed exactly as the target's p at every step.
    * a child drawn from the drafter's q (chains with `draft_probs`):
      accept x with prob min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0)).
    * a child chosen deterministically (top-k trees, Medusa): q is a point
      mass, so accept x with prob p(x); on rejection p <- norm(p with p(x) = 0)
      and try the next sibling (SpecInfer-style recursive rejection).  The
      emitted token is then x with prob p(x), else drawn from the rest: exactly p.
    * no child accepted: sample the bonus from what is left of p.
- typical acceptance (Medusa, opt-in, NOT lossless): accept the child if
  p(x) > min(epsilon, delta * exp(-H(p))); the bonus is the argmax.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from draftsmith.heads.decoding.sampling import probabilities, sample
from draftsmith.heads.decoding.tree import DraftTree


@dataclass
class Verdict:
    path: list[int]     # accepted node indices, root to leaf
    bonus: int          # the target's own next token after the path


def _children(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        kids.setdefault(parent, []).append(node)
    return kids


def greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Accept while the draft equals the target's argmax.  logits: [n+1, v]."""
    best = logits.argmax(-1).tolist()                    # target's choice after root, after each node
    tokens = tree.tokens.tolist()
    kids = _children(tree.parents.tolist())
    path, node = [], -1
    while True:
        want = best[node + 1]
        match = next((c for c in kids.get(node, []) if tokens[c] == want), None)
        if match is None:
            return Verdict(path, want)
        path.append(match)
        node = match


def rejection_sampling(tree: DraftTree, logits: torch.Tensor, temperature: float, top_p: float,
                       generator: torch.Generator | None = None) -> Verdict:
    """Lossless speculative sampling over a chain or tree.  logits: [n+1, v]."""
    tokens = tree.tokens.tolist()
    kids = _children(tree.parents.tolist())
    path, node = [], -1
    while True:
        p = probabilities(logits[node + 1], temperature, top_p)            # [v] the target's distribution here
        accepted = None
        for child in kids.get(node, []):
            x = tokens[child]
            u = torch.rand((), generator=generator, device=p.device).item()
            if tree.draft_probs is not None:
                q = tree.draft_probs[child].to(p)
                if q[x] > 0 and u < min(1.0, (p[x] / q[x]).item()):      # q >= p: accept with p/q; q < p: always
                    accepted = child
                    break
                residual = torch.clamp(p - q, min=0.0)                    # rejected: what p has beyond q
            else:
                if u < p[x].item():                                       # point mass at x: accept with p(x)
                    accepted = child
                    break
                residual = p.clone()
                residual[x] = 0.0                                         # rejected: p without x
            total = residual.sum()
            if total <= 0:            # only if p has no mass left beyond the drafts (numerically): keep p
                continue
            p = residual / total
        if accepted is None:
            return Verdict(path, int(sample(p, generator)))
        path.append(accepted)
        node = accepted


def typical(tree: DraftTree, logits: torch.Tensor, temperature: float, epsilon: float = 0.09,
            delta: float = 0.3) -> Verdict:
    """Medusa's typical acceptance (not lossless): p(x) > min(epsilon, delta * exp(-H(p)))."""
    tokens = tree.tokens.tolist()
    kids = _children(tree.parents.tolist())
    probs = probabilities(logits, max(temperature, 1e-5))                 # [n+1, v]
    entropy = -(probs * torch.log(probs.clamp(min=1e-20))).sum(-1)        # [n+1]
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    path, node = [], -1
    while True:
        row = node + 1
        ok = [c for c in kids.get(node, []) if probs[row, tokens[c]] > threshold[row]]
        if not ok:
            return Verdict(path, int(logits[row].argmax()))
        node = max(ok, key=lambda c: probs[row, tokens[c]].item())
        path.append(node)


def accept(tree: DraftTree, logits: torch.Tensor, temperature: float, top_p: float = 1.0, rule: str = "auto",
           generator: torch.Generator | None = None) -> Verdict:
    """rule: auto (greedy at temperature 0, else rejection sampling), greedy, sampling, typical."""
    if rule == "typical":
        return typical(tree, logits, temperature)
    if rule == "greedy" or (rule == "auto" and temperature <= 0):
        return greedy(tree, logits)
    if temperature <= 0 or math.isnan(temperature):
        raise ValueError(f"rejection sampling needs temperature > 0, got {temperature}")
    return rejection_sampling(tree, logits, temperature, top_p, generator)
