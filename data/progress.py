"""The processes of a data run, and a progress bar that tells the truth about all of them.

Under `torchrun` or `accelerate launch`, `draftsmith data` runs one process per device: rank r makes
the shards whose index is r modulo the world size (`Launch.owns`).  Each shard depends only on the
seed and its index, so the ranks together write exactly what one process writes, any rank can be
rerun alone, and a rerun with another world size finds every finished shard where it expects it.

Progress: every rank writes its counts to `progress/rank-R.json` every few seconds; the main rank's
bar adds them up, shows tokens per second for the whole run, and, under data.max_minutes, the time
left to the cap (not to the end of the source, which a capped run never reaches).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from draftsmith.heads.infra.files import DirectoryLock, StorageError, write_atomic
from draftsmith.heads.infra.kept import NUMBER, read_kept_json
from draftsmith.heads.infra.launch_checks import check_launch

log = logging.getLogger(__name__)


@dataclass
class Launch:
    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = field(default=lambda: None)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def owns(self, index: int) -> bool:
        return index % self.world == self.rank


def launch_from_environment() -> tuple[int, int, int]:
    """(rank, world size, local rank) as torchrun and accelerate launch set them; (0, 1, 0) alone."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)))


WRITE_EVERY = 2.0      # seconds between a rank's progress files
HEARTBEAT_SECONDS = 30.0
STALE_MINUTES = 15.0   # a rank whose heartbeat is older than this is taken for dead (wait_for_ranks)


class Progress:
    """Conversations and tokens done, by this rank and (on the main rank, from the files) by all."""

    def __init__(self, out_dir: Path, total: int, done_before: int, launch: Launch, deadline: float | None,
                 enabled: bool, desc: str):
        self.dir = Path(out_dir) / "progress"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.launch, self.deadline, self.start = launch, deadline, time.time()
        self.conversations, self.tokens, self.written = 0, 0, 0.0
        self.counts: dict = {}
        self.shown = done_before
        self.bar = tqdm(total=total, initial=done_before, desc=desc, unit="conv", dynamic_ncols=True,
                        disable=not (enabled and launch.main),
                        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} conv [{elapsed}{postfix}]")
        self.total = total
        self.done = False
        self._write(time.time())          # this run's counts replace an earlier run's file at once
        self._beating = threading.Event()
        if launch.world > 1:
            threading.Thread(target=self._heartbeat, daemon=True, name="data-heartbeat").start()

    def update(self, conversations: int = 0, tokens: int = 0) -> None:
        self.conversations += conversations
        self.tokens += tokens
        now = time.time()
        if now - self.written >= WRITE_EVERY:
            self._write(now)

    def _write(self, now: float) -> None:
        self.written = now
        write_atomic(self.dir / f"rank-{self.launch.rank}.json",
                     json.dumps({"conversations": self.conversations, "tokens": self.tokens,
                                 "seconds": now - self.start, "counts": self.counts, "done": self.done}))
        if self.launch.main:
            self._show(now)

    def ranks(self) -> list[dict]:
        """The latest counts of every rank of this run."""
        return [counts for rank in range(self.launch.world) if (counts := self._rank_file(rank))]

    def _show(self, now: float) -> None:
        ranks = self.ranks()
        conversations = sum(r["conversations"] for r in ranks)
        tokens = sum(r["tokens"] for r in ranks)
        seconds = max(now - self.start, 1e-6)
        self.bar.update(self.shown + conversations - self.bar.n)
        rate = conversations / seconds
        left = (self.total - self.bar.n) / rate if rate > 0 else None
        note = f", {tokens / seconds:.0f} tok/s"
        if self.launch.world > 1:
            note += f" over {len(ranks)}/{self.launch.world} ranks"
        if self.deadline is not None:
            to_cap = max(0.0, self.deadline - now)
            if left is None or to_cap < left:
                note += f", cap in {_clock(to_cap)} (data.max_minutes)"
                left = None
        if left is not None:
            note += f", ~{_clock(left)} left"
        self.bar.set_postfix_str(note.lstrip(", "), refresh=True)

    def close(self, counts: dict) -> None:
        """The final counts of this rank (read back by the main rank: `totals`); its work is done."""
        self.counts = dict(counts)
        self.done = True
        self._write(time.time())
        self._beating.set()
        self.bar.close()

    def _heartbeat(self) -> None:
        """While this rank works, its heartbeat file is touched every HEARTBEAT_SECONDS (from a thread, so a
        long feature pass that reports no conversations still shows the rank alive)."""
        path = self.dir / f"alive-{self.launch.rank}"
        while not self._beating.wait(0 if not path.exists() else HEARTBEAT_SECONDS):
            path.touch()

    def wait_for_ranks(self, stale_minutes: float = STALE_MINUTES, poll: float = 5.0) -> None:
        """Wait, before the launch's barrier, until every rank has written its shards: as long as the slowest
        rank's remaining work takes, while its heartbeat is fresh (the process-group timeout would end a
        rerun in which one rank still has hours of shards left).  Every few minutes it logs which ranks it
        waits for and how far each is; a rank whose heartbeat is older than `stale_minutes` is named in the
        error."""
        said = time.time()
        while True:
            waiting = [r for r in range(self.launch.world) if not self._rank_file(r).get("done")]
            if not waiting:
                return
            now = time.time()
            stale = [r for r in waiting if now - self._heartbeat_time(r) > stale_minutes * 60]
            if stale:
                raise RuntimeError(
                    f"data: rank(s) {stale} gave no sign of life for more than {stale_minutes:g} minutes (their "
                    f"heartbeat in {self.dir}) before finishing their shards; the others have finished and wait. "
                    "Look at those ranks' logs; the shards written are kept, and a rerun makes only the rest")
            if now - said >= 300:
                log.info("data: waiting for rank(s) %s: %s", waiting, ", ".join(
                    f"rank {r} {self._rank_file(r).get('conversations', 0)} conversations" for r in waiting))
                said = now
            time.sleep(poll)

    def _rank_file(self, rank: int) -> dict:
        """A rank's latest counts; {} while it has written none, or when its file is damaged (it is a display,
        rewritten every few seconds: the shards, not this file, are what a resumed run counts)."""
        try:
            return read_kept_json(self.dir / f"rank-{rank}.json", "a rank's progress", "",
                                  {"conversations": int, "tokens": int, "seconds": NUMBER})
        except (OSError, ValueError):
            return {}

    def _heartbeat_time(self, rank: int) -> float:
        try:
            return (self.dir / f"alive-{rank}").stat().st_mtime
        except OSError:
            return self.start                # not started yet: counted from when this rank began waiting

    def totals(self) -> dict:
        """Every rank's final counts, summed (the main rank, after the ranks' barrier)."""
        summed: dict = {}
        for r in self.ranks():
            for key, value in r.get("counts", {}).items():
                summed[key] = summed.get(key, 0) + value
        return summed


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


@contextmanager
def data_launch(out_dir: Path, timeout_minutes: float, recipe: dict | None = None):
    """This process's `Launch`, holding output_dir's lock for the run: alone, the lock; under a launcher,
    a gloo process group (its barriers only: shards are files), the main rank holding the lock for all of
    them, so a second launch on the same directory is refused on every one of its ranks.  Under a launcher,
    before that: every process sees output_dir and holds the same `recipe` (launch_checks.check_launch)."""
    rank, world, _ = launch_from_environment()
    if world == 1:
        with DirectoryLock(out_dir, "data run"):
            yield Launch()
        return

    dist.init_process_group("gloo", timeout=timedelta(minutes=timeout_minutes))
    lock, refusal = DirectoryLock(out_dir, "data run"), None
    try:
        check_launch(out_dir, recipe or {}, rank, world)
        if rank == 0:
            try:
                lock.__enter__()
            except StorageError as err:
                refusal = err
        refused = torch.tensor([int(refusal is not None)])
        dist.broadcast(refused, 0)
        if refused.item():
            raise refusal or StorageError(16, f"'{out_dir}' is in use by another draftsmith process (rank 0 of "
                                              "this launch could not lock it); wait for it, or use another output_dir")
        try:
            yield Launch(rank, world, barrier=dist.barrier)
        finally:
            if rank == 0:
                lock.__exit__(None, None, None)
    finally:
        dist.destroy_process_group()
