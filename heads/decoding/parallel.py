"""What the parallel drafters (P-EAGLE, DFlash) share: the mask token their later slots read, and the tree of
K positions drafted independently in one forward.

No deeper node can condition on an alternative at an earlier depth, so the tree is the chain of the K
argmaxes with, at each depth, the next top_k-1 candidates as leaves under the chain's previous node.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.tree import DraftTree


def parallel_tree(logprobs: torch.Tensor, settings: TreeSettings, draft_to_target: torch.Tensor) -> DraftTree:
    """logprobs [K, v] of K independently drafted positions -> the chain of their argmaxes with, at each
    depth, the next top_k-1 candidates as leaves under the chain's previous node; the best total_tokens
    nodes by cumulative log-probability (a chain node always outranks the alternatives below it)."""
    K = logprobs.shape[0]
    k = min(settings.top_k, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1)                                                     # [K, k]
    before = F.pad(top.values[:, 0].cumsum(0), (1, 0))[:K]                             # chain score up to d-1
    scores = (before[:, None] + top.values).flatten()                                  # [K * k], (depth, rank)
    order = sorted(range(K * k), key=lambda i: (-float(scores[i]), i // k, i % k))
    kept = sorted(order[: settings.total_tokens])
    index = {node: n for n, node in enumerate(kept)}
    parents = [-1 if node // k == 0 else index[(node // k - 1) * k] for node in kept]
    tokens = top.indices.flatten()[torch.tensor(kept)]
    return DraftTree(tokens=draft_to_target[tokens].cpu(), parents=torch.tensor(parents, dtype=torch.long))


def resolve_mask_token(target, wanted: int | None) -> int:
    """The mask token id for `target` (heads.runtime.target.Target), checked against its vocabulary."""
    if wanted is None:
        tok = target.tokenizer
        pad = getattr(tok, "pad_token_id", None)
        for candidate in (getattr(tok, "mask_token_id", None),
                          pad if pad is not None and pad not in target.eos_token_ids else None):
            if candidate is not None:
                wanted = int(candidate)
                break
        else:
            wanted = target.vocab_size - 1
    if not 0 <= int(wanted) < target.vocab_size:
        raise ValueError(f"drafter.mask_token_id {wanted} is outside the target's vocabulary [0, "
                         f"{target.vocab_size - 1}]: give a token id the target's embedding has")
    return int(wanted)


def clamp_depth(settings: TreeSettings, K: int) -> TreeSettings:
    """A proposal no deeper than the K positions one forward drafts (the nodes kept within K * top_k)."""
    if settings.depth <= K:
        return settings
    return TreeSettings(depth=K, top_k=settings.top_k, total_tokens=min(settings.total_tokens, K * settings.top_k))
