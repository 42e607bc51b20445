"""The measured step costs a prediction prices (eval/predict.py): one table per machine, stack, target, dtype,
drafter and context, kept in the cache so that a second prediction measures nothing.  draftsmith's engine
fills it in eval/predict.py, vLLM in eval/predict_vllm.py."""
from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

CONTEXT = 512             # cached tokens while a step is timed: a typical chat's
COST_VERSION = 1


@dataclass
class CostTable:
    """Measured milliseconds of a speculative step's two parts, by batch size and draft length."""
    machine: str
    stack: str                          # draftsmith (its engine) or vllm
    target: str                         # the target's weights sha256
    dtype: str
    drafter: str                        # what D was measured with: a checkpoint's weights, or a kind built untrained
    context: int
    verify_ms: dict[int, dict[int, float]]        # b -> K -> T(b, K)
    draft_ms: dict[int, dict[int, float]]         # b -> K -> D(b, K); D(b, 0) = 0
    version: int = COST_VERSION

    def matches(self, other: dict) -> list[str]:
        """What differs from the conditions `other` names (machine, stack, target, dtype, drafter, context)."""
        return [f"{k} {getattr(self, k)!r} (here {other[k]!r})" for k in other if getattr(self, k) != other[k]]

    @classmethod
    def from_dict(cls, raw: dict) -> CostTable:
        table = cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})
        table.verify_ms = {int(b): {int(k): float(v) for k, v in row.items()} for b, row in table.verify_ms.items()}
        table.draft_ms = {int(b): {int(k): float(v) for k, v in row.items()} for b, row in table.draft_ms.items()}
        return table


def machine_name(device: torch.device) -> str:
    """The device's model, as the cost tables name it: a GPU's name, else the CPU's model and core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def cost_path(stack: str, conditions: dict) -> Path:
    from draftsmith.heads.runtime.assets import cache_root
    key = hashlib.sha256(json.dumps({k: conditions[k] for k in sorted(conditions) if k != "machine"},
                                    sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "costs" / f"{stack}-{key}.json"
