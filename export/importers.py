"""Read a drafter written for a serving stack back into a draftsmith checkpoint: the inverse of
export/writers.py, for warm starts from published drafters (`draftsmith import`, then
`drafter.init_from=CHECKPOINT` in a recipe).

Formats: `vllm` (Medusa and EAGLE-3), `speculators`, `sglang` (what SpecForge writes), `trtllm`
(Model Optimizer's HF EAGLE-3 layout), `medusa-original` (FasterDecoding) and `eagle` (the EAGLE
repository's own EAGLE-3 layout, SafeAILab/EAGLE: the tensors vLLM's loader reads plus the target's
embedding, and no layer ids in config.json, because that code always fuses hidden_states at layers
(2, N//2, N-3)).  Tensor names come from the drafter's declared layout through the same rules the
writers use (export/layouts.py).  The layer-id conventions are converted (SGLang and TensorRT-LLM
name a fused layer by the decoder layer whose output it takes: draftsmith's id is that plus one), the
vocabulary maps are checked against each other and against the target, and every tensor must fit
the drafter draftsmith builds for that target.  Weights are read from safetensors only.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.heads.drafter import describe, save_drafter
from draftsmith.heads.files import as_disk_full, swap_directory
from draftsmith.heads.outputs import EXPORT_MARK, IMPORT_KEY
from draftsmith.heads.target import Target

from .layouts import VOCABULARY, names

FORMATS = ("vllm", "speculators", "sglang", "trtllm", "medusa-original", "eagle")
OUTPUT_CONVENTION = ("sglang", "trtllm")         # layer ids name a decoder layer's output
CARRIED = {"embed_tokens.weight"}                 # the target's own embedding some formats carry: checked, not kept


class ImportError_(ValueError):
    """An export that cannot be read as a draftsmith drafter for this target."""


def _weights(source: Path) -> dict[str, torch.Tensor]:
    files = sorted(source.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in source.glob("*.bin")) + sorted(p.name for p in source.glob("*.pt"))
        raise ImportError_(f"'{source}' holds no .safetensors weights"
                           + (f" (only {', '.join(pickled[:3])}: pickled files are never loaded; convert them to "
                              "safetensors where you trust them, then import)" if pickled else ""))
    weights = {}
    for f in files:
        weights.update({k: v.float() if v.is_floating_point() else v for k, v in _load(f).items()})
    return weights


def _load(path: Path) -> dict[str, torch.Tensor]:
    """One safetensors file; a truncated or garbled one is named."""
    try:
        return load_file(str(path))
    except Exception as err:          # safetensors raises its own error type
        raise ImportError_(f"'{path}' cannot be read as safetensors ({str(err).splitlines()[0]}); the export is "
                           "damaged or incomplete: export or download it again") from None


MEDUSA_FORMATS = ("vllm", "medusa-original")


def read_export_config(source: Path) -> dict:
    """The export's config.json, as a JSON object (each problem named with the file)."""
    path = Path(source) / "config.json"
    if not path.is_file():
        raise ImportError_(f"'{source}' is not an export: no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ImportError_(f"{path} is not valid JSON ({err}); the export is damaged: export it again") from None
    if not isinstance(config, dict):
        raise ImportError_(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def check_format(source: Path, config: dict, fmt: str) -> bool:
    """--from must agree with what the export says it is: draftsmith's own manifest, or a Medusa config.
    True when draftsmith's manifest confirms the format."""
    manifest_file = Path(source) / EXPORT_MARK
    if manifest_file.is_file():
        try:
            written = json.loads(manifest_file.read_text(encoding="utf-8")).get("format")
        except (ValueError, UnicodeDecodeError, AttributeError):
            written = None
        if written and written != fmt:
            raise ImportError_(f"'{source}' was exported by draftsmith as '{written}' ({EXPORT_MARK}), not '{fmt}': "
                               f"import it with --from {written}")
    medusa = config.get("model_type") == "medusa" or "medusa_num_heads" in config
    if medusa and fmt not in MEDUSA_FORMATS:
        raise ImportError_(f"'{source}' holds a Medusa drafter, which no '{fmt}' export can be; import it with "
                           f"--from {'medusa-original' if 'medusa_num_heads' in config else 'vllm'}")
    if fmt == "medusa-original" and "medusa_num_heads" not in config:
        raise ImportError_(f"'{source}' is not a FasterDecoding Medusa export (its config.json has no "
                           "medusa_num_heads)" + ("; it is vLLM's Medusa layout: import it with --from vllm"
                                                  if config.get("model_type") == "medusa" else ""))
    return bool(manifest_file.is_file() and written == fmt)


def import_drafter(source: str | Path, fmt: str, target: Target):
    """The drafter an export in `fmt` holds, built for `target` (weights checked name by name)."""
    source = Path(source)
    if fmt not in FORMATS:
        raise ImportError_(f"unknown format '{fmt}': draftsmith imports {', '.join(FORMATS)}")
    config = read_export_config(source)
    confirmed = check_format(source, config, fmt)
    if fmt == "medusa-original":
        weights = _load(source / "medusa_lm_head.safetensors") if (
            source / "medusa_lm_head.safetensors").is_file() else _weights(source)
        return _medusa_original(config, {k: v.float() for k, v in weights.items()}, target)
    weights = _weights(source)
    if config.get("model_type") == "medusa":
        return _medusa_vllm(config, weights, target)
    if fmt == "eagle" and "d2t" not in weights:
        raise ImportError_(f"'{source}' is not an EAGLE-3 drafter (no d2t): draftsmith reads the EAGLE repository's "
                           "EAGLE-3 layout; its EAGLE-1/2 drafters (fc with a bias, layers.0.*) have no import yet")
    return _eagle3(config, weights, target, fmt, confirmed)


def _fill(drafter, weights: dict, fmt: str, vocabulary: torch.Tensor, skip: set = frozenset()) -> None:
    """Load `weights` (the format's names) into `drafter` through the layout's renaming rules."""
    theirs_of = names(describe(drafter), fmt)
    state = {ours: weights[theirs] for ours, theirs in theirs_of.items() if theirs in weights}
    missing = sorted(theirs for theirs in theirs_of.values() if theirs not in weights)
    unknown = sorted(set(weights) - set(theirs_of.values()) - set(skip))
    own = drafter.state_dict()
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state if state[k].shape != own[k].shape]
    if missing or unknown or wrong:
        raise ImportError_(f"the export does not fit a {drafter.kind} drafter for this target: missing {missing[:4]}, "
                           f"unexpected {unknown[:4]}, shapes {wrong[:4]}")
    drafter.load_state_dict({**state, VOCABULARY: vocabulary}, strict=True)


def _medusa_original(config: dict, weights: dict, target: Target):
    from draftsmith.heads.medusa import Medusa, MedusaConfig

    heads, layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    drafter = Medusa(MedusaConfig(num_heads=heads, num_layers=layers, lm_head="own"), target)
    _fill(drafter, weights, "medusa-original", torch.arange(target.vocab_size))
    return drafter


def _medusa_vllm(config: dict, weights: dict, target: Target):
    from draftsmith.heads.medusa import Medusa, MedusaConfig

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
    if shared:                  # the one shared head is the target's own: it must be this target's
        written = weights["lm_heads.0.weight"]
        own = target.lm_head.weight.detach().float().cpu()[draft]
        if written.shape != own.shape or not torch.allclose(written, own, atol=1e-2, rtol=1e-2):
            raise ImportError_("the export's shared head is not this target's lm_head: import it against the target "
                               "it was made for (--target)")
    _fill(drafter, weights, "vllm", draft, skip={"token_map", "lm_heads.0.weight"} if shared else {"token_map"})
    return drafter


def _eagle3(config: dict, weights: dict, target: Target, fmt: str, confirmed: bool = False):
    from draftsmith.heads.eagle3 import Eagle3, Eagle3Config, default_layer_ids

    layer = config.get("transformer_layer_config", config)              # speculators nests the layer's fields
    if config.get("norm_before_residual") is True:
        raise ImportError_("this speculators drafter normalises before the residual (norm_before_residual: true), "
                           "which draftsmith's EAGLE-3 layer does not do")
    ids = (config.get("eagle_aux_hidden_state_layer_ids")
           or config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"))
    if not ids and fmt in ("vllm", "eagle"):      # vLLM then fuses its default layers, and the EAGLE code always
        ids = default_layer_ids(target.num_layers)     # does: (2, N//2, N-3), the inputs of those decoder layers
    if not ids or len(ids) != 3:
        raise ImportError_("the export names no 3 fused target layers (eagle_aux_hidden_state_layer_ids)")
    ids = _convention_ids([int(i) for i in ids], fmt, target.num_layers, confirmed)
    target.check_layer_ids(ids, "the export's fused layers (draftsmith's hidden_states ids)")
    d2t = weights["d2t"].long()
    draft = torch.arange(d2t.numel()) + d2t                              # target id = draft id + d2t[draft id]
    if int(draft.max()) >= target.vocab_size or (draft.diff() <= 0).any():
        raise ImportError_("d2t does not map the draft vocabulary to ascending ids inside the target's vocabulary")
    if "t2d" in weights:
        t2d = weights["t2d"].bool()
        if t2d.numel() != target.vocab_size or int(t2d.sum()) != draft.numel() or not bool(t2d[draft].all()):
            raise ImportError_("t2d and d2t disagree (t2d must mark exactly the target ids d2t maps to)")
    if "embed_tokens.weight" in weights:          # the target's embedding, carried along: it must be this target's
        own = target.embed_tokens.weight.detach().float().cpu()
        carried = weights["embed_tokens.weight"]
        if carried.shape != own.shape or not torch.allclose(carried, own, atol=1e-2, rtol=1e-2):
            raise ImportError_("the export carries an embedding that is not this target's: import it against the "
                               "target it was trained for (--target)")
    drafter = Eagle3(Eagle3Config(layer_ids=ids, draft_vocab_size=draft.numel(),
                                  intermediate_size=int(layer["intermediate_size"])), target)
    _fill(drafter, weights, fmt, draft, skip={"d2t", "t2d"} | CARRIED)
    return drafter


def _convention_ids(written: list[int], fmt: str, num_layers: int, confirmed: bool = False) -> list[int]:
    """The export's layer ids in draftsmith's convention (the input of decoder layer i).  SGLang and
    TensorRT-LLM name a layer's output (ours minus one).  Ids that are exactly the other convention's
    default for this target's depth, and not this one's, mean a wrong --from: refused."""
    from draftsmith.heads.eagle3 import default_layer_ids

    output = fmt in OUTPUT_CONVENTION
    default = default_layer_ids(num_layers)
    expected = [i - 1 for i in default] if output else default
    other = default if output else [i - 1 for i in default]
    if not confirmed and written != expected and written == other:
        others = "vllm, speculators or eagle" if output else "sglang or trtllm"
        raise ImportError_(f"the export's fused layers {written} are the default of the other layer-id convention for "
                           f"this {num_layers}-layer target ({others}: '{'input' if output else 'output'} of layer i'), "
                           f"but --from {fmt} reads them as the {'output' if output else 'input'} of layer i; give "
                           "the format it was written in (--from)")
    converted = [i + 1 for i in written] if output else written
    logging.getLogger("draftsmith").info(
        "import: --from %s names a decoder layer's %s: the export's layer ids %s are draftsmith's %s", fmt,
        "output" if output else "input", written, converted)
    return converted


def import_checkpoint(source: str | Path, fmt: str, out_dir: str | Path, target: Target) -> Path:
    """Write the imported drafter as a draftsmith checkpoint (config.json, model.safetensors, README.md)."""
    from .card import write_card

    out_dir = Path(out_dir)
    drafter = import_drafter(source, fmt, target)
    drafter.metadata[IMPORT_KEY] = {"path": str(Path(source).resolve()), "format": fmt}
    tmp = out_dir.with_name(out_dir.name + ".tmp-import")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save_drafter(drafter, tmp)
        write_card(tmp)
        swap_directory(tmp, out_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise as_disk_full(err, tmp, "the imported checkpoint", "free some space or choose another directory, then "
                           "import again (nothing was written)") from None
    return out_dir
