"""P-EAGLE: an EAGLE-3 drafter that proposes all K tokens in one drafter forward.

The layer, the fused target features, the draft vocabulary and the tensor
names are EAGLE-3's (heads/eagle3.py).  What it adds is one learned tensor,
`mask_hidden` [1, 3T] (the fused layers' width, vLLM's `fc_input_size`), and a
mask token id.  After the target's forward the drafter reads the committed
(feature_t, token_t+1) pairs as EAGLE-3 does, followed in the same forward by
K-1 mask slots: input fc(mask_hidden) and the mask token's embedding, at
positions last+1 .. last+K-1, causal.  The output at the last real pair is
draft 1; the output at mask slot j is draft j+1.  This is what vLLM runs for
`method: eagle3` with `parallel_drafting: true` (v1/spec_decode/llm_base_proposer.py:
the mask slots get fc(mask_hidden) and the parallel-drafting token id).

Training is EAGLE-3's training-time-test unroll with the drafter's own
outputs replaced by the mask: step s (1 <= s < K) at column t is mask slot s
of anchor t, at position t+s, seeing the real pairs up to t and the mask
slots 1..s of its own anchor (exactly the TTT mask), and predicting token
t+2+s.  Every position is an anchor, so one step costs what an EAGLE-3 TTT
step costs; step s's loss weighs loss_decay**s.

Decoding: a chain of up to K drafts, or a tree where the chain's node at
each depth has the alternatives ranked 2..top_k at the next depth as leaves
(the K positions are drafted independently, so no deeper node can condition
on an alternative).  Warm start: an EAGLE-3 checkpoint for the same target
(drafter.init_from), whose weights are all P-EAGLE's but mask_hidden.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.parallel import clamp_depth, parallel_tree, resolve_mask_token
from draftsmith.heads.drafter import DraftContext
from draftsmith.heads.eagle3 import Eagle3, Eagle3Config, read_eagle3
from draftsmith.heads.eagle3_layout import norm_flags, read_norm_flags
from draftsmith.heads.eagle3_layout import is_parallel
from draftsmith.heads.eagle3_layout import layout_tensors as eagle3_tensors
from draftsmith.heads.eagle3_layout import (llama_eagle3_config, llama_fields, recognizes, speculators_layer_ids,
                                            speculators_config)
from draftsmith.heads.formats import ExportError, ExportFormat, ImportFormatError, readme
from draftsmith.heads.registry import register
from draftsmith.heads.runtime.target import Target

MASK = "mask_hidden"
log = logging.getLogger(__name__)


@dataclass
class PEagleConfig(Eagle3Config):
    ttt_steps: int = 4
    """K: tokens drafted in one forward (the last real position and K-1 mask slots), trained together."""
    mask_token_id: int | None = None
    """The token id the mask slots read (vLLM's mask/ptd token); default: the tokenizer's mask token,
    else its pad token when that is not end-of-text, else the last id of the vocabulary."""
    tree: dict = field(default_factory=lambda: {"depth": 4, "top_k": 1, "total_tokens": 4})
    """Decoding: depth (at most ttt_steps), top_k (alternatives per depth; 1 = a chain), total_tokens."""

    def __post_init__(self):
        super().__post_init__()
        if self.norm_output:
            raise ValueError("drafter.norm_output: P-EAGLE drafts every position in one forward, so no step reads "
                             "another's output and the flag changes nothing (speculators' P-EAGLE ignores it too); "
                             "set it false. norm_before_fc, fc_norm and norm_before_residual apply")
        if self.ttt_steps < 2:
            raise ValueError(f"drafter.ttt_steps is P-EAGLE's K, the tokens drafted in one forward: at least 2, "
                             f"got {self.ttt_steps}")
        if self.tree["depth"] > self.ttt_steps:
            raise ValueError(f"drafter.tree.depth {self.tree['depth']} is more than the {self.ttt_steps} tokens "
                             "P-EAGLE drafts in one forward (drafter.ttt_steps): lower it or train a larger K")


@register("p_eagle")
class PEagle(Eagle3):
    title = "P-EAGLE drafter (parallel EAGLE-3)"
    config_class = PEagleConfig
    warm_starts_from = ("eagle3",)          # an EAGLE-3 checkpoint has every tensor but these
    new_on_warm_start = (MASK,)
    one_forward = True             # every depth of a proposal comes from one drafter forward

    def __init__(self, config: PEagleConfig, target: Target):
        super().__init__(config, target)
        self.mask_token_id = resolve_mask_token(target, config.mask_token_id)
        self.mask_hidden = nn.Parameter(torch.randn(1, 3 * target.hidden_size) * 0.02)

    @staticmethod
    def parameter_layout(config: dict) -> dict[str, tuple[int, ...]]:
        return {**Eagle3.parameter_layout(config), MASK: (1, 3 * config["target"]["hidden_size"])}

    def architecture(self) -> dict:
        return {**super().architecture(), "mask_token_id": self.mask_token_id}

    def mask_state(self) -> torch.Tensor:
        """fc(mask_hidden): [1, H], the hidden input of every mask slot, through the same feature norms as the
        target's fused features (speculators normalises the mask slots' input as the real one's)."""
        return self.project(list(self.mask_hidden.chunk(len(self.layer_ids), dim=-1)))

    # -- training ----------------------------------------------------------------------
    def unroll(self, batch: dict):
        """Step 0: EAGLE-3's first step.  Step s >= 1: mask slot s of every anchor t (position t+s)."""
        input_ids, attention = batch["input_ids"], batch["attention_mask"].bool()
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        mask_hidden = self.mask_state().expand(b, s, -1)
        mask_embeds = self.embed(input_ids.new_full((b, s), self.mask_token_id))
        past: list = []
        for step in range(self.config.ttt_steps):
            if step == 0:
                hidden = self.fuse(batch["features"])
                embeds = self.embed(F.pad(input_ids[:, 1:], (0, 1)))
            else:
                hidden, embeds = mask_hidden, mask_embeds
            cos, sin = self.rotary(hidden, positions + step)
            yield self.midlayer.ttt(hidden, embeds, cos, sin, past, attention,
                                    checkpointed=self.gradient_checkpointing and self.training)

    # -- decoding ----------------------------------------------------------------------
    def set_proposal(self, chain: int | None = None, tree_size: int | None = None, tree: TreeSettings | None = None):
        super().set_proposal(chain=chain, tree_size=tree_size, tree=tree)
        self.tree = clamp_depth(self.tree, self.config.ttt_steps)      # one forward drafts K tokens, never more

    def describe_proposal(self) -> str:
        if self.tree.top_k == 1:
            return f"parallel chain of {self.tree.depth} (one drafter forward)"
        return (f"parallel tree ({self.tree.total_tokens} nodes, depth {self.tree.depth}, "
                f"top-{self.tree.top_k} per depth, one drafter forward)")

    def draft_logits(self, context: DraftContext) -> torch.Tensor:
        """One forward over the new real pairs and depth-1 mask slots -> logits [depth, v] for drafts
        1..depth; the mask slots leave the cache afterwards."""
        hidden = self._context_hidden(context)                                           # [m, H]
        following = torch.cat([context.tokens[1:], context.tokens.new_tensor([context.next_token])])
        m, masks = hidden.shape[0], self.tree.depth - 1
        hidden = torch.cat([hidden, self.mask_state().to(hidden.dtype).expand(masks, -1)])
        tokens = torch.cat([following.to(hidden.device),
                            following.new_full((masks,), self.mask_token_id).to(hidden.device)])
        positions = torch.arange(context.position - m, context.position + masks, device=hidden.device)
        out = self._feed(hidden, tokens, positions)                                      # causal
        self.cache.truncate(self.cache.length - masks)
        return self.logits(out[m - 1:])

    @torch.no_grad()
    def propose(self, context: DraftContext):
        logprobs = torch.log_softmax(self.draft_logits(context).float(), dim=-1)
        return parallel_tree(logprobs, self.tree, self.draft_to_target)


# -- serving formats: EAGLE-3's Llama layout plus mask_hidden and the mask token -----------------------

def _tensors(config, weights, dtype, fmt):
    if MASK not in weights:
        raise ExportError(f"this drafter has no {MASK}: it was not trained for parallel drafting, and vLLM's "
                          "parallel_drafting refuses it; train a p_eagle drafter (drafter.init_from= this "
                          "EAGLE-3 checkpoint) or export it as EAGLE-3")
    out = eagle3_tensors(config, weights, dtype, fmt)
    # vLLM views mask_hidden as [1, 3T]; speculators' PEagleDraftModel holds [1, 1, 3T] and refuses another shape
    shape = (1, 1, -1) if fmt == "speculators" else (1, -1)
    out[MASK] = weights[MASK].to(dtype).reshape(*shape)
    return out


def _write_vllm(config, weights, target, dtype, checkpoint):
    ids = config["target_layer_ids"][:3]
    mask = config["architecture"]["mask_token_id"]
    # LlamaForCausalLMEagle3, not PEagleDraftModel: vLLM's EAGLEConfig prefixes "Eagle3" to an architecture
    # that neither starts nor ends with it, and "Eagle3PEagleDraftModel" is not in its registry.
    cfg = {**llama_eagle3_config(config, dtype, ids), "eagle_aux_hidden_state_layer_ids": ids, **norm_flags(config),
           "parallel_drafting": True, "mask_token_id": mask, "ptd_token_id": mask,
           "parallel_drafting_tokens": config["drafter"]["ttt_steps"]}
    notes = (f"P-EAGLE: K = {config['drafter']['ttt_steps']} tokens in one drafter forward, mask token {mask} and "
             f"`{MASK}` [1, {3 * config['target']['hidden_size']}] (the fused layers' width). vLLM serves it as "
             "`method: eagle3` with `parallel_drafting: true`; without that flag it skips mask_hidden and drafts "
             "sequentially, which this drafter was not trained for.")
    return ({"model.safetensors": _tensors(config, weights, dtype, "vllm")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "P-EAGLE drafter for vLLM",
                                                       _serve(config, "vllm"), notes)})


def _write_speculators(config, weights, target, dtype, checkpoint):
    ids, repeated = speculators_layer_ids(config)
    layer = llama_fields(config, dtype)
    K = config["drafter"]["ttt_steps"]
    cfg = {"architectures": ["PEagleDraftModel"], "speculators_model_type": "peagle", "speculators_version": "0.2.0",
           "speculators_config": speculators_config(config, "peagle", K),
           "transformer_layer_config": layer, "draft_vocab_size": layer["draft_vocab_size"],
           "target_hidden_size": layer["target_hidden_size"], **norm_flags(config),
           "eagle_aux_hidden_state_layer_ids": ids,
           "mask_token_id": config["architecture"]["mask_token_id"], "torch_dtype": layer["torch_dtype"]}
    notes = "vLLM maps speculators' `peagle` to `method: eagle3` with `parallel_drafting: true`. " + repeated
    return ({"model.safetensors": _tensors(config, weights, dtype, "speculators")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "P-EAGLE drafter (speculators format)",
                                                       _serve(config, "speculators"), notes)})


def _serve(config: dict, fmt: str) -> str:
    K = min(config["drafter"]["tree"]["depth"], config["drafter"]["ttt_steps"])
    if fmt == "vllm":
        return (f"""vllm serve TARGET_DIR --speculative-config '{{"method": "eagle3", "model": "THIS_DIR", """
                f""""num_speculative_tokens": {K}, "parallel_drafting": true}}'""")
    return "vllm serve THIS_DIR   # vLLM reads the verifier and the speculative settings from this config"


def _reads(fmt: str):
    def read(config, weights, target, confirmed=False):
        if MASK not in weights:
            raise ImportFormatError(f"the export has no {MASK}: it is an EAGLE-3 drafter, not P-EAGLE (--from-kind "
                                    "eagle3, or import it as EAGLE-3)")
        norms = read_norm_flags(config)
        if norms.pop("norm_output"):
            log.warning("this P-EAGLE export sets norm_output: true, which changes nothing in a drafter that drafts "
                        "every position in one forward (no step reads another's output; speculators' P-EAGLE "
                        "ignores it too): imported with norm_output false")
        base = read_eagle3(config, {k: v for k, v in weights.items() if k != MASK}, target, fmt, confirmed)
        mask = config.get("mask_token_id", config.get("ptd_token_id"))
        K = int(config.get("speculators_config", {}).get("proposal_methods", [{}])[0].get("speculative_tokens", 4)
                if fmt == "speculators" else config.get("parallel_drafting_tokens", 4))
        drafter = PEagle(PEagleConfig(layer_ids=base.layer_ids, draft_vocab_size=base.draft_to_target.numel(), **norms,
                                      intermediate_size=base.shape.intermediate_size, ttt_steps=max(2, K),
                                      mask_token_id=None if mask is None else int(mask),
                                      tree={"depth": max(2, K), "top_k": 1, "total_tokens": max(2, K)}), target)
        state = base.state_dict()
        state[MASK] = weights[MASK].float().reshape(1, -1)
        if state[MASK].shape != drafter.mask_hidden.shape:
            raise ImportFormatError(f"{MASK} is {tuple(weights[MASK].shape)}, this target's fused width needs "
                                    f"{tuple(drafter.mask_hidden.shape)}")
        drafter.load_state_dict(state, strict=True)
        return drafter
    return read


def _recognizes(config: dict) -> bool:
    return recognizes(config) and is_parallel(config)


PEagle.formats = (
    ExportFormat("vllm", _write_vllm, lambda c: _serve(c, "vllm"), read=_reads("vllm"), recognizes=_recognizes,
                 method="eagle3", parallel_drafting=True),
    ExportFormat("speculators", _write_speculators, lambda c: _serve(c, "speculators"), read=_reads("speculators"),
                 rules=((r"^midlayer\.", "layers.0."),), recognizes=_recognizes),
)
