"""The measured step costs a prediction prices (eval/predict.py): one table per machine, stack, target, dtype,
drafter and context, kept in the cache so that a second prediction measures nothing.  draftsmith's engine
fills it in eval/predict.py, vLLM in eval/predict_vllm.py."""
from __future__ import annotations

import hashlib
import json
import logging
import math
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
        """A table read back, checked: each field of its type, every cost a finite number, T(b, K) > 0 and
        D(b, K) >= 0 for whole b >= 1 and K >= 0 (ValueError names the first problem)."""
        if not isinstance(raw, dict):
            raise ValueError(f"it holds a JSON {type(raw).__name__}, not a table")
        missing = [k for k in ("machine", "stack", "target", "dtype", "drafter", "context", "verify_ms", "draft_ms")
                   if k not in raw]
        if missing:
            raise ValueError(f"it has no {', '.join(missing)}")
        for key in ("machine", "stack", "target", "dtype", "drafter"):
            if not isinstance(raw[key], str):
                raise ValueError(f"its {key} is {raw[key]!r}, not text")
        if isinstance(raw["context"], bool) or not isinstance(raw["context"], int) or raw["context"] < 1:
            raise ValueError(f"its context is {raw['context']!r}, not a whole number of tokens")
        table = cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})
        table.verify_ms = _costs(raw["verify_ms"], "verify_ms", positive=True)
        table.draft_ms = _costs(raw["draft_ms"], "draft_ms", positive=False)
        return table


def _costs(raw, name: str, positive: bool) -> dict[int, dict[int, float]]:
    """{b: {K: milliseconds}} from JSON (string keys), every value finite and > 0 (or >= 0 for draft costs)."""
    if not isinstance(raw, dict) or not raw or not all(isinstance(row, dict) and row for row in raw.values()):
        raise ValueError(f"its {name} is not a table of batch size -> draft length -> milliseconds")
    out = {}
    for b, row in raw.items():
        try:
            batch = int(b)
            out[batch] = {int(k): float(v) for k, v in row.items() if not isinstance(v, bool)}
        except (TypeError, ValueError):
            raise ValueError(f"its {name}[{b!r}] holds something other than numbers") from None
        if batch < 1 or len(out[batch]) != len(row) or any(k < 0 for k in out[batch]):
            raise ValueError(f"its {name}[{b!r}] has a batch size or draft length out of range, or a non-number")
        bad = [v for v in out[batch].values() if not math.isfinite(v) or v < 0 or (positive and v == 0)]
        if bad:
            raise ValueError(f"its {name}[{b}] holds {bad[0]!r} ms, not a {'positive' if positive else 'non-negative'}"
                             " finite time")
    return out


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
    try:
        table = CostTable.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, UnicodeDecodeError, OSError) as err:      # JSONDecodeError is a ValueError
        log.warning("cost table %s cannot be used (%s): measured again here, and the file replaced", path,
                    str(err).splitlines()[0][:200])
        return None
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
