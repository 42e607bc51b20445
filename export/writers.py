"""One writer per (drafter, format): tensors renamed and configs written as each stack reads them.

Each writer returns ({filename: {tensor name: tensor}}, {filename: text or JSON}).  Tensor names come
from the drafter's declared layout through the format's rules (export/layouts.py); the writers add
what a format carries beyond the drafter's own weights (vocabulary maps, the target's head or embedding).
Facts behind the names come from the serving stacks (vLLM, SGLang and TensorRT-LLM loaders):
vLLM's Medusa (`blocks.{h}.layers.{l}`, `lm_heads.{h}`, `token_map` with
`truncated_vocab_size`, `original_lm_head` for one shared head), vLLM/SGLang
`LlamaForCausalLMEagle3` (fc, midlayer.*, norm, lm_head, d2t, t2d), the
speculators config (which assumes norm_before_residual=true when absent), and
FasterDecoding's medusa_lm_head.safetensors (`{h}.{l}.linear.*`, `{h}.{L}.weight`).
"""
from __future__ import annotations

import logging

import torch

from .core import ExportError
from .layouts import VOCABULARY, names

log = logging.getLogger(__name__)

README = """# {title}

Exported by draftsmith {version} from `{checkpoint}` (a {kind} drafter for `{target}`).

Serve it:

```bash
{command}
```

{notes}
"""


def _readme(config: dict, checkpoint, title: str, command: str, notes: str = "") -> str:
    return README.format(title=title, version=config.get("draftsmith_version", "?"), checkpoint=checkpoint,
                         kind=config["kind"], target=config["target"]["name"], command=command.strip(),
                         notes=notes.strip())


def _cast(tensors: dict, dtype: torch.dtype) -> dict:
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}


# -- Medusa --------------------------------------------------------------------------

def medusa_vllm(config, weights, target, dtype, checkpoint):
    arch, info = config["drafter"], config["target"]
    heads, layers, vocab = arch["num_heads"], arch["num_layers"], info["vocab_size"]
    draft = weights["draft_to_target"]
    truncated = draft.numel() < vocab
    shared = arch["lm_head"] == "shared"
    if truncated and not shared:
        raise ExportError("vLLM's Medusa takes a reduced draft vocabulary only with one shared head "
                          "(original_lm_head); this checkpoint has one trained head per position over "
                          f"{draft.numel()} tokens. Retrain with drafter.lm_head: shared, or draft_vocab_size: null")
    out = {theirs: weights[ours] for ours, theirs in names(config, "vllm").items()}
    if shared:
        full = target.lm_head.weight.detach().float().cpu()
        out["lm_heads.0.weight"] = full[draft] if truncated else full
    if truncated:
        out["token_map"] = draft.long()
        log.warning("this Medusa export has a reduced draft vocabulary (token_map); vLLM 0.32 fails to load "
                    "it ('weights not initialized: token_map'). For vLLM 0.32 train with drafter.draft_vocab_size: null")
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": info["hidden_size"],
           "vocab_size": vocab, "num_heads": heads, "num_hidden_layers": layers, "medusa_fc_bias": True,
           "truncated_vocab_size": int(draft.numel()), "original_lm_head": shared,
           "torch_dtype": str(dtype).replace("torch.", "")}
    readme = _readme(config, checkpoint, "Medusa heads for vLLM", serving_command(config, "vllm"),
                     "vLLM's Medusa drafts a chain of the heads' top-1 tokens (no tree).")
    return {"model.safetensors": _cast(out, dtype)}, {"config.json": cfg, "README.md": readme}


def medusa_original(config, weights, target, dtype, checkpoint):
    arch, info = config["drafter"], config["target"]
    heads, layers, vocab = arch["num_heads"], arch["num_layers"], info["vocab_size"]
    if weights["draft_to_target"].numel() < vocab:
        raise ExportError("the original Medusa format has full-vocabulary heads; this checkpoint scores a "
                          f"{weights['draft_to_target'].numel()}-token draft vocabulary. Export to vllm instead, "
                          "or retrain with drafter.draft_vocab_size: null")
    if layers != 1:
        raise ExportError(f"this Medusa drafter has {layers} residual layers per head; the original layout's "
                          "readers (TGI, TensorRT-LLM's converter) load exactly one. Export to vllm, or retrain "
                          "with drafter.num_layers: 1")
    out = {theirs: weights[ours] for ours, theirs in names(config, "medusa-original").items()}
    if arch["lm_head"] == "shared":         # every head projects through the target's own lm_head
        out |= {f"{h}.{layers}.weight": target.lm_head.weight.detach().float().cpu() for h in range(heads)}
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": info["name"],
           "hidden_size": info["hidden_size"], "vocab_size": vocab}
    readme = _readme(config, checkpoint, "Medusa heads (FasterDecoding layout)",
                     serving_command(config, "medusa-original"))
    return {"medusa_lm_head.safetensors": _cast(out, dtype)}, {"config.json": cfg, "README.md": readme}


# -- EAGLE-3 -------------------------------------------------------------------------

def _eagle3_tensors(config, weights, dtype, fmt: str, embed: torch.Tensor | None = None) -> dict:
    vocab = config["target"]["vocab_size"]
    draft = weights[VOCABULARY].long()
    out = {theirs: weights[ours] for ours, theirs in names(config, fmt).items()}
    out["d2t"] = draft - torch.arange(draft.numel())            # target_id = draft_id + d2t[draft_id]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft] = True
    out["t2d"] = t2d
    if embed is not None:
        out["embed_tokens.weight"] = embed
    return _cast(out, dtype)


def _llama_fields(config, dtype) -> dict:
    shape, info = config["architecture"], config["target"]
    rope = dict(shape["rope_parameters"])
    return {
        "model_type": "llama", "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
        "num_attention_heads": shape["num_heads"], "num_key_value_heads": shape["num_kv_heads"],
        "head_dim": shape["head_dim"], "num_hidden_layers": 1, "rms_norm_eps": shape["rms_norm_eps"],
        "hidden_act": "silu", "vocab_size": info["vocab_size"], "draft_vocab_size": shape["draft_vocab_size"],
        "target_hidden_size": info["hidden_size"], "max_position_embeddings": shape["max_position_embeddings"],
        "rope_parameters": rope, "rope_theta": rope.get("rope_theta"), "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": str(dtype).replace("torch.", ""),
        "bos_token_id": shape.get("bos_token_id"), "eos_token_id": shape.get("eos_token_id"),
    }


def _output_convention(layer_ids: list[int], stack: str) -> list[int]:
    """SGLang and TensorRT-LLM read "output of layer i" = hidden_states[i + 1]."""
    if min(layer_ids) < 1:
        raise ExportError(f"{stack} names fused layers by the decoder layer whose OUTPUT it takes; layer id 0 "
                          "(the embeddings) has no such name. Retrain with drafter.layer_ids >= 1")
    return [i - 1 for i in layer_ids]


def _eagle3_config(config, dtype, ids: list[int]) -> dict:
    """`LlamaForCausalLMEagle3`'s config.json, fusing the target layers `ids` (in the stack's convention)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(config, dtype),
            "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids}}


def eagle3_vllm(config, weights, target, dtype, checkpoint):
    ids = config["target_layer_ids"][:3]
    cfg = {**_eagle3_config(config, dtype, ids), "eagle_aux_hidden_state_layer_ids": ids}
    command = serving_command(config, "vllm")
    notes = (f"Fused target layers {ids} (vLLM's convention: hidden_states[i], the input of decoder layer i, "
             "the same as draftsmith's). The embedding is taken from the target.")
    return ({"model.safetensors": _eagle3_tensors(config, weights, dtype, "vllm")},
            {"config.json": cfg, "README.md": _readme(config, checkpoint, "EAGLE-3 drafter for vLLM", command, notes)})


def _verifier_path(config) -> str:
    """A path vLLM can load the target from (the converted directory for an embedded or GGUF target)."""
    from draftsmith.heads.assets import resolve_target_path
    from draftsmith.heads.drafter import target_path

    try:
        directory, _ = resolve_target_path(target_path(config))
        return str(directory)
    except FileNotFoundError:
        return config["target"]["name"]


def target_architecture(config: dict) -> str:
    """The target's model class, as the checkpoint recorded it (older checkpoints: from its model_type)."""
    if config.get("target_architecture"):
        return config["target_architecture"]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config["target"]["model_type"]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"cannot tell the target's architecture: the checkpoint records model_type '{model_type}' "
                         "and no target_architecture; re-save it with this draftsmith")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def eagle3_speculators(config, weights, target, dtype, checkpoint):
    ids = config["target_layer_ids"][:3]
    depth = config["drafter"]["tree"]["depth"]
    layer = _llama_fields(config, dtype)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.2.0",
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": depth}],
                                  "verifier": {"name_or_path": _verifier_path(config),
                                               "architectures": [target_architecture(config)]}},
           "transformer_layer_config": layer, "draft_vocab_size": layer["draft_vocab_size"],
           "target_hidden_size": layer["target_hidden_size"], "norm_before_residual": False,
           "norm_before_fc": False, "eagle_aux_hidden_state_layer_ids": ids, "torch_dtype": layer["torch_dtype"]}
    command = serving_command(config, "speculators")
    notes = ("`norm_before_residual: false` is written explicitly: vLLM assumes true for speculators configs that "
             "omit it, which would silently change the drafter.")
    return ({"model.safetensors": _eagle3_tensors(config, weights, dtype, "speculators")},
            {"config.json": cfg, "README.md": _readme(config, checkpoint, "EAGLE-3 drafter (speculators format)",
                                                       command, notes)})


def eagle3_sglang(config, weights, target, dtype, checkpoint):
    ids = _output_convention(config["target_layer_ids"][:3], "SGLang")
    cfg = _eagle3_config(config, dtype, ids)
    command = serving_command(config, "sglang")
    notes = (f"Fused layers written as {ids}: SGLang names a fused layer by the decoder layer whose output it "
             f"takes (draftsmith's hidden_states ids {config['target_layer_ids'][:3]} minus one). SGLang skips "
             "unknown weight names silently; the names here are the ones it loads.")
    embed = target.embed_tokens.weight.detach().float().cpu()
    return ({"model.safetensors": _eagle3_tensors(config, weights, dtype, "sglang", embed=embed)},
            {"config.json": cfg, "README.md": _readme(config, checkpoint, "EAGLE-3 drafter for SGLang", command, notes)})


def eagle3_trtllm(config, weights, target, dtype, checkpoint):
    ids = _output_convention(config["target_layer_ids"][:3], "TensorRT-LLM")
    cfg = _eagle3_config(config, dtype, ids)
    command = serving_command(config, "trtllm")
    notes = (f"TensorRT-LLM's eagle3_layers_to_capture names decoder layers by their output: {ids} here "
             f"(draftsmith's hidden_states ids {config['target_layer_ids'][:3]} minus one); pass them explicitly.")
    return ({"model.safetensors": _eagle3_tensors(config, weights, dtype, "trtllm")},
            {"config.json": cfg, "README.md": _readme(config, checkpoint, "EAGLE-3 drafter for TensorRT-LLM",
                                                       command, notes)})


def serving_command(config: dict, fmt: str) -> str:
    """The command that serves a checkpoint's export in `fmt` (THIS_DIR: the export, TARGET_DIR: the target)."""
    kind, drafter = config["kind"], config["drafter"]
    if kind == "medusa" and fmt == "vllm":
        return (f"""vllm serve TARGET_DIR --speculative-config '{{"method": "medusa", "model": "THIS_DIR", """
                f""""num_speculative_tokens": {drafter['num_heads']}}}'""")
    if kind == "medusa" and fmt == "medusa-original":
        return f"""# TGI
text-generation-launcher --model-id THIS_DIR   # with base_model_name_or_path pointing at the target
# TensorRT-LLM: convert_checkpoint.py --model_dir TARGET_DIR --medusa_model_dir THIS_DIR --num_medusa_heads {drafter['num_heads']}"""
    tree = drafter["tree"]
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
        ids = _output_convention(config["target_layer_ids"][:3], "TensorRT-LLM")
        return f"""trtllm-serve TARGET_DIR --extra_llm_api_options spec.yaml
# spec.yaml:
# speculative_config:
#   decoding_type: Eagle3
#   speculative_model_dir: THIS_DIR
#   max_draft_len: {tree['depth']}
#   eagle3_layers_to_capture: {sorted(ids)}"""
    raise ExportError(f"no serving command for a {kind} drafter in format '{fmt}'")


WRITERS = {
    ("medusa", "vllm"): medusa_vllm,
    ("medusa", "medusa-original"): medusa_original,
    ("eagle3", "vllm"): eagle3_vllm,
    ("eagle3", "speculators"): eagle3_speculators,
    ("eagle3", "sglang"): eagle3_sglang,
    ("eagle3", "trtllm"): eagle3_trtllm,
}
