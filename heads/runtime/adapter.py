"""A LoRA adapter on the target: base model + adapter is the model the drafter must match.

Users often serve a LoRA fine-tune of a base model, merged or with vLLM's `--enable-lora`.  A drafter
distilled on the bare base drafts for the wrong distribution, so the adapter is part of the target
everywhere (`target.adapter=DIR`): data, training, eval, bench and export load it, and the target's
identity records a hash of its config and weights (`TargetIdentity.adapter_sha256`), so a drafter
made against base + adapter is refused against the bare base, and the other way round.

Only LoRA adapters in peft's own format are read (`adapter_config.json` and
`adapter_model.safetensors`); pickled `adapter_model.bin` weights are never loaded.  By default the
adapter is merged into the weights (`target.merge_adapter=true`): the same outputs, at the base
model's speed.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from peft import PeftModel
from torch import nn

from draftsmith.heads.infra.files import sha256_file

log = logging.getLogger(__name__)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter that cannot be put on the target."""


@dataclass(frozen=True)
class Adapter:
    path: Path
    base_model: str | None            # the adapter config's base_model_name_or_path
    sha256: str                       # of its config and weights
    merge: bool = True

    @classmethod
    def read(cls, path: str | Path, merge: bool = True) -> Adapter:
        """Check a peft LoRA adapter directory before anything loads."""
        path = Path(path).expanduser().resolve()
        if not (path / CONFIG).is_file():
            raise AdapterError(f"target.adapter={path}: no {CONFIG} there; give a directory written by peft's "
                               "save_pretrained (adapter_config.json + adapter_model.safetensors)")
        try:
            config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:
            raise AdapterError(f"target.adapter={path}: {path / CONFIG} is not valid JSON ({err}); give a directory "
                               "written by peft's save_pretrained") from None
        if not isinstance(config, dict):
            raise AdapterError(f"target.adapter={path}: {path / CONFIG} must hold a JSON object")
        kind = str(config.get("peft_type", "")).upper()
        if kind != "LORA":
            raise AdapterError(f"target.adapter={path}: peft adapter type '{config.get('peft_type')}' is not supported; "
                               "draftsmith reads LoRA adapters only (merge other kinds into the model and give it "
                               "as target.path)")
        if not (path / WEIGHTS).is_file():
            pickled = " (adapter_model.bin is pickled and is never loaded: re-save it with safetensors)" \
                if (path / "adapter_model.bin").is_file() else ""
            raise AdapterError(f"target.adapter={path}: no {WEIGHTS}{pickled}; save the adapter with "
                               "save_pretrained(..., safe_serialization=True)")
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
        digest.update(sha256_file(path / WEIGHTS).encode())
        return cls(path, config.get("base_model_name_or_path"), digest.hexdigest()[:16], merge)

    def apply(self, model: nn.Module, target_name: str) -> nn.Module:
        """The model with the adapter on it: merged into the weights, or as peft LoRA layers."""
        try:
            adapted = PeftModel.from_pretrained(model, str(self.path), is_trainable=False)
        except (RuntimeError, ValueError, KeyError) as err:      # size mismatches, modules not found
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise AdapterError(
                f"target.adapter={self.path} does not fit target '{target_name}': the adapter was made for "
                f"'{self.base_model}' ({first}); give the adapter of this base model, or the base model it "
                "was trained on as target.path") from None
        if self.base_model and not _same_name(self.base_model, target_name, model):
            log.warning("target.adapter %s names its base model '%s' and the target is '%s'; the shapes fit, so it "
                        "is used (the same model often has several names)", self.path, self.base_model, target_name)
        adapted = adapted.merge_and_unload() if self.merge else adapted
        return adapted.eval().requires_grad_(False)


def _same_name(base_model: str, target_name: str, model: nn.Module) -> bool:
    names = {target_name, str(getattr(model.config, "_name_or_path", ""))}
    stem = Path(base_model.rstrip("/")).name.lower()
    return any(stem and stem in Path(n.rstrip("/")).name.lower() for n in names if n)
