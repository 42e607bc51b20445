"""The learning-rate schedule every drafter trains with."""
from __future__ import annotations

import math
import time


def warmup_cosine(warmup: int, total: int, clock: dict):
    """Linear warmup, then cosine to zero.  Under train.max_minutes, progress is the larger of the step
    fraction and the time fraction, so a time-capped run still anneals (its LR then depends on speed)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        if clock["limit"]:
            progress = max(progress, (clock["offset"] + time.time() - clock["start"]) / clock["limit"])
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor
