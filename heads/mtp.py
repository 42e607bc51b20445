"""MTP: the multi-token-prediction layers a target ships with (DeepSeek-V3, GLM-4.5), fine-tuned in place.

A target trained with MTP (DeepSeek-V3 section 2.2) stores, after its N decoder layers, one more block
per MTP depth, under that family's own tensor names (`MTP_NAMING`).  For DeepSeek-V3 and GLM-4-MoE
depth i is `model.layers.{N+i}.*`:

    enorm, hnorm        RMSNorms of the next token's embedding and of the hidden state
    eh_proj             [H, 2H], no bias: cat(enorm(embed), hnorm(hidden)) -> H
    (the rest)          one decoder layer of the family's own class (MLA and experts for DeepSeek-V3)
    shared_head.norm    the norm before the head
    shared_head.head, embed_tokens   copies of the target's head and embedding (shared, frozen)

Input at position t: the target's final normed hidden state h_t and the embedding of token t+1
(zeroed at position 0, as vLLM's MTP proposers do); output: shared_head.norm(block(...)), read out
by the target's head as the prediction of token t+2.  Drafting K > 1 reuses the block on its own
output (the normed state, as vLLM recycles it) and the token it drafted, as vLLM's `method: mtp`
does; decoding shares EAGLE's cache and dynamic tree (heads/eagle_decoding.py).

The block is transformers' own `MtpLayer` (transformers.modeling_layers), built from the target's
config (`get_mtp_config`) with the target's decoder layer class, and filled by transformers' own
conversions of the family's checkpoint names (fused experts and the like), so the family's layer is
the family's layer.  draftsmith reads the tensors itself, by the family's naming, from the target's
safetensors (transformers drops them when it loads the target), and checks that each one is there
and has its shape before anything loads.

Warm start is the default: before training, the drafter is the shipped MTP (tests/test_mtp.py holds
its proposals equal to transformers' own `MtpModel` on the same inputs).  Training unrolls the block
`train_steps` times on its own output with teacher-forced tokens, step s weighted decay**s (the
step-weighted loss of FastMTP, arXiv 2509.18362); only the MTP tensors train, the embedding and head
stay the target's.  Shape notation: b batch, s sequence, H hidden, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from draftsmith.heads.contract import DrafterBase
from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.draft_vocab import add_draft_vocabulary, set_draft_map
from draftsmith.heads.drafter import DraftContext, StepOutput, divide, term_denominators
from draftsmith.heads.eagle_decoding import EagleDecoding
from draftsmith.heads.formats import ExportFormat, ImportFormatError
from draftsmith.heads.mtp_layout import (MtpError, build_block, check_tensors, expected_shapes, mtp_prefix,
                                         recognizes_vllm, serve_vllm, shipped_tensors, stitch, write_vllm)
from draftsmith.heads.registry import register
from draftsmith.heads.runtime.target import Target
from draftsmith.heads.soft_loss import soft_cross_entropy


@dataclass
class MtpConfig:
    train_steps: int = 3
    """Depths trained: the block is unrolled on its own output this many times (vLLM drafts K tokens the
    same way; K above this is refused)."""
    loss_decay: float = 0.6
    """Step s's loss weight is loss_decay ** s (FastMTP's step weights)."""
    warm_start: bool = True
    """Start from the MTP tensors the target ships with (false: the same block, freshly initialized)."""
    tree: dict = field(default_factory=lambda: {"depth": 3, "top_k": 1, "total_tokens": 3})
    """Decoding: a chain of `depth` drafts by default (vLLM's `num_speculative_tokens`); top_k > 1 grows
    EAGLE-2's dynamic tree with the same block."""
    init_from: str | None = None
    """Warm start from a draftsmith checkpoint of this kind for this target instead (a previous fine-tune)."""
    draft_vocab_size: int | None = None
    """Always null: an MTP layer reads out through the target's whole head, as it was trained to."""

    def __post_init__(self):
        if self.draft_vocab_size is not None:
            raise ValueError("drafter.draft_vocab_size must be null for mtp: the shipped layer reads out through the "
                             "target's whole head")
        if not 1 <= self.train_steps <= 16:
            raise ValueError(f"drafter.train_steps must be in [1, 16], got {self.train_steps}")
        if not 0 < self.loss_decay <= 1:
            raise ValueError(f"drafter.loss_decay must be in (0, 1], got {self.loss_decay}")
        TreeSettings(**self.tree)
        if self.tree["depth"] > self.train_steps:
            raise ValueError(f"drafter.tree depth {self.tree['depth']} is deeper than the {self.train_steps} depths "
                             "trained (drafter.train_steps): raise train_steps, or draft less deep")


# -- the drafter ----------------------------------------------------------------------------------------------

@register("mtp")
class Mtp(EagleDecoding, DrafterBase):
    title = "MTP layers (the target's own, fine-tuned)"
    config_class = MtpConfig

    def __init__(self, config: MtpConfig, target: Target, tensors: dict[str, torch.Tensor] | None = None):
        """tensors: depth 0's MTP tensors in the checkpoint's names to start from (an import); None: the
        target's own when config.warm_start, else a freshly initialized block."""
        super().__init__()
        self.config = config
        self.target = target
        self.target_identity = target.identity
        prefix, _ = mtp_prefix(target)
        if tensors is None and config.warm_start:
            tensors = shipped_tensors(target)[0]
        self.metadata: dict = {"mtp_layer": target.num_layers, "mtp_prefix": prefix, "warm_start": config.warm_start}
        # fp32 master weights, whatever the target's dtype (bf16 Adam at lr 5e-5 rounds most updates away);
        # trained under autocast like every other drafter, cast to the target's dtype by eval
        self.layer = build_block(target, tensors, prefix).to(target.device, torch.float32)
        self.layer.requires_grad_(True)
        add_draft_vocabulary(self, target.vocab_size, target.vocab_size)
        self.tree = TreeSettings(**config.tree)

    @staticmethod
    def parameter_layout(config: dict) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every saved tensor, from a checkpoint's config.json alone."""
        return {"draft_to_target": (config["target"]["vocab_size"],),
                **{name: tuple(shape) for name, shape in config["architecture"]["tensors"].items()}}

    def architecture(self) -> dict:
        """The block's tensors (the family's layer, as transformers holds it), so that a checkpoint's layout
        is known without the target."""
        return {"tensors": {f"layer.{k}": list(v.shape) for k, v in self.layer.state_dict().items()},
                "model_type": getattr(self.target.config, "model_type", "?"), **self.metadata}

    @property
    def required_layers(self) -> tuple[int, ...]:
        return (self.target.num_layers,)

    @property
    def draft_positions(self) -> int:
        return self.config.train_steps

    @property
    def max_proposal_depth(self) -> int:
        """The deepest proposal it makes: the depths trained (eval's tree tuning reads it)."""
        return self.config.train_steps

    def set_proposal(self, chain: int | None = None, tree_size: int | None = None, tree: TreeSettings | None = None):
        """EAGLE's chain or dynamic tree, no deeper than the depths trained."""
        depth = chain if chain is not None else (tree.depth if tree is not None else self.config.tree["depth"])
        if depth > self.config.train_steps:
            raise MtpError(f"a proposal {depth} deep from an MTP layer trained for {self.config.train_steps} depths "
                           "(drafter.train_steps): draft at most that deep, or fine-tune with a larger train_steps")
        super().set_proposal(chain, tree_size, tree)

    def set_draft_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        if draft_to_target.numel() != self.target.vocab_size:
            raise MtpError("an MTP layer reads out through the target's whole head: draft_vocab_size must be null")
        set_draft_map(self, draft_to_target)

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """The block's normed output [..., H] -> [..., V] through the target's head."""
        return self.target.compute_logits(state)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeds = self.target.embed_tokens(tokens).to(self.layer.eh_proj.weight.dtype)
        return torch.where((positions == 0)[..., None], torch.zeros_like(embeds), embeds)

    def _block(self, state, tokens, positions, attention_mask, **kwargs) -> torch.Tensor:
        embeds = self._embed(tokens, positions)
        rotary = getattr(self.target.decoder, "rotary_emb", None)
        position_embeddings = None
        if rotary is not None:       # a spread target's rotary may sit on another device than this layer
            position_embeddings = tuple(t.to(embeds.device) for t in rotary(embeds, position_ids=positions))
        return self.layer(embeds, state.to(embeds.dtype), position_embeddings=position_embeddings,
                          attention_mask=attention_mask, position_ids=positions, cache=None, **kwargs)

    def _step(self, state, tokens, positions, cache) -> torch.Tensor:
        """Decoding: (state [1, n, H], token [1, n]) pairs at positions [1, n] through the engine's cache."""
        from draftsmith.heads.runtime import engine
        b, n = tokens.shape
        dummy = torch.ones(b, 1, n, 1, dtype=torch.bool, device=tokens.device)      # the cache builds the mask
        return self._block(state, tokens, positions, dummy, **{engine.CACHE_KWARG: cache})

    def _context_hidden(self, context: DraftContext) -> torch.Tensor:
        return context.hidden[self.target.num_layers]

    def forward(self, batch: dict) -> StepOutput:
        return self.loss(batch)

    def _scored(self, batch: dict, step: int) -> torch.Tensor:
        """Positions t whose step-`step` prediction (token t+2+step) is a reply token."""
        return F.pad(batch["loss_mask"][:, 2 + step:], (0, 2 + step)).bool() & batch["attention_mask"].bool()

    def loss_counts(self, batch: dict) -> torch.Tensor:
        return torch.stack([self._scored(batch, s).sum().float() for s in range(self.config.train_steps)])

    def loss(self, batch: dict) -> StepOutput:
        """Soft cross-entropy against the target's distribution at each unrolled depth, weighted decay**s.

        Step s at position t reads token t+1+s (teacher-forced) and the previous step's output at t (the
        target's h_t at step 0), at position t+s, and predicts token t+2+s; its target is the target's
        next-token distribution at position t+1+s.  Each step attends causally over its own row."""
        features = batch["features"][self.target.num_layers]                             # [b, s, H], normed
        input_ids, attention = batch["input_ids"], batch["attention_mask"].bool()
        b, s = input_ids.shape
        causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
        mask = (causal[None] & attention[:, None, :])[:, None]                           # [b, 1, s, s]
        counts = self.loss_counts(batch)
        denominators = term_denominators(batch, counts)
        state = features
        total, correct, counted = 0.0, [], []
        for step in range(self.config.train_steps):
            tokens = F.pad(input_ids[:, 1 + step:], (0, 1 + step))                       # token t+1+s at t
            positions = (torch.arange(s, device=input_ids.device) + step)[None].expand(b, s)
            state = self._block(state, tokens, positions, mask)
            scored = self._scored(batch, step)
            counted.append(scored.sum().float())
            scored = scored.nonzero(as_tuple=True)      # one host wait per depth (docs/scale.md)
            wanted = F.pad(features[:, 1 + step:], (0, 0, 0, 1 + step))[scored]          # h_{t+1+s}
            with torch.no_grad():
                target_probs = torch.softmax(self.target.compute_logits(wanted).float(), dim=-1)
            per_position, guess = soft_cross_entropy(self.logits(state[scored]), target_probs)
            total = total + self.config.loss_decay ** step * divide(per_position.sum(), denominators[step])
            correct.append((guess == target_probs.argmax(-1)).sum().float())
        return StepOutput(loss=total, correct=torch.stack(correct), counted=torch.stack(counted))


# -- serving: vLLM's `method: mtp` (heads/mtp_layout.py writes it) ---------------------------------------------

def read_vllm(export_config: dict, weights: dict, target: Target, confirmed: bool = False):
    """An export (or any checkpoint in the family's naming, the target's own included) back as a drafter:
    the MTP tensors checked by name and shape against the target, then loaded as the warm start is."""
    if export_config.get("model_type") != getattr(target.config, "model_type", None) or \
            export_config.get("num_hidden_layers") != target.num_layers:
        raise ImportFormatError(f"the export holds the MTP layer of a {export_config.get('model_type')} model with "
                                f"{export_config.get('num_hidden_layers')} layers; the target is "
                                f"{getattr(target.config, 'model_type', '?')} with {target.num_layers}")
    _, depths = mtp_prefix(target)
    shapes = expected_shapes(target)
    try:
        check_tensors(shapes, {k: tuple(v.shape) for k, v in weights.items()}, lambda name: "the export", depths)
    except MtpError as err:
        raise ImportFormatError(str(err)) from None
    return Mtp(MtpConfig(), target, tensors={k: weights[k] for k in shapes})


Mtp.formats = (
    ExportFormat("vllm", write_vllm, serve_vllm, read=read_vllm, recognizes=recognizes_vllm,
                 needs_target=lambda config: True, method="mtp", stitch=stitch),
)
