"""The two Medusa layouts the serving stacks load, as the Medusa drafter writes them.

vLLM: `blocks.{h}.layers.{l}`, `lm_heads.{h}`, `token_map` with `truncated_vocab_size`, and
`original_lm_head` for one shared head.  FasterDecoding (TGI, TensorRT-LLM's converter):
medusa_lm_head.safetensors with `{h}.{l}.linear.*` and each head's projection after its layers,
`{h}.{L}.weight`.  heads/medusa.py declares the formats (renaming rules, readers) and uses these writers.
"""
from __future__ import annotations

import logging

from draftsmith.heads.formats import ExportError, cast, dtype_name, readme, renamed

log = logging.getLogger(__name__)


def plain_heads(config: dict, fmt: str) -> None:
    conditioning = config["drafter"].get("conditioning", "none")
    if conditioning != "none":
        raise ExportError(f"this checkpoint has {conditioning}-conditioned Medusa heads (drafter.conditioning: "
                          f"{conditioning}), which the '{fmt}' Medusa format cannot hold (its heads read the hidden "
                          "state only); train with drafter.conditioning=none to export, or serve it with draftsmith")


def write_vllm(config, weights, target, dtype, checkpoint):
    plain_heads(config, "vllm")
    arch, info = config["drafter"], config["target"]
    heads, layers, vocab = arch["num_heads"], arch["num_layers"], info["vocab_size"]
    draft = weights["draft_to_target"]
    truncated = draft.numel() < vocab
    shared = arch["lm_head"] == "shared"
    if truncated and not shared:
        raise ExportError("vLLM's Medusa takes a reduced draft vocabulary only with one shared head "
                          "(original_lm_head); this checkpoint has one trained head per position over "
                          f"{draft.numel()} tokens. Retrain with drafter.lm_head: shared, or draft_vocab_size: null")
    out = renamed(config, weights, "vllm")
    if shared:
        full = target.lm_head.weight.detach().float().cpu()
        out["lm_heads.0.weight"] = full[draft] if truncated else full
    if truncated:
        out["token_map"] = draft.long()
        log.warning("this Medusa export has a reduced draft vocabulary (token_map); vLLM 0.32 fails to load "
                    "it ('weights not initialized: token_map'). For vLLM 0.32 train with drafter.draft_vocab_size: null")
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": info["hidden_size"],
           "vocab_size": vocab, "num_heads": heads, "num_hidden_layers": layers, "medusa_fc_bias": True,
           "truncated_vocab_size": int(draft.numel()), "original_lm_head": shared, "torch_dtype": dtype_name(dtype)}
    text = readme(config, checkpoint, "Medusa heads for vLLM", serve_vllm(config),
                  "vLLM's Medusa drafts a chain of the heads' top-1 tokens (no tree).")
    return {"model.safetensors": cast(out, dtype)}, {"config.json": cfg, "README.md": text}


def write_original(config, weights, target, dtype, checkpoint):
    plain_heads(config, "medusa-original")
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
    out = renamed(config, weights, "medusa-original")
    if arch["lm_head"] == "shared":         # every head projects through the target's own lm_head
        out |= {f"{h}.{layers}.weight": target.lm_head.weight.detach().float().cpu() for h in range(heads)}
    cfg = {"medusa_num_heads": heads, "medusa_num_layers": layers, "base_model_name_or_path": info["name"],
           "hidden_size": info["hidden_size"], "vocab_size": vocab}
    text = readme(config, checkpoint, "Medusa heads (FasterDecoding layout)", serve_original(config))
    return {"medusa_lm_head.safetensors": cast(out, dtype)}, {"config.json": cfg, "README.md": text}


def serve_vllm(config: dict) -> str:
    return (f"""vllm serve TARGET_DIR --speculative-config '{{"method": "medusa", "model": "THIS_DIR", """
            f""""num_speculative_tokens": {config['drafter']['num_heads']}}}'""")


def serve_original(config: dict) -> str:
    return f"""# TGI
text-generation-launcher --model-id THIS_DIR   # with base_model_name_or_path pointing at the target
# TensorRT-LLM: convert_checkpoint.py --model_dir TARGET_DIR --medusa_model_dir THIS_DIR --num_medusa_heads \
{config['drafter']['num_heads']}"""


def vllm_refuses(config: dict, version: str) -> str | None:
    if config["drafter"].get("draft_vocab_size") and version.startswith("0.32"):
        return (f"vLLM {version} cannot load a Medusa drafter with a reduced draft vocabulary ('weights not "
                "initialized: token_map'); this checkpoint has one. Train it with drafter.draft_vocab_size: null "
                "for vLLM, or bench it with --engine draftsmith")
    return None


def shared_head(config: dict) -> bool:
    return config["drafter"]["lm_head"] == "shared"       # the export carries the target's lm_head
