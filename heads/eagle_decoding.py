"""Decoding for the EAGLE drafters (EAGLE-1 and EAGLE-3): the drafter's own cache and the dynamic tree.

The drafter keeps a KV cache of (feature_j, token_{j+1}) pairs for the real
context.  After each verification the newly committed tokens are fed in one
block (causal); the output at the last pair is the root, whose logits give
depth 1 of the tree.  Deeper nodes are fed as (parent's output, node token)
at position root + depth - 1 and see the context and their ancestors only;
they are dropped from the cache once the tree is built, so the cache never
holds drafted tokens between steps.

A drafter using this supplies `_step(hidden, tokens, positions, block_mask,
prefix_mask) -> outputs`, `_context_hidden(context) -> [m, H]`, `logits(out)`,
`draft_to_target`, `tree` and `config.tree`.
"""
from __future__ import annotations

import torch

from draftsmith.heads.decoding.dynamic_tree import TreeSettings, grow
from draftsmith.heads.drafter import DraftContext
from draftsmith.heads.runtime.engine import EngineCache


class EagleDecoding:
    cache: EngineCache | None = None
    dynamic_tree = True           # decodes EAGLE-2's dynamic tree (config.tree), tuned by eval

    def set_proposal(self, chain: int | None = None, tree_size: int | None = None, tree: TreeSettings | None = None):
        """A chain of `chain` drafts, or the dynamic tree (total_tokens = tree_size if given)."""
        if chain is not None:
            self.tree = TreeSettings.chain(chain or self.config.tree.get("depth", 5))
        elif tree is not None:
            self.tree = tree
        else:
            defaults = dict(self.config.tree)
            if tree_size:
                defaults["total_tokens"] = tree_size
            self.tree = TreeSettings(**defaults)

    def describe_proposal(self) -> str:
        if self.tree.top_k == 1:
            return f"chain of {self.tree.depth}"
        return f"dynamic tree ({self.tree.total_tokens} nodes, depth {self.tree.depth}, top-{self.tree.top_k})"

    def reset(self) -> None:
        self.cache = EngineCache(1, 512, 1, device=self.draft_to_target.device)

    def _feed(self, hidden, tokens, positions, block_mask=None, prefix_mask=None) -> torch.Tensor:
        """Feed n (hidden [n, H], token [n]) pairs at positions [n] into the cache -> outputs [n, H]."""
        n = hidden.shape[0]
        self.cache.ensure_capacity(self.cache.length + n)
        self.cache.begin_block(positions[None], None if block_mask is None else block_mask[None], None,
                               None if prefix_mask is None else prefix_mask[None])
        out = self._step(hidden[None], tokens[None], positions[None], self.cache)
        self.cache.end_block()
        return out[0]

    @torch.no_grad()
    def propose(self, context: DraftContext):
        hidden = self._context_hidden(context)                                           # [m, H]
        following = torch.cat([context.tokens[1:], context.tokens.new_tensor([context.next_token])])
        m = hidden.shape[0]
        positions = torch.arange(context.position - m, context.position, device=hidden.device)
        out = self._feed(hidden, following, positions)                                  # causal
        real = self.cache.length
        root = out[-1]
        root_logprobs = torch.log_softmax(self.logits(root).float(), dim=-1)

        def step(node_hidden, draft_tokens, depths, visible):
            prefix = torch.ones(len(draft_tokens), self.cache.length, dtype=torch.bool, device=hidden.device)
            prefix[:, real:] = visible
            diagonal = torch.eye(len(draft_tokens), dtype=torch.bool, device=hidden.device)
            fed = self._feed(node_hidden, self.draft_to_target[draft_tokens], context.position + depths - 1,
                             diagonal, prefix)
            return fed, torch.log_softmax(self.logits(fed).float(), dim=-1)

        tree = grow(step, root, root_logprobs, self.tree, real, self.draft_to_target)
        self.cache.truncate(real)
        return tree
