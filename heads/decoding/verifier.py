"""The speculative loop (docs/design.md "Verifier"), the same for every drafter.

State between steps: the target's KV cache holds every committed token but
the newest, the root.  One step:
  1. the drafter proposes a tree under the root,
  2. the target runs ONE forward over [root, nodes...] with the tree mask,
     each node at position root + depth,
  3. an acceptance rule picks the accepted path and the target's own next
     token (the bonus),
  4. the cache keeps the root and the accepted path only; the bonus becomes
     the next root.
Each step emits len(path) + 1 tokens (tau counts exactly that).  With no
drafter the tree is empty and this is plain decoding, which is therefore
the baseline measured through the same engine.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from draftsmith.heads.contract import Proposer
from draftsmith.heads.decoding.acceptance import accept
from draftsmith.heads.decoding.sampling import next_token
from draftsmith.heads.decoding.tree import DraftTree
from draftsmith.heads.drafter import DraftContext
from draftsmith.heads.infra.device import synchronize
from draftsmith.heads.runtime.target import Target

EMPTY_TREE = DraftTree(tokens=torch.zeros(0, dtype=torch.long), parents=torch.zeros(0, dtype=torch.long))


@dataclass
class DecodeResult:
    tokens: list[int]                                # generated tokens (stop token included if produced)
    accepted: list[int] = field(default_factory=list)   # accepted draft tokens per verification step
    seconds: float = 0.0                             # wall time, prefill included
    first_token_seconds: float = 0.0                 # time to first token

    @property
    def forwards(self) -> int:
        return len(self.accepted)


@torch.no_grad()
def decode(target: Target, prompt: list[int], max_new_tokens: int, drafter: Proposer | None = None, temperature: float = 0.0,
           top_p: float = 1.0, rule: str = "auto", generator: torch.Generator | None = None,
           max_tree_size: int = 256) -> DecodeResult:
    """Generate up to max_new_tokens after `prompt` (batch 1), speculatively if a drafter is given."""
    device = target.device
    synchronize(device)          # time only this call's work (CUDA queues kernels asynchronously)
    start_time = time.perf_counter()
    layers = drafter.required_layers if drafter is not None else ()
    cache = target.new_cache(1, len(prompt) + max_new_tokens + max_tree_size + 2)
    prompt_ids = torch.tensor([prompt], device=device)
    out = target.forward_block(cache, prompt_ids, torch.arange(len(prompt), device=device)[None],
                               layer_ids=layers, logits="last")
    root = int(next_token(out.logits[0, -1], temperature, top_p, generator))     # int(): waits for the device
    result = DecodeResult(tokens=[root])
    result.first_token_seconds = time.perf_counter() - start_time
    stops = set(target.eos_token_ids)
    context = None
    if drafter is not None:
        drafter.reset()
        context = DraftContext(tokens=prompt_ids[0], hidden={i: h[0] for i, h in out.hidden_states.items()},
                               next_token=root, position=len(prompt))
    while len(result.tokens) < max_new_tokens and root not in stops:
        root_position = len(prompt) + len(result.tokens) - 1
        tree = drafter.propose(context) if drafter is not None else EMPTY_TREE
        if tree.size > max_tree_size:
            raise ValueError(f"the drafter proposed {tree.size} tokens, more than max_tree_size={max_tree_size}")
        ids = torch.cat([torch.tensor([root], device=device), tree.tokens.to(device)])[None]           # [1, n+1]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths]).to(device)
        start = cache.length
        out = target.forward_block(cache, ids, (root_position + offsets)[None], tree.attention_mask().to(device)[None],
                                   layer_ids=layers, logits="all")
        verdict = accept(tree, out.logits[0], temperature, top_p, rule, generator)
        kept_rows = [0] + [c + 1 for c in verdict.path]                        # root + accepted nodes
        if tree.size:
            cache.keep(start, torch.tensor([start + r for r in kept_rows], device=device))
        new_tokens = [int(tree.tokens[c]) for c in verdict.path] + [verdict.bonus]
        result.accepted.append(len(verdict.path))
        if drafter is not None:
            drafter.observe(verdict.path)          # drafters that count what was accepted (heads/decoding/lookup.py)
        for token in new_tokens:
            result.tokens.append(token)
            if token in stops or len(result.tokens) >= max_new_tokens:
                break
        root = result.tokens[-1]
        if drafter is not None:
            rows = torch.tensor(kept_rows, device=device)
            context = DraftContext(tokens=ids[0, rows], hidden={i: h[0, rows] for i, h in out.hidden_states.items()},
                                   next_token=verdict.bonus, position=root_position + len(kept_rows))
    synchronize(device)
    result.seconds = time.perf_counter() - start_time
    return result
