"""What every drafter shares: the training step's result, the decoding context, the checkpoint.

A drafter is an nn.Module with
- `kind` (str) and `config` (its dataclass),
- `required_layers` (target layer ids it reads, docs/design.md convention),
- `loss(batch) -> StepOutput` for training,
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
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .target import Target, TargetError, TargetIdentity

CONFIG_FILE = "config.json"
RESERVED = ("kind", "draftsmith_version", "target", "target_source", "target_layer_ids", "drafter", "architecture")
WEIGHTS_FILE = "model.safetensors"


@dataclass
class StepOutput:
    """One training step of a drafter."""

    loss: torch.Tensor       # scalar, what backward() is called on
    correct: torch.Tensor    # [k] draft positions whose top-1 equals the target's token
    counted: torch.Tensor    # [k] draft positions scored


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


def registry() -> dict:
    """kind -> drafter class (imported here, not at the top, so each drafter file stays independent)."""
    from .eagle import Eagle
    from .eagle3 import Eagle3
    from .medusa import Medusa

    return {cls.kind: cls for cls in (Medusa, Eagle, Eagle3)}


def config_from_dict(config_cls, values: dict, where: str):
    """Build a config dataclass, rejecting unknown keys with the list of valid ones."""
    names = [f.name for f in dataclasses.fields(config_cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; valid keys: {names}")
    return config_cls(**values)


def save_drafter(drafter, directory: Path, extra: dict | None = None, state: dict | None = None) -> None:
    """Write config.json and model.safetensors (the drafter's own weights only), atomically per file.

    `state`: the weights to write when they are not the module's own (gathered from FSDP / ZeRO-3 shards)."""
    from draftsmith import __version__

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in (state or drafter.state_dict()).items()}
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "kind": drafter.kind})
    tmp.replace(directory / WEIGHTS_FILE)
    config = {
        "kind": drafter.kind,
        "draftsmith_version": __version__,
        "target": drafter.target_identity.to_dict(),
        "target_source": getattr(drafter.target, "source", drafter.target_identity.name),
        "target_layer_ids": list(getattr(drafter, "layer_ids", drafter.required_layers)),
        "drafter": dataclasses.asdict(drafter.config),
        **({"architecture": drafter.architecture()} if hasattr(drafter, "architecture") else {}),
        **{k: v for k, v in getattr(drafter, "metadata", {}).items() if k not in RESERVED},
        **(extra or {}),
    }
    tmp = directory / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(config, indent=2))
    tmp.replace(directory / CONFIG_FILE)


def read_config(directory: Path) -> dict:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"'{directory}' is not a draftsmith checkpoint: no {CONFIG_FILE}")
    return json.loads(path.read_text())


def load_drafter(directory: Path, target: Target):
    """Rebuild a drafter from its checkpoint against `target`; a different target is an error."""
    directory = Path(directory)
    config = read_config(directory)
    kinds = registry()
    if config.get("kind") not in kinds:
        raise ValueError(f"checkpoint '{directory}' has drafter kind '{config.get('kind')}'; known: {sorted(kinds)}")
    TargetIdentity.from_dict(config["target"]).require_same(target.identity, f"drafter '{directory}'")
    cls = kinds[config["kind"]]
    drafter = cls(config_from_dict(cls.config_class, config["drafter"], f"{directory}/{CONFIG_FILE}"), target)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"checkpoint '{directory}' has no {WEIGHTS_FILE}")
    state = load_file(str(weights))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise TargetError(f"checkpoint '{directory}' does not fit a {config['kind']} drafter with its config: "
                          f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    drafter.metadata = config
    return drafter.to(target.device).eval()
