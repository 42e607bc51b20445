"""What every drafter shares: the training step's result, the decoding context, the checkpoint.

A drafter is an nn.Module with
- `kind` (str) and `config` (its dataclass),
- `required_layers` (target layer ids it reads, docs/design.md convention),
- `loss(batch) -> StepOutput` for training, and `loss_counts(batch)`: how many tokens each of
  the loss's terms averages over, from the batch's masks alone (see `term_denominators`),
- `reset()` and `propose(context) -> DraftTree` for decoding.
Only the drafter's own weights are its state; the target's modules it uses
(embedding, lm_head) are held outside the module tree and never saved.

Checkpoint directory (docs/design.md): config.json (kind, hyperparameters, target
identity, layer ids, draftsmith version), model.safetensors (trainable
weights only), recipe.yaml, and state/ while training.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftsmith.heads.infra.config import config_from_dict
from draftsmith.heads.infra.files import save_tensors_atomic, sha256_file, write_atomic
from draftsmith.heads.infra.version import __version__
from draftsmith.heads.registry import drafter_class
from draftsmith.heads.runtime.target import Target, TargetError, TargetIdentity

CONFIG_FILE = "config.json"
RESERVED = ("kind", "draftsmith_version", "target", "target_source", "target_adapter", "target_chat",
            "target_architecture",
            "target_layer_ids", "drafter", "architecture", "weights_sha256")
WEIGHTS_FILE = "model.safetensors"
ADAPTER_IN_CHECKPOINT = "adapter"      # target_adapter relative to the checkpoint: a LoRA trained with it


class CheckpointError(ValueError):
    """A checkpoint that is damaged or incomplete."""


@dataclass
class StepOutput:
    """One training step of a drafter."""

    loss: torch.Tensor       # scalar, what backward() is called on
    correct: torch.Tensor    # [k] draft positions whose top-1 equals the target's token
    counted: torch.Tensor    # [k] draft positions scored


def term_denominators(batch: dict, counts: torch.Tensor) -> torch.Tensor:
    """What each loss term's sum over tokens is divided by.

    Alone, a micro-batch divides by its own token counts (`counts`, [terms]).  In training the loop
    hands over `batch["loss_denominators"]`: each term's token count over the whole optimizer step
    (every micro-batch of the accumulation, every process), as integers, and `batch["loss_share"]`, the
    number of micro-batch gradients accelerate averages (processes x grad_accum), by which the counts
    are divided, so that the applied gradient is the gradient of one mean over all those tokens.  A
    token then weighs the same whether its row sits in a short micro-batch or a long one, in one
    process or in eight.  The counts stay integers until here: FSDP's mixed precision casts every
    floating-point tensor of a forward's inputs to bf16, which would round a count of 1,000 tokens."""
    given = batch.get("loss_denominators")
    if given is None:
        return counts.float()
    return given.to(counts.device, torch.float32) / batch.get("loss_share", 1)


def divide(total: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """total / denominator, and 0 for a term no token of the step scores (its sum is 0 as well)."""
    return total / denominator.clamp(min=1e-6)


@dataclass
class DraftContext:
    """What the verifier tells a drafter after each target forward.

    tokens [m]: tokens just committed to the target's cache (the prompt after
    prefill; the root and the accepted path after a verification step).
    hidden: {layer id: [m, d]} the target's hidden states at those tokens.
    next_token: the token sampled after them (the next root, not in the cache).
    position: the position id of next_token.
    """

    tokens: torch.Tensor
    hidden: dict[int, torch.Tensor]
    next_token: int
    position: int


def describe(drafter) -> dict:
    """The part of a checkpoint's config.json that says what its tensors are: kind, drafter settings,
    target shape fields and architecture (what `parameter_layout` reads)."""
    architecture = drafter.architecture()
    return {"kind": drafter.checkpoint_kind, "drafter": dataclasses.asdict(drafter.config),
            "target": drafter.target_identity.to_dict(), **({"architecture": architecture} if architecture else {})}


def save_drafter(drafter, directory: Path, extra: dict | None = None, state: dict | None = None) -> None:
    """Write config.json and model.safetensors (the drafter's own weights only), atomically per file.

    `state`: the weights to write when they are not the module's own (gathered from FSDP / ZeRO-3 shards)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().clone() for k, v in (state or drafter.state_dict()).items()}   # owned, contiguous
    kind = drafter.checkpoint_kind        # Medusa-2 heads load as Medusa
    save_tensors_atomic(state, directory / WEIGHTS_FILE, metadata={"format": "pt", "kind": kind})
    model_config = drafter.target.model.config
    identity, adapter = drafter.target_identity, drafter.target.adapter
    adapter = str(adapter.path) if adapter else None
    trained_adapter = drafter.save_adapter(directory)      # the LoRA it trained, beside it: base + that is its target
    if trained_adapter is not None:
        identity = dataclasses.replace(identity, adapter_sha256=trained_adapter)
        adapter = ADAPTER_IN_CHECKPOINT
    described = describe(drafter)
    config = {
        "kind": kind,
        "draftsmith_version": __version__,
        "target": identity.to_dict(),
        "target_source": drafter.target.source,
        "target_adapter": adapter,
        "target_chat": drafter.target.chat,     # its prompt format, if not the model's own
        "target_architecture": ((getattr(model_config, "architectures", None) or [None])[0]
                                or type(drafter.target.model).__name__),
        "target_layer_ids": drafter.fused_layer_ids(),
        "drafter": described["drafter"],
        **({"architecture": described["architecture"]} if "architecture" in described else {}),
        **{k: v for k, v in drafter.metadata.items() if k not in RESERVED},
        **(extra or {}),
        "weights_sha256": sha256_file(directory / WEIGHTS_FILE),
    }
    write_atomic(directory / CONFIG_FILE, json.dumps(config, indent=2))


REQUIRED_KEYS = {"kind": None, "drafter": None,      # target: the identity fields a checkpoint must have
                 "target": tuple(k for k, f in TargetIdentity.__dataclass_fields__.items()
                                 if f.default is dataclasses.MISSING)}


def read_config(directory: Path) -> dict:
    """A checkpoint's config.json, checked for the keys draftsmith needs (each error names the file and key)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"'{directory}' is not a draftsmith checkpoint: no {CONFIG_FILE}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); the checkpoint is damaged: restore it or "
                              "train again") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(config).__name__}")
    for key, inner in REQUIRED_KEYS.items():
        if key not in config:
            raise CheckpointError(f"{path} has no '{key}' key; the checkpoint is damaged or not draftsmith's")
        missing = [k for k in inner or () if not isinstance(config[key], dict) or k not in config[key]]
        if missing:
            raise CheckpointError(f"{path}: '{key}' has no {', '.join(repr(k) for k in missing)}; the checkpoint is "
                                  "damaged or from an incompatible draftsmith")
    if config.get("target_adapter") and not Path(config["target_adapter"]).is_absolute():    # moves with it
        config["target_adapter"] = str((Path(directory) / config["target_adapter"]).resolve())
    return config


_WARNED_UNVERIFIED: set[str] = set()


def read_weights(directory: Path, config: dict | None = None, require_checksum: bool = False) -> dict:
    """model.safetensors, checked against the checksum config.json recorded when it was written."""
    directory = Path(directory)
    config = config or read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"checkpoint '{directory}' has no {WEIGHTS_FILE}")
    recorded = config.get("weights_sha256")
    if not recorded:
        message = (f"checkpoint '{directory}' has no weights checksum (weights_sha256 in {CONFIG_FILE}): it cannot "
                   "be verified")
        if require_checksum or os.environ.get("DRAFTSMITH_REQUIRE_CHECKSUM", "") not in ("", "0"):
            raise CheckpointError(f"{message}; restore its config.json from a copy, or train again "
                                  "(eval.require_checksum / DRAFTSMITH_REQUIRE_CHECKSUM refuse it)")
        if str(weights.resolve()) not in _WARNED_UNVERIFIED:
            _WARNED_UNVERIFIED.add(str(weights.resolve()))
            logging.getLogger("draftsmith").warning("%s; its bytes are used as they are (set eval.require_checksum=true "
                                                    "or DRAFTSMITH_REQUIRE_CHECKSUM=1 to refuse it)", message)
    elif sha256_file(weights) != recorded:
        raise CheckpointError(f"damaged checkpoint: {weights} does not match the checksum in {CONFIG_FILE} (its "
                              "bytes changed after it was saved); restore it from a copy or train again")
    try:
        return load_file(str(weights))
    except Exception as err:     # safetensors raises its own error type for a truncated or garbled file
        raise CheckpointError(f"damaged checkpoint: {weights} cannot be read ({err}); restore it from a copy or "
                              "train again") from None


def target_path(config: dict, given: str | None = None) -> str:
    """Where a checkpoint's target is loaded from: `given`, else where it was trained from, else its name."""
    return given or config.get("target_source") or config["target"]["name"]


def checkpoint_target(config: dict, dtype, device, path: str | None = None, adapter: str | None = None,
                      layers: bool = True, device_map=None) -> Target:
    """The target a checkpoint was trained against, or `path`; with the checkpoint's LoRA adapter, or
    `adapter` ('none': the bare target); layers=False: its embedding and lm_head only, where possible."""
    path = target_path(config, path)
    adapter = config.get("target_adapter") if adapter is None else (None if adapter == "none" else adapter)
    return Target.load(path, dtype, device, adapter=adapter, layers=layers, device_map=device_map,
                       chat=config.get("target_chat"))


def drafter_from_state(cls, settings, target: Target, state: dict, where: str):
    """A `cls` drafter with `settings` on `target`, holding the weights (and draft-vocabulary maps) of
    `state`, or an error naming `where` when they do not fit its shapes."""
    drafter = cls(settings, target)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise TargetError(f"{where} does not fit a {drafter.kind} drafter with its config: "
                          f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return drafter


def load_drafter(directory: Path, target: Target, require_checksum: bool = False):
    """Rebuild a drafter from its checkpoint against `target`; a different target is an error
    (require_checksum: a checkpoint without a weights checksum too, read_weights)."""
    directory = Path(directory)
    config = read_config(directory)
    cls = drafter_class(config.get("kind"), f"checkpoint '{directory}'")
    TargetIdentity.from_dict(config["target"]).require_same(target.identity, f"drafter '{directory}'")
    drafter = drafter_from_state(cls, config_from_dict(cls.config_class, config["drafter"],
                                                       f"{directory}/{CONFIG_FILE}"),
                                 target, read_weights(directory, config, require_checksum), f"checkpoint '{directory}'")
    drafter.metadata = config
    return drafter.to(target.device).eval()


def warm_start(drafter, directory: str | Path) -> None:
    """Load a checkpoint's weights into a freshly built drafter (drafter.init_from): the same kind, the
    same target, the same shapes, or an error naming what differs."""
    directory = Path(directory)
    config = read_config(directory)
    kind = drafter.checkpoint_kind
    if config["kind"] != kind and config["kind"] not in drafter.warm_starts_from:
        raise CheckpointError(f"drafter.init_from '{directory}' holds a {config['kind']} drafter; this recipe trains "
                              f"a {drafter.kind}")
    identity = TargetIdentity.from_dict(config["target"])
    identity.require_same(dataclasses.replace(drafter.target_identity, adapter_sha256=identity.adapter_sha256),
                          f"drafter.init_from '{directory}'")
    theirs, mine = config.get("target_layer_ids"), drafter.fused_layer_ids()
    if theirs is not None and list(theirs) != list(mine):
        raise CheckpointError(f"drafter.init_from '{directory}' reads target layers {list(theirs)}, this recipe's "
                              f"drafter {list(mine)}: the same shapes over other layers would start from weights "
                              f"fitted to other features; set drafter.layer_ids: {list(theirs)}")
    state, own = read_weights(directory, config), drafter.state_dict()
    differ = [f"{k}: {tuple(state[k].shape)} there, {tuple(own[k].shape)} here" for k in own
              if k in state and state[k].shape != own[k].shape]
    missing = sorted(set(own) - set(state) - set(drafter.new_on_warm_start if config["kind"] != kind else ()))
    extra = sorted(set(state) - set(own))
    if differ or missing or extra:
        raise CheckpointError(f"drafter.init_from '{directory}' does not fit this recipe's drafter ("
                              + "; ".join(differ[:4] + [f"missing {missing[:4]}"] * bool(missing)
                                          + [f"not in this drafter {extra[:4]}"] * bool(extra))
                              + "): give the drafter section the checkpoint's settings (draftsmith show)")
    drafter.load_state_dict({k: state[k] for k in own if k in state}, strict=False)
