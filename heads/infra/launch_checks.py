"""What every process of a launch must agree on before any work: one output_dir they all see, and one recipe.

A launch over two nodes assumes that output_dir is one directory for all of them: the feature cache,
the shards, the checkpoint's per-rank state and the lock live there.  On node-local disks each node
would write its own half and read a directory the other never filled, hours into the run.  Rank 0
writes a fresh token there; after a barrier every process reads it back; a process that cannot stops
the launch on every rank with one line.  The same collective compares the recipes every process
resolved (an override given to one node only, another recipe file) and names the first key that
differs.  Under one process nothing is checked."""
from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import torch.distributed as dist


class LaunchMismatch(ValueError):
    """The processes of one launch disagree: on their output_dir's filesystem, or on the recipe."""


def first_difference(a, b, prefix: str = "") -> tuple[str, object, object] | None:
    """The first key (dotted, in sorted order) whose values differ between two nested dicts, with both values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            found = first_difference(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{prefix}{key}.")
            if found is not None:
                return found
        return None
    return None if a == b else (prefix.rstrip("."), a, b)


def in_process_group() -> bool:
    """A process group is up (a launcher started this process, whatever its size).  The launch's checks and
    collectives run whenever it is, not only with several processes, so a one-GPU run exercises them over
    NCCL (scripts/gpu_check.sh's 1-process torchrun)."""
    return dist.is_available() and dist.is_initialized()


def check_launch(out_dir: Path, recipe: dict, rank: int, world: int) -> None:
    """Every process of the launch sees what rank 0 writes into out_dir, and holds the same recipe (the dict
    of its resolved settings); otherwise LaunchMismatch on every process.  Needs the process group."""
    if not in_process_group():
        return          # with a process group of one (torchrun on one GPU) it runs: NCCL's object collectives too
    recipe = json.loads(json.dumps(recipe, default=str))      # plain values, compared as the YAML would hold them
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = Path(out_dir) / f".launch-{token[0]}"
    if rank == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(token[0])
    dist.barrier()
    try:
        sees = marker.read_text() == token[0]
    except OSError:
        sees = False
    mine = {"rank": rank, "host": socket.gethostname(), "sees": sees, "recipe": recipe}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    dist.barrier()                         # every process has read it: rank 0 may remove it
    if rank == 0:
        marker.unlink(missing_ok=True)
    blind = [p for p in every if not p["sees"]]
    if blind:
        where = ", ".join(f"rank {p['rank']} on {p['host']}" for p in blind)
        raise LaunchMismatch(f"output_dir '{out_dir}' is not shared by every process of this launch: {where} cannot "
                             f"read what rank 0 (on {every[0]['host']}) wrote there. output_dir must be on a "
                             "filesystem every node mounts (NFS, Lustre, a cluster filesystem), the same path on each")
    for other in every[1:]:
        found = first_difference(every[0]["recipe"], other["recipe"])
        if found is not None:
            key, zero, theirs = found
            raise LaunchMismatch(f"the processes of this launch hold different recipes: {key} is {zero!r} on rank 0 "
                                 f"and {theirs!r} on rank {other['rank']} ({other['host']}); give every process the "
                                 "same recipe file and the same overrides")
