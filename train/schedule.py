"""The learning-rate schedule every drafter trains with, and the one clock a launch reads."""
from __future__ import annotations

import math
import time

import torch

from draftsmith.heads.infra.launch_checks import in_process_group


class LaunchClock:
    """The seconds a run has trained, one value for every process of a launch.

    Each process starts its own timer at a different moment (rank 0 loads more), so a time cap read
    from each process's own clock would give the replicas different learning rates (DDP never re-syncs
    weights: they drift apart silently) and could stop them at different steps (one waits in the save
    barrier while another is in a gradient all-reduce: a hang).  Here rank 0's elapsed time is
    broadcast at the steps `due` names (the log steps), and between them every process reads the same
    last value; the learning-rate schedule and train.max_minutes both read `elapsed`.  In one process
    the clock is read at every step, with no collective."""

    def __init__(self, limit_seconds: float | None, offset: float = 0.0):
        self.limit = limit_seconds
        self.offset = offset               # seconds trained before a resume
        self.start = time.time()
        self.elapsed = offset

    def restart(self, offset: float) -> None:
        self.offset, self.start, self.elapsed = offset, time.time(), offset

    def due(self, step: int, every: int, processes: int) -> bool:
        return processes == 1 or step % every == 0

    def sync(self, accelerator) -> float:
        """Rank 0's elapsed seconds, on every process (a broadcast; the only one of the clock)."""
        local = self.offset + time.time() - self.start
        if accelerator.num_processes == 1 and not in_process_group():
            self.elapsed = local
            return local
        value = torch.tensor([local], dtype=torch.float64, device=accelerator.device)
        torch.distributed.broadcast(value, src=0)
        self.elapsed = float(value.item())
        return self.elapsed


def warmup_cosine(warmup: int, total: int, clock: LaunchClock):
    """Linear warmup, then cosine to zero.  Under train.max_minutes, progress is the larger of the step
    fraction and the time fraction (the launch's one clock), so a time-capped run still anneals (its LR
    then depends on speed, the same on every process)."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        if clock.limit:
            progress = max(progress, clock.elapsed / clock.limit)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor
