"""EAGLE-3 (arXiv 2503.01840): fused target features, training-time test, a draft vocabulary.

Input at position t: fc(cat(g2_t, gm_t, gh_t)), three target layers (docs/design.md
ids; default 2, N//2, N-3), 3T -> H without bias, and the embedding of token
t+1 (the target's, frozen).  One draft layer (heads/eagle_layer.py), then the
drafter's own final `norm` and `lm_head` over the draft vocabulary.  It
predicts token t+2, trained against the target's distribution at position
t+1 restricted to the draft vocabulary (soft cross-entropy).

Training-time test: the step is unrolled `ttt_steps` times; at step s the
hidden input is the drafter's own previous output (before its final norm)
and the tokens and targets shift by s, so the drafter learns from its own
mistakes the way it drafts; step s's loss weighs decay**s.

Names follow vLLM's `LlamaForCausalLMEagle3` (fc, midlayer.*, norm, lm_head)
so export is a rename of nothing.  Shape notation: b batch, s sequence, H
drafter hidden, T target hidden, v draft vocabulary, m scored positions.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.contract import DrafterBase
from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.draft_vocab import add_draft_vocabulary, set_draft_map
from draftsmith.heads.drafter import DraftContext, StepOutput, divide, term_denominators
from draftsmith.heads.eagle3_layout import (CARRIED, NORM_OPTIONS, convention_ids, default_layer_ids, feature_norms,
                                            is_parallel, layout_tensors, llama_eagle3_config, llama_fields, norm_flags,
                                            read_norm_flags, recognizes, refuse_unknown_flags, speculators_layer_ids,
                                            speculators_config)
from draftsmith.heads.eagle_decoding import EagleDecoding
from draftsmith.heads.eagle_layer import DraftLayer, RMSNorm, Rotary, layer_layout, layer_shape_from_target
from draftsmith.heads.formats import ExportError, ExportFormat, ImportFormatError, fill, output_convention, readme
from draftsmith.heads.registry import register
from draftsmith.heads.runtime.target import Target
from draftsmith.heads.soft_loss import LOSSES, acceptance_loss


@dataclass
class TargetDistribution:
    """The target's next-token distribution where the loss needs it: one row per position j of the
    batch whose next token (j+1) is a reply token, in row-major order."""

    rows: torch.Tensor        # [m] the batch row of position j
    positions: torch.Tensor   # [m] j
    probs: torch.Tensor       # [m, v] over the draft vocabulary
    top: torch.Tensor         # [m] argmax of probs (a draft-vocabulary index)
    in_vocab: torch.Tensor    # [m] the target's argmax over its whole vocabulary is a draft-vocabulary token


@dataclass
class Eagle3Config:
    layer_ids: list[int] | None = None
    """Fused target layers (hidden_states ids); default [2, N//2, N-3]."""
    ttt_steps: int = 7
    """Unrolled training-time-test steps."""
    loss_decay: float = 0.8
    """Step s's loss weight is loss_decay ** s."""
    draft_vocab_size: int | None = 32000
    """Tokens the drafter scores (the most frequent reply tokens); capped at the target vocabulary."""
    intermediate_size: int | None = None
    """Draft layer MLP width; default the target's."""
    init_from_target: bool = False
    """Start the draft layer's attention and MLP from the target's last decoder layer (where shapes allow)."""
    tree: dict = field(default_factory=lambda: {"depth": 5, "top_k": 8, "total_tokens": 32})
    """Default dynamic tree (EAGLE-2) for decoding: depth, top_k, total_tokens."""
    loss: str = "soft_ce"
    """The distillation loss against the target's distribution: soft_ce (soft cross-entropy), tv (total
    variation, one minus the acceptance probability) or lk (minus its log); heads/soft_loss.py."""
    init_from: str | None = None
    """Warm start: a draftsmith checkpoint of this kind for this target (e.g. one `draftsmith import`
    made from a published drafter) whose weights training starts from; null = a fresh drafter."""
    norm_before_fc: bool = False
    """EAGLE-3.1: one RMSNorm over the concatenated target features (3T wide, `input_norm`) before fc."""
    fc_norm: bool = False
    """EAGLE-3.1: one RMSNorm per fused target layer (T wide each, `fc_norm.0-2`) before fc; excludes
    norm_before_fc."""
    norm_output: bool = False
    """EAGLE-3.1: the next draft step (and the training-time test's next step) reads the drafter's output
    after its final norm instead of before it; the logits are the same lm_head(norm(h))."""
    norm_before_residual: bool = False
    """The draft layer's attention residual is the normed hidden input, hidden_norm(h), instead of h (what
    speculators' trainer writes by default)."""

    def __post_init__(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("drafter.norm_before_fc and drafter.fc_norm exclude each other (one norm over the "
                             "concatenated features, or one per fused layer): set one of them")
        if not 1 <= self.ttt_steps <= 64:
            raise ValueError(f"drafter.ttt_steps must be in [1, 64] (EAGLE-3 trains 7), got {self.ttt_steps}")
        if self.layer_ids is not None and len(self.layer_ids) != 3:
            raise ValueError(f"drafter.layer_ids must name 3 target layers, got {self.layer_ids}")
        TreeSettings(**self.tree)
        if self.loss not in LOSSES:
            raise ValueError(f"drafter.loss must be one of {', '.join(LOSSES)}, got '{self.loss}'")


@register("eagle3")
class Eagle3(EagleDecoding, DrafterBase):
    title = "EAGLE-3 drafter"
    config_class = Eagle3Config

    def __init__(self, config: Eagle3Config, target: Target):
        super().__init__()
        self.config = config
        self.target = target                       # frozen; its embedding and lm_head are never saved here
        self.target_identity = target.identity
        self.layer_ids = target.check_layer_ids(config.layer_ids or default_layer_ids(target.num_layers),
                                                "drafter.layer_ids")
        shape = layer_shape_from_target(target, intermediate_size=config.intermediate_size)
        self.shape = shape
        add_draft_vocabulary(self, config.draft_vocab_size or target.vocab_size, target.vocab_size)
        vocab = self.draft_to_target.numel()
        T = target.hidden_size
        self.input_norm = RMSNorm(3 * T, shape.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(T, shape.rms_norm_eps) for _ in range(3)) if config.fc_norm else None
        self.fc = nn.Linear(3 * T, shape.hidden_size, bias=False)
        self.midlayer = DraftLayer(shape, fused=True, norm_before_residual=config.norm_before_residual)
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.lm_head = nn.Linear(shape.hidden_size, vocab, bias=False)
        self.rotary = Rotary(shape)
        self.tree = TreeSettings(**config.tree)
        self.metadata: dict = {}
        self.set_draft_vocabulary(self.draft_to_target)
        if config.init_from_target:
            self._init_from_target()

    def enable_gradient_checkpointing(self) -> bool:
        """Each test-time step's draft layer is recomputed in backward (its MLP and attention
        activations, the largest part of a step, are not kept)."""
        self.gradient_checkpointing = True
        return True

    @property
    def required_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.layer_ids) | {self.target.num_layers}))

    @staticmethod
    def parameter_layout(config: dict) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every saved tensor, from a checkpoint's config.json alone."""
        shape, d = config["architecture"], config["target"]["hidden_size"]
        H, draft = shape["hidden_size"], shape["draft_vocab_size"]
        return {"fc.weight": (H, 3 * d), "norm.weight": (H,), "lm_head.weight": (draft, H),
                "draft_to_target": (draft,), **layer_layout(shape, fused=True, prefix="midlayer."),
                **feature_norms(config["drafter"], d)}

    def fused_layer_ids(self) -> list[int]:
        return list(self.layer_ids)

    def architecture(self) -> dict:
        """What an export needs to describe this drafter without the target at hand."""
        eos = self.target.eos_token_ids
        return {**asdict(self.shape), "draft_vocab_size": int(self.draft_to_target.numel()),
                "bos_token_id": getattr(self.target.config, "bos_token_id", None),
                "eos_token_id": eos[0] if len(eos) == 1 else eos}

    @property
    def draft_positions(self) -> int:
        return self.config.ttt_steps

    def set_draft_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """Scored tokens (ascending target ids); the lm_head restarts from the target's rows for them."""
        set_draft_map(self, draft_to_target)
        head = self.target.lm_head.weight.detach()              # on the last device of a spread target
        rows = head[self.draft_to_target.to(head.device)]
        self.lm_head.weight.data.copy_(rows.float().to(self.lm_head.weight.device))

    def _init_from_target(self) -> None:
        """Copy the target's last layer where shapes match (q/k/v read 2H here, so only their
        hidden half); an idea beyond the paper for small data budgets."""
        last = self.target.decoder.layers[-1]
        mine = self.midlayer
        with torch.no_grad():
            for name in ("gate_proj", "up_proj", "down_proj"):
                source = getattr(last.mlp, name).weight
                if source.shape == getattr(mine.mlp, name).weight.shape:
                    getattr(mine.mlp, name).weight.copy_(source.float())
            H = self.shape.hidden_size
            for name in ("q_proj", "k_proj", "v_proj"):
                source = getattr(last.self_attn, name).weight
                target = getattr(mine.self_attn, name).weight
                if source.shape == target[:, H:].shape:
                    target[:, H:].copy_(source.float())
            if last.self_attn.o_proj.weight.shape == mine.self_attn.o_proj.weight.shape:
                mine.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight.float())

    def fuse(self, features: dict) -> torch.Tensor:
        """{layer: [..., T]} -> fc(cat of the three layers) [..., H], each layer normed first (fc_norm) or
        their concatenation (norm_before_fc) where the drafter has those norms."""
        return self.project([features[i] for i in self.layer_ids])

    def project(self, parts: list) -> torch.Tensor:
        """The three fused inputs [..., T] each -> fc of their concatenation [..., H], through the feature
        norms the drafter has (fc_norm per part, norm_before_fc over the concatenation)."""
        dtype = self.fc.weight.dtype
        parts = [part.to(dtype) for part in parts]
        if self.fc_norm is not None:
            parts = [norm(part).to(dtype) for norm, part in zip(self.fc_norm, parts)]
        stacked = torch.cat(parts, dim=-1)
        if self.input_norm is not None:
            stacked = self.input_norm(stacked).to(dtype)
        return self.fc(stacked)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(tokens).to(self.fc.weight.dtype)

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The draft layer's output as the next step reads it: after the final norm with norm_output, else as is."""
        return self.norm(hidden).to(hidden.dtype) if self.config.norm_output else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] (a step's `output`) -> [..., v]: lm_head(norm(h)) either way."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    # -- training ----------------------------------------------------------------
    def forward(self, batch: dict) -> StepOutput:
        """batch: input_ids, attention_mask, loss_mask [b, s], features {layer id: [b, s, H]} -> the training loss."""
        return self.loss(batch)

    @torch.no_grad()
    def _target_distribution(self, batch: dict) -> TargetDistribution:
        """At every position j whose next token is a reply token: the target's distribution over the
        draft vocabulary and whether its argmax is in it."""
        final = batch["features"][self.target.num_layers]                         # [b, s, T]
        wanted = F.pad(batch["loss_mask"][:, 1:], (0, 1)).bool()                   # j predicts token j+1
        rows, positions = wanted.nonzero(as_tuple=True)
        probs, top, ok = [], [], []
        for chunk in final[rows, positions].split(1024):      # the micro-batch's one host wait: nonzero
            logits = self.target.compute_logits(chunk)                            # [c, V], the target's dtype
            # max(-1).indices is argmax (the first of tied maxima) at a quarter of argmax's time on 2 cores
            ok.append(self.target_to_draft[logits.max(-1).indices] >= 0)
            draft = torch.softmax(logits[:, self.draft_to_target].float(), dim=-1)
            probs.append(draft)
            top.append(draft.argmax(-1))
        v = self.draft_to_target.numel()
        cat = lambda parts, empty: torch.cat(parts) if parts else empty               # noqa: E731
        return TargetDistribution(rows, positions, cat(probs, final.new_zeros(0, v, dtype=torch.float32)),
                                  cat(top, rows.new_zeros(0)), cat(ok, rows.new_zeros(0, dtype=torch.bool)))

    def unroll(self, batch: dict):
        """Training-time test: the drafter's hidden output at every position for each step s: [b, s, H] each.
        Step s at position t reads token t+1+s and predicts token t+2+s."""
        input_ids, attention = batch["input_ids"], batch["attention_mask"].bool()
        b, s = input_ids.shape
        hidden = self.fuse(batch["features"])                                     # [b, s, H]
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        past: list = []
        for step in range(self.config.ttt_steps):
            tokens = F.pad(input_ids[:, 1 + step:], (0, 1 + step))                 # token t+1+s at t
            cos, sin = self.rotary(hidden, positions + step)
            hidden = self.output(self.midlayer.ttt(hidden, self.embed(tokens), cos, sin, past, attention,
                                                   checkpointed=self.gradient_checkpointing and self.training))
            yield hidden

    def loss_counts(self, batch: dict) -> torch.Tensor:
        """[ttt_steps]: the positions step s scores, those whose token t+2+s is a reply token."""
        reply = batch["loss_mask"].bool()
        return torch.stack([reply[:, 2 + step:].sum() for step in range(self.config.ttt_steps)]).float()

    def loss(self, batch: dict) -> StepOutput:
        """Sum over unrolled steps s of decay^s * soft-CE(target at t+1+s, drafter at t, step s).

        Each target row (position j) is scored at step s by the drafter's output at t = j-1-s: the
        drafter's rows are gathered to the target's order, so the [m, v] distribution is never copied."""
        target = self._target_distribution(batch)
        device = batch["input_ids"].device
        steps = self.config.ttt_steps
        total = torch.zeros((), device=device)
        correct = torch.zeros(steps, device=device)
        counted = torch.zeros(steps, device=device)
        denominators = term_denominators(batch, self.loss_counts(batch))
        for step, hidden in enumerate(self.unroll(batch)):
            at = target.positions - 1 - step                                            # t = j-1-s
            scored = at >= 0                # may be all False: the loss stays connected to every weight anyway
            mine = hidden[target.rows, at.clamp(min=0)]                                  # [m, H]
            weight = (scored & target.in_vocab).float()
            per_position, guess = acceptance_loss(self.logits(mine), target.probs, weight, self.config.loss)
            total = total + (self.config.loss_decay ** step) * divide(per_position.sum(), denominators[step])
            correct[step] = ((guess == target.top) & scored & target.in_vocab).sum()
            counted[step] = scored.sum()
        return StepOutput(loss=total, correct=correct, counted=counted)

    # -- decoding (heads/eagle_decoding.py) -------------------------------------------
    def _context_hidden(self, context: DraftContext) -> torch.Tensor:
        return self.fuse({i: context.hidden[i] for i in self.layer_ids})                # [m, H]

    def _step(self, hidden, tokens, positions, cache) -> torch.Tensor:
        """[1, n, H] (fused features or drafted outputs), tokens [1, n] -> outputs [1, n, H]"""
        cos, sin = self.rotary(hidden, positions)
        return self.output(self.midlayer.cached(hidden, self.embed(tokens), cos, sin, cache))


# -- serving formats (heads/formats.py), in the Llama-layer layout of heads/eagle3_layout.py -------------

def _write_vllm(config, weights, target, dtype, checkpoint):
    ids = config["target_layer_ids"][:3]
    cfg = {**llama_eagle3_config(config, dtype, ids), "eagle_aux_hidden_state_layer_ids": ids, **norm_flags(config)}
    command = _serve(config, "vllm")
    notes = (f"Fused target layers {ids} (vLLM's convention: hidden_states[i], the input of decoder layer i, "
             "the same as draftsmith's). The embedding is taken from the target.")
    return ({"model.safetensors": layout_tensors(config, weights, dtype, "vllm")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "EAGLE-3 drafter for vLLM", command, notes)})


def _write_speculators(config, weights, target, dtype, checkpoint):
    ids, repeated = speculators_layer_ids(config)
    depth = config["drafter"]["tree"]["depth"]
    layer = llama_fields(config, dtype)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.2.0",
           "speculators_config": speculators_config(config, "eagle3", depth),
           "transformer_layer_config": layer, "draft_vocab_size": layer["draft_vocab_size"],
           "target_hidden_size": layer["target_hidden_size"], **norm_flags(config),
           "eagle_aux_hidden_state_layer_ids": ids, "torch_dtype": layer["torch_dtype"]}
    command = _serve(config, "speculators")
    notes = ("The four norm flags (norm_before_residual, norm_before_fc, fc_norm, norm_output) are written "
             "explicitly: vLLM assumes norm_before_residual true for a speculators config that omits it, which "
             "would silently change the drafter. " + repeated)
    return ({"model.safetensors": layout_tensors(config, weights, dtype, "speculators")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "EAGLE-3 drafter (speculators format)",
                                                       command, notes)})


def _write_sglang(config, weights, target, dtype, checkpoint):
    ids = output_convention(config["target_layer_ids"][:3], "SGLang")
    cfg = {**llama_eagle3_config(config, dtype, ids), **norm_flags(config)}
    command = _serve(config, "sglang")
    notes = (f"Fused layers written as {ids}: SGLang names a fused layer by the decoder layer whose output it "
             f"takes (draftsmith's hidden_states ids {config['target_layer_ids'][:3]} minus one). SGLang skips "
             "unknown weight names silently; the names here are the ones it loads.")
    embed = target.embed_tokens.weight.detach().float().cpu()
    return ({"model.safetensors": layout_tensors(config, weights, dtype, "sglang", embed=embed)},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "EAGLE-3 drafter for SGLang", command, notes)})


def _write_trtllm(config, weights, target, dtype, checkpoint):
    ids = output_convention(config["target_layer_ids"][:3], "TensorRT-LLM")
    cfg = {**llama_eagle3_config(config, dtype, ids), **norm_flags(config)}
    command = _serve(config, "trtllm")
    notes = (f"TensorRT-LLM's eagle3_layers_to_capture names decoder layers by their output: {ids} here "
             f"(draftsmith's hidden_states ids {config['target_layer_ids'][:3]} minus one); pass them explicitly.")
    return ({"model.safetensors": layout_tensors(config, weights, dtype, "trtllm")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "EAGLE-3 drafter for TensorRT-LLM",
                                                       command, notes)})


def _serve(config: dict, fmt: str) -> str:
    """The command that serves a checkpoint's export in `fmt` (THIS_DIR: the export, TARGET_DIR: the target)."""
    tree = config["drafter"]["tree"]
    if fmt == "vllm":
        return (f"""vllm serve TARGET_DIR --speculative-config '{{"method": "eagle3", "model": "THIS_DIR", """
                f""""num_speculative_tokens": {tree['depth']}}}'""")
    if fmt == "speculators":
        return "vllm serve THIS_DIR   # vLLM reads the verifier and the speculative settings from this config"
    if fmt == "sglang":
        return f"""python -m sglang.launch_server --model-path TARGET_DIR --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path THIS_DIR --speculative-num-steps {tree['depth']} \\
    --speculative-eagle-topk {tree['top_k']} --speculative-num-draft-tokens {tree['total_tokens']}"""
    if fmt == "trtllm":
        ids = output_convention(config["target_layer_ids"][:3], "TensorRT-LLM")
        return f"""trtllm-serve TARGET_DIR --extra_llm_api_options spec.yaml
# spec.yaml:
# speculative_config:
#   decoding_type: Eagle3
#   speculative_model_dir: THIS_DIR
#   max_draft_len: {tree['depth']}
#   eagle3_layers_to_capture: {sorted(ids)}"""
    raise ExportError(f"no serving command for an EAGLE-3 drafter in format '{fmt}'")


def read_eagle3(config: dict, weights: dict, target: Target, fmt: str, confirmed: bool = False):
    if fmt == "eagle" and "d2t" not in weights:
        raise ImportFormatError("this is not an EAGLE-3 drafter (no d2t): draftsmith reads the EAGLE repository's "
                                "EAGLE-3 layout; its EAGLE-1/2 drafters (fc with a bias, layers.0.*) have no import yet")
    layer = config.get("transformer_layer_config", config)              # speculators nests the layer's fields
    refuse_unknown_flags(config)
    norms = read_norm_flags(config)
    ids = (config.get("eagle_aux_hidden_state_layer_ids")
           or config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"))
    if not ids and fmt in ("vllm", "eagle"):      # vLLM then fuses its default layers, and the EAGLE code always
        ids = default_layer_ids(target.num_layers)     # does: (2, N//2, N-3), the inputs of those decoder layers
    if not ids or len(ids) != 3:
        raise ImportFormatError("the export names no 3 fused target layers (eagle_aux_hidden_state_layer_ids)")
    ids = convention_ids([int(i) for i in ids], fmt, target.num_layers, confirmed)
    target.check_layer_ids(ids, "the export's fused layers (draftsmith's hidden_states ids)")
    if "d2t" in weights:
        d2t = weights["d2t"].long()
        draft = torch.arange(d2t.numel()) + d2t                          # target id = draft id + d2t[draft id]
    elif int(layer.get("draft_vocab_size", config.get("draft_vocab_size", -1))) == target.vocab_size:
        draft = torch.arange(target.vocab_size)                          # the whole vocabulary: no map written
    else:
        raise ImportFormatError("the export has no d2t, and its draft_vocab_size is not the target's vocabulary "
                                f"({target.vocab_size}): the map from draft to target ids is missing")
    if int(draft.max()) >= target.vocab_size or (draft.diff() <= 0).any():
        raise ImportFormatError("d2t does not map the draft vocabulary to ascending ids inside the target's vocabulary")
    if "t2d" in weights:
        t2d = weights["t2d"].bool()
        if t2d.numel() != target.vocab_size or int(t2d.sum()) != draft.numel() or not bool(t2d[draft].all()):
            raise ImportFormatError("t2d and d2t disagree (t2d must mark exactly the target ids d2t maps to)")
    if "embed_tokens.weight" in weights:          # the target's embedding, carried along: it must be this target's
        own = target.embed_tokens.weight.detach().float().cpu()
        carried = weights["embed_tokens.weight"]
        if carried.shape != own.shape or not torch.allclose(carried, own, atol=1e-2, rtol=1e-2):
            raise ImportFormatError("the export carries an embedding that is not this target's: import it against the "
                               "target it was trained for (--target)")
    drafter = Eagle3(Eagle3Config(layer_ids=ids, draft_vocab_size=draft.numel(),
                                  intermediate_size=int(layer["intermediate_size"]), **norms), target)
    missing = sorted(set(feature_norms(norms, target.hidden_size)) - set(weights))
    if missing:
        on = [name for name in ("norm_before_fc", "fc_norm") if norms[name]]
        raise ImportFormatError(f"the export's config sets {on[0]}: true but it has no {', '.join(missing)}: it was "
                                f"trained without that norm; import it with {on[0]} false (fix config.json)")
    fill(drafter, weights, fmt, draft, skip={"d2t", "t2d"} | CARRIED)
    return drafter


def _sequential(config: dict) -> bool:
    """An EAGLE-3 config that is not a parallel drafter's (P-EAGLE, heads/p_eagle.py, reads those)."""
    return recognizes(config) and not is_parallel(config)


def _reads(fmt: str):
    return lambda config, weights, target, confirmed=False: read_eagle3(config, weights, target, fmt, confirmed)


Eagle3.formats = (
    ExportFormat("vllm", _write_vllm, lambda c: _serve(c, "vllm"), read=_reads("vllm"), recognizes=_sequential,
                 method="eagle3"),
    ExportFormat("speculators", _write_speculators, lambda c: _serve(c, "speculators"), read=_reads("speculators"),
                 rules=((r"^midlayer\.", "layers.0."),), recognizes=_sequential),
    ExportFormat("sglang", _write_sglang, lambda c: _serve(c, "sglang"), read=_reads("sglang"), recognizes=_sequential,
                 needs_target=lambda c: True),          # it carries the target's embedding
    ExportFormat("trtllm", _write_trtllm, lambda c: _serve(c, "trtllm"), read=_reads("trtllm"), recognizes=_sequential),
    ExportFormat("eagle", None, None, read=_reads("eagle"), recognizes=_sequential),
)
