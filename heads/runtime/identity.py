"""What a target is, as a checkpoint records it: the identity a drafter is bound to, and the hashes
that make it (the whole embedding and lm_head; a strided sample of every parameter)."""
from __future__ import annotations

import hashlib
from dataclasses import MISSING, asdict, dataclass

import torch
from torch import nn


class TargetError(ValueError):
    """A target that cannot be loaded, or that does not match a drafter."""


@dataclass(frozen=True)
class TargetIdentity:
    """What a drafter was trained against: recorded in every checkpoint."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    weights_sha256: str  # of the embedding and lm_head, whole, in bf16
    layers_sha256: str = ""  # of a strided sample (256 values) of every parameter, in bf16 ("" in old checkpoints)
    adapter_sha256: str = ""  # of the LoRA adapter on the base (heads/runtime/adapter.py); "" = none

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TargetIdentity:
        return cls(**{k: d[k] for k, f in cls.__dataclass_fields__.items() if k in d or f.default is MISSING})

    def require_same(self, other: TargetIdentity, what: str) -> None:
        """Raise unless `other` is the same target (the name may differ: a path moves).  A checkpoint
        written before layers_sha256 existed is compared on the rest."""
        fields = ["vocab_size", "hidden_size", "num_layers", "weights_sha256"]
        if self.layers_sha256 and other.layers_sha256:
            fields.append("layers_sha256")
        diffs = [f"{f}: {getattr(self, f)} vs {getattr(other, f)}" for f in fields if getattr(self, f) != getattr(other, f)]
        if diffs == [f"layers_sha256: {self.layers_sha256} vs {other.layers_sha256}"]:
            diffs[0] += " (same embedding and lm_head, other layer weights: a fine-tune of the same base?)"
        if self.adapter_sha256 != other.adapter_sha256:
            diffs.append(f"LoRA adapter: {self.adapter_sha256 or 'none'} vs {other.adapter_sha256 or 'none'} "
                         "(target.adapter=DIR puts one on the target; eval and bench take --adapter DIR|none)")
        if diffs:
            raise TargetError(
                f"{what} was made for target '{self.name}' but the loaded target is '{other.name}' "
                f"({'; '.join(diffs)}). Load the target it was trained on (target.path=...) or retrain."
            )


def weights_hash(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def sampled_hash(model: nn.Module, samples: int = 256) -> str:
    """A hash of `samples` evenly strided values of every parameter, in bf16: any fine-tune changes it,
    and it costs milliseconds however large the model (the values are gathered on the model's device)."""
    digest = hashlib.sha256()
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        picked = flat[:: max(1, flat.numel() // samples)][:samples]
        digest.update(picked.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


def text_config(model: nn.Module):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def base_identity(model: nn.Module, name: str) -> TargetIdentity:
    """The identity of a model without an adapter."""
    config = text_config(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return TargetIdentity(
        name=name, model_type=str(config.model_type), vocab_size=int(head.weight.shape[0]),
        hidden_size=int(config.hidden_size), num_layers=int(config.num_hidden_layers),
        weights_sha256=weights_hash(embed.weight, head.weight), layers_sha256=sampled_hash(model))
