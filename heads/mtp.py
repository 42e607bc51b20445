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

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from draftsmith.heads.contract import DrafterBase
from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.draft_vocab import add_draft_vocabulary, set_draft_map
from draftsmith.heads.drafter import DraftContext, StepOutput, divide, term_denominators
from draftsmith.heads.eagle_decoding import EagleDecoding
from draftsmith.heads.formats import ExportFormat, ImportFormatError, cast, readme
from draftsmith.heads.registry import register
from draftsmith.heads.runtime.target import Target
from draftsmith.heads.soft_loss import soft_cross_entropy

# model_type -> where depth i of N decoder layers keeps its tensors, and the names of its MTP-only parts
MTP_NAMING = {
    "deepseek_v3": "model.layers.{layer}.",
    "glm4_moe": "model.layers.{layer}.",
}
MTP_PARTS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
SHARED = ("shared_head.head.weight", "embed_tokens.weight")       # copies of the target's: not trained, not read


class MtpError(ValueError):
    """A target whose MTP layers cannot be read (none, an unknown naming, a missing or misshapen tensor)."""


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


def target_directory(target: Target) -> Path:
    from draftsmith.heads.runtime.assets import resolve_target_path
    return Path(resolve_target_path(target.source)[0])


def checkpoint_index(directory: Path) -> dict[str, str]:
    """tensor name -> the safetensors file (in `directory`) that holds it, from the index or the files."""
    from safetensors import safe_open
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    names = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            names.update({k: file.name for k in f.keys()})
    return names


def mtp_prefix(target: Target) -> tuple[str, int]:
    """Where depth 0 of the target's MTP layers lives in its checkpoint, and the declared depth count; a
    target with none, or with a naming draftsmith does not know, is refused by name."""
    config = target.config
    model_type = getattr(config, "model_type", "?")
    depths = int(getattr(config, "num_mtp_layers", None) or getattr(config, "num_nextn_predict_layers", 0) or 0)
    if model_type not in MTP_NAMING:
        if depths:
            raise MtpError(f"target '{target.name}' ({model_type}) declares {depths} MTP layer(s), but draftsmith does "
                           f"not know where a {model_type} checkpoint keeps them; known MTP namings: "
                           f"{', '.join(sorted(MTP_NAMING))}")
        raise MtpError(f"target '{target.name}' ({model_type}) ships no MTP layers (its config declares none); "
                       "train an EAGLE-3 drafter for it instead (method: eagle3)")
    if depths < 1:
        raise MtpError(f"target '{target.name}' ({model_type}) declares no MTP layers (num_nextn_predict_layers 0); "
                       "train an EAGLE-3 drafter for it instead (method: eagle3)")
    return MTP_NAMING[model_type].format(layer=target.num_layers), depths


def expected_shapes(target: Target) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape of every tensor depth 0 needs: its own parts, and the block, which holds what
    the target's last decoder layer holds in its checkpoint (MTP layers are MoE where the last layer is)."""
    from safetensors import safe_open
    prefix, _ = mtp_prefix(target)
    model_type = target.config.model_type
    last = MTP_NAMING[model_type].format(layer=target.num_layers - 1)
    directory = target_directory(target)
    index = checkpoint_index(directory)
    h = target.hidden_size
    shapes = {prefix + "enorm.weight": (h,), prefix + "hnorm.weight": (h,), prefix + "eh_proj.weight": (h, 2 * h),
              prefix + "shared_head.norm.weight": (h,)}
    by_file: dict[str, list[str]] = {}
    for key in index:
        if key.startswith(last):
            by_file.setdefault(index[key], []).append(key)
    for file, keys in by_file.items():
        with safe_open(str(directory / file), "pt") as f:
            for key in keys:
                shapes[prefix + key[len(last):]] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_tensors(shapes: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], where, declared: int) -> None:
    """Every tensor of `shapes` is in `found` with that shape; where(name) names the file that should hold it."""
    missing = [name for name in shapes if name not in found]
    if missing:
        more = f"; {len(missing) - 1} more" if len(missing) > 1 else ""
        raise MtpError(f"MTP tensor {missing[0]} is missing from {where(missing[0])} (its config declares {declared} "
                       f"MTP layer(s)){more}")
    for name, shape in shapes.items():
        if tuple(found[name]) != tuple(shape):
            raise MtpError(f"MTP tensor {name} in {where(name)} has shape {list(found[name])}; the target needs "
                           f"{list(shape)}")


def shipped_tensors(target: Target) -> tuple[dict[str, torch.Tensor], str]:
    """The target checkpoint's MTP tensors for depth 0, keyed by their checkpoint names, with their prefix;
    every name and shape checked before any is read."""
    from safetensors import safe_open
    prefix, depths = mtp_prefix(target)
    directory = target_directory(target)
    index = checkpoint_index(directory)
    if not any(k.startswith(prefix) for k in index):
        raise MtpError(f"target '{target.name}' declares {depths} MTP layer(s) (num_nextn_predict_layers), but "
                       f"{directory} holds no tensor named {prefix}*: a checkpoint saved without its MTP layers "
                       "(transformers drops them on load); use the original checkpoint, or train method: eagle3")
    shapes = expected_shapes(target)
    found = {}
    for file in sorted({index[k] for k in shapes if k in index}):
        with safe_open(str(directory / file), "pt") as f:
            found.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k in shapes})
    sharded = (directory / "model.safetensors.index.json").is_file()
    check_tensors(shapes, found, lambda name: directory / index.get(
        name, "model.safetensors.index.json" if sharded else "model.safetensors"), depths)
    tensors = {}
    for file in sorted({index[k] for k in shapes}):
        with safe_open(str(directory / file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k in shapes})
    return tensors, prefix


def build_block(target: Target, tensors: dict[str, torch.Tensor] | None, prefix: str):
    """transformers' MtpLayer for depth 0 with the target's decoder layer class, filled from `tensors`
    (checkpoint names) through transformers' own conversions for the family; None: fresh weights."""
    from transformers.core_model_loading import WeightRenaming
    from transformers.modeling_layers import MtpModel

    main = target.model
    mtp_model = MtpModel(main, 1)
    if tensors is not None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        layer = re.escape(prefix)
        conversions = [WeightRenaming(source_patterns=layer + r"(enorm|hnorm|eh_proj)\.", target_patterns=r"layers.0.\1."),
                       WeightRenaming(source_patterns=layer + r"shared_head\.norm\.", target_patterns="layers.0.post_norm."),
                       WeightRenaming(source_patterns=layer, target_patterns="layers.0.mtp_block.")]
        conversions += list(get_model_conversion_mapping(main, add_legacy=False))
        info, _ = convert_and_load_state_dict_in_model(
            model=mtp_model, state_dict=dict(tensors),
            load_config=LoadStateDictConfig(weight_mapping=conversions, dtype=main.config.dtype))
        missing = sorted(k for k in info.missing_keys if k.startswith("layers."))
        if missing:
            import transformers
            raise MtpError(f"the MTP tensors under {prefix} did not fill {missing[:3]} of the family's MTP layer "
                           f"(transformers {transformers.__version__})")
    return mtp_model.layers[0]


@register("mtp")
class Mtp(EagleDecoding, DrafterBase):
    title = "MTP layers (the target's own, fine-tuned)"
    config_class = MtpConfig

    def __init__(self, config: MtpConfig, target: Target):
        super().__init__()
        self.config = config
        self.target = target
        self.target_identity = target.identity
        prefix, _ = mtp_prefix(target)
        tensors = shipped_tensors(target)[0] if config.warm_start else None
        self.metadata: dict = {"mtp_layer": target.num_layers, "mtp_prefix": prefix, "warm_start": config.warm_start}
        self.layer = build_block(target, tensors, prefix).to(target.device, target.dtype)
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
        position_embeddings = rotary(embeds, position_ids=positions) if rotary is not None else None
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
            wanted = F.pad(features[:, 1 + step:], (0, 0, 0, 1 + step))[scored]          # h_{t+1+s}
            with torch.no_grad():
                target_probs = torch.softmax(self.target.compute_logits(wanted).float(), dim=-1)
            per_position, guess = soft_cross_entropy(self.logits(state[scored]), target_probs)
            total = total + self.config.loss_decay ** step * divide(per_position.sum(), denominators[step])
            correct.append((guess == target_probs.argmax(-1)).sum().float())
            counted.append(scored.sum().float())
        return StepOutput(loss=total, correct=torch.stack(correct), counted=torch.stack(counted))


# -- serving: vLLM's `method: mtp` --------------------------------------------------------------------------
#
# vLLM 0.32 (model_executor/models/deepseek_mtp.py, glm4_moe_mtp.py) builds the MTP model from the
# speculative_config's `model` directory: its config.json (the target's: num_hidden_layers and
# num_nextn_predict_layers place the layer) and every tensor named model.layers.{N+i}.* in its
# safetensors, in the checkpoint's own names (per-expert MoE weights), including shared_head.head and
# embed_tokens.  Tensors outside those layers are skipped.  So the export is the target's config.json
# and the MTP layer alone, in the target checkpoint's names: a directory of a few hundred MB to serve
# beside the untouched target (`"model": EXPORT_DIR`).

def checkpoint_names(target: Target, weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The drafter's block (transformers' in-memory names) under the target checkpoint's own names, through
    the family's conversions run backwards (as transformers' save_pretrained writes a checkpoint)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    ours = {}
    for name, tensor in weights.items():
        if not name.startswith("layer."):
            continue
        inner = name[len("layer."):]
        if inner.startswith("mtp_block."):
            ours[prefix + inner[len("mtp_block."):]] = tensor
        elif inner.startswith("post_norm."):
            ours[prefix + "shared_head.norm." + inner[len("post_norm."):]] = tensor
        else:
            ours[prefix + inner] = tensor                               # enorm, hnorm, eh_proj
    config = AutoConfig.from_pretrained(target_directory(target), local_files_only=True)
    with torch.device("meta"):
        family = AutoModelForCausalLM.from_config(config)            # its conversions, no weights
    return dict(revert_weight_conversion(family, ours))


def write_vllm(config, weights, target, dtype, checkpoint):
    prefix = config["architecture"]["mtp_prefix"]
    state = checkpoint_names(target, weights, prefix)
    state[prefix + "shared_head.head.weight"] = target.lm_head.weight.detach().float().cpu()
    state[prefix + "embed_tokens.weight"] = target.embed_tokens.weight.detach().float().cpu()
    target_config = json.loads((target_directory(target) / "config.json").read_text())
    text = readme(config, checkpoint, "MTP layer for vLLM (`method: mtp`)", serve_vllm(config),
                  f"The target's own MTP layer ({prefix}*), fine-tuned by draftsmith, in the target checkpoint's tensor "
                  "names, beside the target's config.json. vLLM builds its MTP model from this directory and takes "
                  "nothing else from it; the target itself is served unchanged. K > 1 reuses the layer on its own "
                  "output.")
    return {"model.safetensors": cast(state, dtype)}, {"config.json": target_config, "README.md": text}


def serve_vllm(config: dict) -> str:
    depth = config["drafter"].get("train_steps", 3)
    return (f"""vllm serve TARGET_DIR --speculative-config '{{"method": "mtp", "model": "THIS_DIR", """
            f""""num_speculative_tokens": {depth}}}'""")


def recognizes_vllm(export_config: dict) -> bool:
    """An MTP export is the target's own config: a family with a known MTP naming that declares MTP layers."""
    depths = export_config.get("num_nextn_predict_layers") or export_config.get("num_mtp_layers") or 0
    return export_config.get("model_type") in MTP_NAMING and depths > 0


def read_vllm(export_config: dict, weights: dict, target: Target, confirmed: bool = False):
    """An export (or any checkpoint in the family's naming, the target's own included) back as a drafter:
    the MTP tensors checked by name and shape against the target, then loaded as the warm start is."""
    if export_config.get("model_type") != getattr(target.config, "model_type", None) or \
            export_config.get("num_hidden_layers") != target.num_layers:
        raise ImportFormatError(f"the export holds the MTP layer of a {export_config.get('model_type')} model with "
                                f"{export_config.get('num_hidden_layers')} layers; the target is "
                                f"{getattr(target.config, 'model_type', '?')} with {target.num_layers}")
    prefix, depths = mtp_prefix(target)
    shapes = expected_shapes(target)
    try:
        check_tensors(shapes, {k: tuple(v.shape) for k, v in weights.items()}, lambda name: "the export", depths)
    except MtpError as err:
        raise ImportFormatError(str(err)) from None
    drafter = Mtp(MtpConfig(warm_start=False), target)
    drafter.layer = build_block(target, {k: weights[k] for k in shapes}, prefix).to(target.device, target.dtype)
    drafter.layer.requires_grad_(True)
    drafter.metadata["warm_start"] = True
    return drafter


def stitch(tensors: dict[str, dict[str, torch.Tensor]], target_dir: Path) -> None:
    """`export --to vllm --with-target`: the target as transformers saved it (without MTP layers) gets the
    fine-tuned layer back, as one more shard (`model-mtp.safetensors`) in its index, so that a stack which
    reads MTP layers from the target itself (vLLM with no `model` in its speculative_config) serves it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    layer = {k: v.contiguous() for k, v in tensors["model.safetensors"].items()}
    save_file(layer, str(target_dir / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = target_dir / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        with safe_open(str(target_dir / "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    index["weight_map"].update({k: "model-mtp.safetensors" for k in layer})
    index_path.write_text(json.dumps(index, indent=2) + "\n")


Mtp.formats = (
    ExportFormat("vllm", write_vllm, serve_vllm, read=read_vllm, recognizes=recognizes_vllm,
                 needs_target=lambda config: True, method="mtp", stitch=stitch),
)
