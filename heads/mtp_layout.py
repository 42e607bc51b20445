"""Where a target keeps its MTP layers and how vLLM serves them (heads/mtp.py is the drafter).

Reading: the family's naming (`MTP_NAMING`), the target checkpoint's index, every tensor of depth 0 checked
by name and shape against the target's last decoder layer before any is read, and transformers' own
`MtpLayer` filled through the family's conversions.  Serving: the layer written back in the checkpoint's
own names beside the target's config.json (vLLM's `method: mtp`), or stitched into a saved target."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from draftsmith.heads.formats import cast, readme
from draftsmith.heads.runtime.target import Target

# model_type -> where depth i of N decoder layers keeps its tensors
MTP_NAMING = {
    "deepseek_v3": "model.layers.{layer}.",
    "glm4_moe": "model.layers.{layer}.",
}


class MtpError(ValueError):
    """A target whose MTP layers cannot be read (none, an unknown naming, a missing or misshapen tensor)."""


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
