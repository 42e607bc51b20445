"""DFlash's serving formats, written: vLLM's DFlashDraftModel (Qwen3 layers, `dflash_config`) and speculators'
`dflash` (heads/dflash.py reads them back; heads/dspark.py writes DSpark's on the same fields)."""
from __future__ import annotations

from draftsmith.heads.draft_vocab import d2t_offsets, t2d_mask
from draftsmith.heads.eagle3_layout import speculators_config
from draftsmith.heads.formats import VOCABULARY, cast, dtype_name, output_convention, readme, renamed, rope_fields


def qwen3_fields(config: dict, dtype) -> dict:
    """The draft layers' Qwen3 config fields."""
    shape, info = config["architecture"], config["target"]
    return {"model_type": "qwen3", "hidden_size": shape["hidden_size"], "intermediate_size": shape["intermediate_size"],
            "num_attention_heads": shape["num_heads"], "num_key_value_heads": shape["num_kv_heads"],
            "head_dim": shape["head_dim"], "num_hidden_layers": config["drafter"]["num_layers"],
            "rms_norm_eps": shape["rms_norm_eps"], "hidden_act": "silu", "vocab_size": info["vocab_size"],
            "draft_vocab_size": shape["draft_vocab_size"], "target_hidden_size": info["hidden_size"],
            "max_position_embeddings": shape["max_position_embeddings"],
            **rope_fields(shape["rope_parameters"]), "tie_word_embeddings": False, "attention_bias": False,
            "use_sliding_window": False, "torch_dtype": dtype_name(dtype), "block_size": config["drafter"]["block_size"],
            "bos_token_id": shape.get("bos_token_id"), "eos_token_id": shape.get("eos_token_id")}


def export_tensors(config, weights, dtype, fmt) -> dict:
    out = renamed(config, weights, fmt)
    draft = weights[VOCABULARY].long()
    if draft.numel() != config["target"]["vocab_size"]:     # vLLM loads d2t only for a smaller draft vocabulary
        out["d2t"] = d2t_offsets(draft)
        # speculators slices the verifier's lm_head by t2d (vLLM skips it), as in EAGLE-3's layout
        out["t2d"] = t2d_mask(draft, config["target"]["vocab_size"])
    return cast(out, dtype)


def write_vllm(config, weights, target, dtype, checkpoint):
    ids = output_convention(config["target_layer_ids"], "vLLM's DFlash")
    mask = config["architecture"]["mask_token_id"]
    cfg = {"architectures": ["DFlashDraftModel"], **qwen3_fields(config, dtype),
           "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids, "causal": False}}
    notes = (f"DFlash: a block of {config['drafter']['block_size']} (the target's next token and "
             f"{config['drafter']['block_size'] - 1} masks, mask token {mask}), non-causal inside the block, its "
             f"keys and values from target layers {ids} (vLLM's dflash_config names a layer by its output: "
             f"draftsmith's hidden_states ids {config['target_layer_ids']} minus one). The embedding is the "
             "target's. Serve it with num_speculative_tokens = block_size - 1, the block it was trained on.")
    return ({"model.safetensors": export_tensors(config, weights, dtype, "vllm")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "DFlash drafter for vLLM",
                                                       serve_command(config, "vllm"), notes)})


def write_speculators(config, weights, target, dtype, checkpoint):
    K = config["drafter"]["block_size"] - 1
    layer = qwen3_fields(config, dtype)
    cfg = {"architectures": ["DFlashDraftModel"], "speculators_model_type": "dflash", "speculators_version": "0.2.0",
           "speculators_config": speculators_config(config, "dflash", K),
           "transformer_layer_config": layer, "draft_vocab_size": layer["draft_vocab_size"],
           "target_hidden_size": layer["target_hidden_size"], "block_size": config["drafter"]["block_size"],
           "aux_hidden_state_layer_ids": list(config["target_layer_ids"]),
           "mask_token_id": config["architecture"]["mask_token_id"], "sliding_window_non_causal": True,
           "torch_dtype": layer["torch_dtype"]}
    notes = ("speculators names the fused layers by a decoder layer's input (aux_hidden_state_layer_ids, "
             "draftsmith's convention); vLLM subtracts one for its dflash_config.")
    return ({"model.safetensors": export_tensors(config, weights, dtype, "speculators")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "DFlash drafter (speculators format)",
                                                       serve_command(config, "speculators"), notes)})


def serve_command(config: dict, fmt: str) -> str:
    K = config["drafter"]["block_size"] - 1
    if fmt == "vllm":
        return (f"""vllm serve TARGET_DIR --speculative-config '{{"method": "dflash", "model": "THIS_DIR", """
                f""""num_speculative_tokens": {K}}}'""")
    return "vllm serve THIS_DIR   # vLLM reads the verifier and the speculative settings from this config"
