"""The Llama-layer EAGLE-3 layout every serving stack loads, shared by the drafters that are saved in it
(EAGLE-3, and the parallel drafters built on it): its config fields, the fused layers' id conventions,
the vocabulary maps and the verifier a speculators config names.

vLLM / SGLang `LlamaForCausalLMEagle3` (fc, midlayer.*, norm, lm_head, d2t, t2d); the speculators config
(which assumes norm_before_residual=true when absent); SGLang and TensorRT-LLM name a fused layer by the
decoder layer whose output it takes (draftsmith's id minus one); the EAGLE repository's own layout
carries the target's embedding and no layer ids (that code always fuses (2, N//2, N-3)).
"""
from __future__ import annotations

import logging

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from draftsmith.heads.draft_vocab import d2t_offsets, t2d_mask
from draftsmith.heads.drafter import target_path
from draftsmith.heads.formats import VOCABULARY, ImportFormatError, cast, dtype_name, renamed, rope_fields
from draftsmith.heads.runtime.assets import resolve_target_path


def default_layer_ids(num_layers: int) -> list[int]:
    """(2, N//2, N-3) as vLLM and the paper use, clamped into range for very shallow targets."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


OUTPUT_CONVENTION = ("sglang", "trtllm")         # layer ids name a decoder layer's output
CARRIED = {"embed_tokens.weight"}                 # the target's own embedding some formats carry: checked, not kept


def layout_tensors(config, weights, dtype, fmt: str, embed: torch.Tensor | None = None) -> dict:
    vocab = config["target"]["vocab_size"]
    draft = weights[VOCABULARY].long()
    out = renamed(config, weights, fmt)
    if draft.numel() != vocab:                 # a whole-vocabulary drafter has no map: vLLM refuses one then
        out["d2t"] = d2t_offsets(draft)        # target_id = draft_id + d2t[draft_id]
        out["t2d"] = t2d_mask(draft, vocab)
    if embed is not None:
        out["embed_tokens.weight"] = embed
    return cast(out, dtype)


def llama_fields(config, dtype) -> dict:
    shape, info = config["architecture"], config["target"]
    return {
        "model_type": "llama", "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
        "num_attention_heads": shape["num_heads"], "num_key_value_heads": shape["num_kv_heads"],
        "head_dim": shape["head_dim"], "num_hidden_layers": 1, "rms_norm_eps": shape["rms_norm_eps"],
        "hidden_act": "silu", "vocab_size": info["vocab_size"], "draft_vocab_size": shape["draft_vocab_size"],
        "target_hidden_size": info["hidden_size"], "max_position_embeddings": shape["max_position_embeddings"],
        **rope_fields(shape["rope_parameters"]), "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": dtype_name(dtype),
        "bos_token_id": shape.get("bos_token_id"), "eos_token_id": shape.get("eos_token_id"),
    }


def llama_eagle3_config(config, dtype, ids: list[int]) -> dict:
    """`LlamaForCausalLMEagle3`'s config.json, fusing the target layers `ids` (in the stack's convention)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(config, dtype),
            "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids}}


def speculators_layer_ids(config) -> tuple[list[int], str]:
    """The fused layers a speculators config names, and a note for its README when they repeat (a target of
    6 layers or fewer repeats the defaults): vLLM serves such an export, but the speculators library refuses
    to load it (its resolve_target_layer_ids wants distinct ids), which the export says, and logs, here."""
    ids = config["target_layer_ids"][:3]
    if len(set(ids)) == len(ids):
        return ids, ""
    note = (f"The fused layers {ids} repeat (a target this shallow repeats the default ones): vLLM serves this "
            "export, but the speculators library refuses to load it (it wants three distinct layers); retrain with "
            "three distinct drafter.layer_ids to load it there.")
    logging.getLogger("draftsmith").warning("export: %s", note)
    return ids, note


def speculators_config(config: dict, algorithm: str, tokens: int) -> dict:
    """speculators' `speculators_config`: the algorithm, a greedy proposal of `tokens`, and the verifier."""
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "verifier": {"name_or_path": verifier_path(config), "architectures": [target_architecture(config)]}}


def verifier_path(config) -> str:
    """A path vLLM can load the target from (the converted directory for an embedded or GGUF target)."""
    try:
        directory, _ = resolve_target_path(target_path(config))
        return str(directory)
    except FileNotFoundError:
        return config["target"]["name"]


def target_architecture(config: dict) -> str:
    """The target's model class, as the checkpoint recorded it (older checkpoints: from its model_type)."""
    if config.get("target_architecture"):
        return config["target_architecture"]
    model_type = config["target"]["model_type"]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"cannot tell the target's architecture: the checkpoint records model_type '{model_type}' "
                         "and no target_architecture; re-save it with this draftsmith")
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def convention_ids(written: list[int], fmt: str, num_layers: int, confirmed: bool = False) -> list[int]:
    """The export's layer ids in draftsmith's convention (the input of decoder layer i).  SGLang and
    TensorRT-LLM name a layer's output (ours minus one).  Ids that are exactly the other convention's
    default for this target's depth, and not this one's, mean a wrong --from: refused."""
    output = fmt in OUTPUT_CONVENTION
    default = default_layer_ids(num_layers)
    expected = [i - 1 for i in default] if output else default
    other = default if output else [i - 1 for i in default]
    if not confirmed and written != expected and written == other:
        others = "vllm, speculators or eagle" if output else "sglang or trtllm"
        raise ImportFormatError(f"the export's fused layers {written} are the default of the other layer-id convention for "
                           f"this {num_layers}-layer target ({others}: '{'input' if output else 'output'} of layer i'), "
                           f"but --from {fmt} reads them as the {'output' if output else 'input'} of layer i; give "
                           "the format it was written in (--from)")
    converted = [i + 1 for i in written] if output else written
    logging.getLogger("draftsmith").info(
        "import: --from %s names a decoder layer's %s: the export's layer ids %s are draftsmith's %s", fmt,
        "output" if output else "input", written, converted)
    return converted




def recognizes(config: dict) -> bool:
    """An EAGLE-3 config: a draft vocabulary (the layer's fields, nested by speculators) or the architecture."""
    if "dflash_config" in config or config.get("speculators_model_type") in ("dflash", "dspark"):
        return False                              # DFlash's and DSpark's Qwen3 layers have a draft vocabulary too
    return ("draft_vocab_size" in config.get("transformer_layer_config", config)
            or any("Eagle3" in str(a) for a in config.get("architectures") or ()))


def is_parallel(config: dict) -> bool:
    """A parallel-drafting (P-EAGLE) config in this layout: vLLM's flag, or speculators' `peagle`."""
    return bool(config.get("parallel_drafting")) or config.get("speculators_model_type") == "peagle"


NORM_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
"""EAGLE-3.1's options (and speculators' norm_before_residual): config flags of the same names in every format."""


def feature_norms(drafter: dict, target_hidden: int) -> dict[str, tuple[int, ...]]:
    """The tensors the feature norms add (none for a drafter without them, as every checkpoint before them)."""
    if drafter.get("norm_before_fc"):
        return {"input_norm.weight": (3 * target_hidden,)}
    if drafter.get("fc_norm"):
        return {f"fc_norm.{i}.weight": (target_hidden,) for i in range(3)}
    return {}


def norm_flags(config: dict) -> dict[str, bool]:
    """The four norm flags every export writes, false where the checkpoint predates them."""
    return {name: bool(config["drafter"].get(name, False)) for name in NORM_OPTIONS}


INERT_FLAGS = {"use_cache", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
               "embed_requires_grad", "use_aux_hidden_state", "is_decoder", "has_no_defaults_at_init",
               "parallel_drafting"}
"""Config flags that may be true without changing what the drafter computes (parallel_drafting: P-EAGLE's
mark, read by heads/p_eagle.py)."""


def read_norm_flags(config: dict) -> dict[str, bool]:
    """The EAGLE-3.1 norm flags of an export, wherever a stack writes them: vLLM reads norm_before_fc from
    eagle_config first, then the top level; speculators writes them at the top level (absent = false, as the
    speculators library reads them; vLLM alone assumes norm_before_residual true for a speculators config
    without it, which is why every export of draftsmith writes all four)."""
    eagle = config.get("eagle_config") or {}
    flags = {}
    for name in NORM_OPTIONS:
        value = eagle.get(name, config.get(name, False))
        if value is None:
            value = False
        if not isinstance(value, bool):
            raise ImportFormatError(f"the export's {name} is {value!r}; it must be true or false")
        flags[name] = value
    if flags["norm_before_fc"] and flags["fc_norm"]:
        raise ImportFormatError("the export sets both norm_before_fc and fc_norm, which exclude each other (the "
                                "speculators library refuses such a config too)")
    return flags


def refuse_unknown_flags(config: dict) -> None:
    """An import never drops a flag silently: a config key set true at the top level, in eagle_config or in the
    layer's config that draftsmith does not read is refused by name (it may change what the drafter computes:
    attention_bias, mlp_bias, a norm draftsmith does not have)."""
    places = {"": config, "eagle_config.": config.get("eagle_config") or {},
              "transformer_layer_config.": config.get("transformer_layer_config") or {}}
    unknown = [prefix + key for prefix, fields in places.items() for key, value in fields.items()
               if value is True and key not in INERT_FLAGS and key not in NORM_OPTIONS]
    if unknown:
        raise ImportFormatError(f"the export sets {', '.join(unknown)}: true, which draftsmith's EAGLE-3 does not "
                                "read; importing it would drop what the flag changes. If the flag is known not to "
                                "change the drafter's computation, set it false in config.json")
    layer = places["transformer_layer_config."] or config
    if layer.get("hidden_act", "silu") != "silu":
        raise ImportFormatError(f"the export's draft layer uses hidden_act '{layer['hidden_act']}'; draftsmith's "
                                "EAGLE-3 layer is SiLU")
