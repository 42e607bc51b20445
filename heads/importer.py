"""Read a drafter written for a serving stack back into a draftsmith checkpoint: the inverse of
heads/export_formats.py, for warm starts from published drafters (`draftsmith import`, then
`drafter.init_from=CHECKPOINT` in a recipe).

Formats: `vllm` (Medusa and EAGLE-3), `speculators`, `sglang` (what SpecForge writes), `trtllm`
(Model Optimizer's HF EAGLE-3 layout) and `medusa-original` (FasterDecoding).  The layer-id
conventions are converted (SGLang and TensorRT-LLM name a fused layer by the decoder layer whose
output it takes: draftsmith's id is that plus one), the vocabulary maps are checked against each
other and against the target, and every tensor must fit the drafter draftsmith builds for that target.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .drafter import save_drafter
from .target import Target

FORMATS = ("vllm", "speculators", "sglang", "trtllm", "medusa-original")
OUTPUT_CONVENTION = ("sglang", "trtllm")         # layer ids name a decoder layer's output


class ImportError_(ValueError):
    """An export that cannot be read as a draftsmith drafter for this target."""


def _weights(source: Path) -> dict[str, torch.Tensor]:
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ImportError_(f"'{source}' holds no .safetensors weights (pickled .bin files are never loaded)")
    weights = {}
    for f in files:
        weights.update({k: v.float() if v.is_floating_point() else v for k, v in load_file(str(f)).items()})
    return weights


def import_drafter(source: str | Path, fmt: str, target: Target):
    """The drafter an export in `fmt` holds, built for `target` (weights checked name by name)."""
    source = Path(source)
    if fmt not in FORMATS:
        raise ImportError_(f"unknown format '{fmt}': draftsmith imports {', '.join(FORMATS)}")
    if not (source / "config.json").is_file():
        raise ImportError_(f"'{source}' is not an export: no config.json")
    config = json.loads((source / "config.json").read_text())
    if fmt == "medusa-original":
        from .export_formats import import_medusa_original
        return import_medusa_original(source, target)
    if config.get("model_type") == "medusa":
        return _medusa_vllm(config, _weights(source), target)
    return _eagle3(config, _weights(source), target, fmt)


def _medusa_vllm(config: dict, weights: dict, target: Target):
    from .medusa import Medusa, MedusaConfig

    heads, layers = int(config["num_heads"]), int(config["num_hidden_layers"])
    shared = bool(config.get("original_lm_head"))
    draft = weights.get("token_map", torch.arange(target.vocab_size)).long()
    if draft.numel() != int(config.get("truncated_vocab_size") or draft.numel()):
        raise ImportError_(f"token_map holds {draft.numel()} ids but truncated_vocab_size is "
                           f"{config['truncated_vocab_size']}")
    if int(draft.max()) >= target.vocab_size:
        raise ImportError_(f"token_map names token {int(draft.max())}, beyond the target's vocabulary ({target.vocab_size})")
    drafter = Medusa(MedusaConfig(num_heads=heads, num_layers=layers, lm_head="shared" if shared else "own",
                                  draft_vocab_size=None if draft.numel() == target.vocab_size else draft.numel()), target)
    from .export_formats import medusa_vllm_names

    state = {"draft_to_target": draft}
    state.update({ours: weights[theirs] for ours, theirs in medusa_vllm_names(heads, layers, shared).items()
                  if theirs in weights})          # what is missing is named by _load
    if shared:                  # the one shared head is the target's own: it must be this target's
        written = weights["lm_heads.0.weight"]
        own = target.lm_head.weight.detach().float().cpu()[draft]
        if written.shape != own.shape or not torch.allclose(written, own, atol=1e-2, rtol=1e-2):
            raise ImportError_("the export's shared head is not this target's lm_head: import it against the target "
                               "it was made for (--target)")
    _load(drafter, state)
    return drafter


def _eagle3(config: dict, weights: dict, target: Target, fmt: str):
    from .eagle3 import Eagle3, Eagle3Config

    layer = config.get("transformer_layer_config", config)              # speculators nests the layer's fields
    if config.get("norm_before_residual") is True:
        raise ImportError_("this speculators drafter normalises before the residual (norm_before_residual: true), "
                           "which draftsmith's EAGLE-3 layer does not do")
    ids = (config.get("eagle_aux_hidden_state_layer_ids")
           or config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"))
    if not ids and fmt == "vllm":           # vLLM then fuses its default layers: (2, N//2, N-3), as we do
        from .eagle3 import default_layer_ids
        ids = default_layer_ids(target.num_layers)
    if not ids or len(ids) != 3:
        raise ImportError_("the export names no 3 fused target layers (eagle_aux_hidden_state_layer_ids)")
    ids = [int(i) + 1 for i in ids] if fmt in OUTPUT_CONVENTION else [int(i) for i in ids]
    target.check_layer_ids(ids, "the export's fused layers (draftsmith's hidden_states ids)")
    d2t = weights["d2t"].long()
    draft = torch.arange(d2t.numel()) + d2t                              # target id = draft id + d2t[draft id]
    if int(draft.max()) >= target.vocab_size or (draft.diff() <= 0).any():
        raise ImportError_("d2t does not map the draft vocabulary to ascending ids inside the target's vocabulary")
    if "t2d" in weights:
        t2d = weights["t2d"].bool()
        if t2d.numel() != target.vocab_size or int(t2d.sum()) != draft.numel() or not bool(t2d[draft].all()):
            raise ImportError_("t2d and d2t disagree (t2d must mark exactly the target ids d2t maps to)")
    prefix = "layers.0." if fmt == "speculators" else "midlayer."
    state = {("midlayer." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in weights.items()
             if k not in ("d2t", "t2d", "embed_tokens.weight")}
    state["draft_to_target"] = draft
    drafter = Eagle3(Eagle3Config(layer_ids=ids, draft_vocab_size=draft.numel(),
                                  intermediate_size=int(layer["intermediate_size"])), target)
    _load(drafter, state)
    return drafter


def _load(drafter, state: dict) -> None:
    own = drafter.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in set(own) & set(state)
             if state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        raise ImportError_(f"the export does not fit a {drafter.kind} drafter for this target: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}, shapes {wrong[:4]}")
    drafter.load_state_dict(state, strict=True)


def import_checkpoint(source: str | Path, fmt: str, out_dir: str | Path, target: Target) -> Path:
    """Write the imported drafter as a draftsmith checkpoint (config.json, model.safetensors, README.md)."""
    from .card import write_card

    drafter = import_drafter(source, fmt, target)
    drafter.metadata["imported_from"] = {"path": str(Path(source).resolve()), "format": fmt}
    save_drafter(drafter, Path(out_dir))
    write_card(out_dir)
    return Path(out_dir)
