"""The measured step costs a prediction prices (eval/predict.py): one table per machine, stack, target, dtype,
drafter and context, kept in the cache so that a second prediction measures nothing.  draftsmith's engine
fills it in eval/predict.py, vLLM in eval/predict_vllm.py."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

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


def kept_table(path: Path, conditions: dict, batches, ks, refresh: bool = False) -> CostTable | None:
    """The table kept at `path` when it was measured under `conditions` and covers `batches` x `ks`; else None,
    with a one-line note of what differs (so the caller measures again)."""
    if refresh or not path.is_file():
        return None
    table = CostTable.from_dict(json.loads(path.read_text()))
    differs = table.matches(conditions)
    wanted = set(batches) <= set(table.verify_ms) and all(set(ks) <= set(r) for r in table.verify_ms.values())
    if not differs and wanted and table.version == COST_VERSION:
        return table
    log.warning("cost table %s was measured under other conditions (%s): measured again here", path,
                "; ".join(differs) or "other batch sizes or draft lengths")
    return None


def keep_table(table: CostTable, path: Path) -> CostTable:
    """Write `table` to `path` whole (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(table), indent=1))
    tmp.replace(path)
    return table
