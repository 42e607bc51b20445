"""Training checkpoints: the drafter checkpoint plus `state/` for exact resume.

A save writes a complete directory next to the old one, then swaps the two,
so a kill at any moment leaves one whole checkpoint (`checkpoint/`, or
`checkpoint.old/` if the kill fell inside the swap).  Nothing is unpickled
on resume: weights are safetensors; optimizer and RNG states are read with
`torch.load(weights_only=True)`; the rest is JSON.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import pickle
import random
import shutil
import time
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from draftsmith.heads.card import write_card  # in whole
from draftsmith.heads.drafter import RESERVED, WEIGHTS_FILE, read_config, read_weights, save_drafter
from draftsmith.heads.infra import outputs, strict_yaml
from draftsmith.heads.infra.kept import read_kept_json
from draftsmith.heads.infra.files import (StorageError, as_disk_full, free_bytes, human_size, require_writable,
                                          swap_directory)
from draftsmith.heads.runtime.target import TargetIdentity

from .settings import Recipe, RecipeError, save_recipe

log = logging.getLogger(__name__)

# Recipe keys that may change between a save and a resume.
RESUME_FREE = {"resume", "overwrite", "output_dir", "eval", "train.max_steps", "train.max_minutes", "train.epochs",
               "train.report_to", "train.wandb_project", "train.log_every", "train.save_every", "train.eval_every",
               "data.max_minutes", "target.device", "train.dist_timeout_minutes", "train.verify_cache",
               "train.loader_workers", "train.gradient_checkpointing", "train.allow_reshard"}

NO_RESUME = ("This checkpoint cannot be resumed; its weights are whole: start without resume=true (overwrite=true "
             "trains anew in its place, the old one set aside), or restore the file from a copy")


def guard_output(recipe: Recipe) -> None:
    """Before any work: output_dir is not another verb's work (outputs.guard_output), it can be written, and
    a trained checkpoint is not replaced unasked."""
    outputs.guard_output(recipe.out, "train", "run", overwrite=True, foreign_ok=True)
    require_writable(recipe.out, "output_dir")
    checkpoint = recipe.out / "checkpoint"
    if int(os.environ.get("RANK", "0")) == 0:
        finish_interrupted_swap(checkpoint)
    if (checkpoint / WEIGHTS_FILE).is_file() and not recipe.resume and not recipe.overwrite:
        raise RecipeError(f"'{checkpoint}' already holds a trained drafter ({_steps(checkpoint)}): add resume=true "
                          "to continue training it, or overwrite=true to train a new one in its place, or choose "
                          "another output_dir")


def finish_interrupted_swap(checkpoint: Path) -> None:
    """A run killed while it replaced its checkpoint (heads/infra/files.py: swap_directory) leaves
    `checkpoint.old/`: alone, it is the last checkpoint written, and is put back in place; beside a whole
    `checkpoint/`, it is the one before, which the swap was removing.  Either way it is named in the log."""
    old = checkpoint.with_name(checkpoint.name + ".old")
    if not old.is_dir():
        return
    if (checkpoint / WEIGHTS_FILE).is_file():
        log.warning("removing %s: the checkpoint before %s, left by a run stopped while it replaced it", old, checkpoint)
        shutil.rmtree(old)
    elif not checkpoint.exists() and (old / WEIGHTS_FILE).is_file():
        old.rename(checkpoint)
        log.warning("restored %s from %s: a run was stopped while it replaced its checkpoint (%s)", checkpoint, old,
                    _steps(checkpoint))
    else:
        log.warning("%s is not a checkpoint this run can restore (%s holds no drafter weights); it is left as it "
                    "is: move it away if it is not yours", old, old)


def set_aside(checkpoint: Path) -> Path | None:
    """Move a trained checkpoint out of the way (checkpoint.replaced-<time>) instead of replacing it."""
    if not (checkpoint / WEIGHTS_FILE).is_file():
        return None
    aside = checkpoint.with_name(f"{checkpoint.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    checkpoint.rename(aside)
    return aside


def _steps(checkpoint: Path) -> str:
    try:
        return f"{json.loads((checkpoint / 'state' / 'progress.json').read_text())['step']} steps"
    except (OSError, ValueError, KeyError):
        return "no resume state"


def save_checkpoint(directory: Path, recipe: Recipe, accelerator, model, optimizer, scheduler, progress: dict) -> None:
    accelerator.wait_for_everyone()
    drafter = accelerator.unwrap_model(model)
    tmp = directory.with_name(directory.name + ".tmp")
    rank_state = rank_rng_state()
    weights = accelerator.get_state_dict(model)             # every rank takes part under FSDP / ZeRO-3
    sharding = sharding_of(accelerator)
    optimizer_state = _full_optimizer_state(model, optimizer) if sharding == "fsdp" else None
    require_checkpoint_space(directory, drafter)         # on every rank: none waits at a barrier for a failed one
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            (tmp / "state").mkdir(parents=True)
            save_drafter(drafter, tmp, state=weights)
            save_recipe(recipe, tmp / "recipe.yaml")
            if sharding is None:
                torch.save(optimizer.state_dict(), tmp / "state" / "optimizer.pt")
            elif sharding == "fsdp":          # gathered whole, keyed by parameter name
                torch.save(optimizer_state, tmp / "state" / FSDP_OPTIMIZER)
            (tmp / "state" / "scheduler.json").write_text(json.dumps(_scheduler_state(scheduler)))  # the directory
            shape = launch_shape(recipe, accelerator.num_processes)
            (tmp / "state" / "progress.json").write_text(json.dumps({**progress, "sharding": sharding, **shape}))
            write_card(tmp)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise as_disk_full(err, tmp, f"the checkpoint (the last one, in '{directory}', is kept)",
                               "free some space, or choose another output_dir, then run the same command again "
                               "(resume=true continues from the last checkpoint written)") from None
    accelerator.wait_for_everyone()
    (tmp / "state").mkdir(parents=True, exist_ok=True)      # rank 0 made it (output_dir is shared: launch_checks)
    torch.save(rank_state, tmp / "state" / f"rng-{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        swap_directory(tmp, directory)
    accelerator.wait_for_everyone()


FSDP_OPTIMIZER = "optimizer-fsdp.pt"


def load_state_file(path: Path):
    """A resume-state file, read with weights_only=True (tensors, numbers and containers; never pickled code)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RecipeError(f"cannot resume: '{path}' is not resume state draftsmith wrote ({first[:120]}); draftsmith "
                          "never unpickles code. Restore the checkpoint from a copy, or train anew without "
                          "resume=true") from None


def require_checkpoint_space(directory: Path, drafter) -> None:
    """Refuse, before writing (and before training), a filesystem without room for one more checkpoint."""
    needed, free = checkpoint_bytes(drafter), free_bytes(directory.parent)
    if free < needed:
        raise StorageError(errno.ENOSPC, f"a checkpoint of this drafter needs about {human_size(needed)} at "
                                         f"'{directory.parent}', but only {human_size(free)} is free there; free some "
                                         "space or choose another output_dir")


def checkpoint_bytes(drafter) -> int:
    """What a checkpoint of `drafter` writes: its own weights, plus AdamW's two fp32 moments per trained
    parameter, plus a margin for the card, recipe and state files."""
    own = {id(p): p for name, p in drafter.named_parameters() if not name.startswith("target.")}
    weights = sum(p.numel() * p.element_size() for p in own.values())
    moments = sum(p.numel() * 8 for p in own.values() if p.requires_grad)
    return weights + moments + (1 << 20)


def launch_shape(recipe: Recipe, world_size: int) -> dict:
    """The processes and the global batch (records per optimizer step) a run trains with."""
    return {"world_size": world_size, "global_batch": recipe.train.batch_size * recipe.train.grad_accum * world_size}


def check_reshard(found: Path, progress: dict, recipe: Recipe, world_size: int) -> None:
    """A resume under the launch shape it was saved with, or train.allow_reshard=true (the data position is
    then carried over in examples).  A checkpoint older than the recorded shape counts its rank RNG files."""
    saved_world = progress.pop("world_size", None) or len(list((found / "state").glob("rng-*.pt"))) or None
    progress.pop("global_batch", None)
    now = launch_shape(recipe, world_size)
    if saved_world is None or saved_world == world_size:
        return
    saved = launch_shape(recipe, saved_world)
    if not recipe.train.allow_reshard:
        raise ValueError(f"cannot resume {found}: it was saved by {saved_world} processes (global batch "
                         f"{saved['global_batch']}) and this launch has {world_size} (global batch "
                         f"{now['global_batch']}); launch {saved_world} processes, or pass train.allow_reshard=true "
                         "to continue with the new shape deliberately")
    examples = progress["batch_in_epoch"] * saved_world
    accum = recipe.train.grad_accum
    progress["batch_in_epoch"] = examples // world_size // accum * accum
    log.warning("resuming %s saved by %d processes under %d (train.allow_reshard=true): the global batch goes from "
                "%d to %d; the epoch continues at batch %d", found, saved_world, world_size, saved["global_batch"],
                now["global_batch"], progress["batch_in_epoch"])


def sharding_of(accelerator) -> str | None:
    """'fsdp' or 'deepspeed' when the drafter's state is sharded over the processes, else None."""
    return {DistributedType.FSDP: "fsdp", DistributedType.DEEPSPEED: "deepspeed"}.get(accelerator.distributed_type)


def _full_optimizer_state(model, optimizer) -> dict:
    return get_optimizer_state_dict(model, optimizer.optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _load_sharded(found: Path, model, optimizer, accelerator) -> None:
    """FSDP: whole weights and optimizer state, read on the main process and spread from there."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    main = accelerator.is_main_process
    set_model_state_dict(model, read_weights(found) if main else {}, options=options)
    saved = load_state_file(found / "state" / FSDP_OPTIMIZER) if main else {}
    set_optimizer_state_dict(model, optimizer.optimizer, optim_state_dict=saved, options=options)


def _scheduler_state(scheduler) -> dict:
    return scheduler.state_dict()    # plain numbers; LambdaLR stores None for its (function) lambdas


def _python_state(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _compare(saved: dict, current: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(saved) | set(current)):
        name = f"{prefix}{key}"
        if name in RESUME_FREE or prefix.rstrip(".") in RESUME_FREE:
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs.extend(_compare(a, b, f"{name}."))
        elif a != b:
            diffs.append(f"{name}: saved {a!r}, now {b!r}")
    return diffs


def find_checkpoint(directory: Path) -> Path | None:
    for candidate in (directory, directory.with_name(directory.name + ".old")):
        if (candidate / "state" / "progress.json").is_file():
            return candidate
    return None


def load_state(directory: Path, recipe: Recipe, accelerator, model, optimizer, scheduler) -> dict:
    """Restore weights, optimizer, scheduler, RNG and data position; refuse a checkpoint of another run."""
    found = find_checkpoint(directory)
    if found is None:
        raise FileNotFoundError(f"resume=true but {directory} holds no resumable checkpoint (no state/); "
                                "start without resume=true")
    saved = strict_yaml.load((found / "recipe.yaml").read_text())
    current = json.loads(json.dumps(recipe.to_dict()))
    diffs = _compare(json.loads(json.dumps(saved)), current)
    if diffs:
        raise ValueError(f"cannot resume from {found}: it was trained with a different recipe ("
                         + "; ".join(diffs) + "). Use the same settings, or another output_dir")
    progress = read_kept_json(found / "state" / "progress.json", "the checkpoint's training position",
                              NO_RESUME, {"step": int})
    sharding, saved_sharding = sharding_of(accelerator), progress.pop("sharding", None)
    if sharding == "deepspeed" or saved_sharding == "deepspeed":
        raise ValueError(f"cannot resume {found} under DeepSpeed: its optimizer state is sharded in DeepSpeed's "
                         "own pickled format, which draftsmith does not load. Its weights are whole: resume "
                         "under recipes/accelerate/fsdp.yaml or ddp.yaml from a run saved there, or start anew")
    if sharding != saved_sharding:
        name = {None: "one process or DDP", "fsdp": "FSDP"}
        raise ValueError(f"cannot resume {found}: it was saved under {name[saved_sharding]} and this run uses "
                         f"{name[sharding]}; launch it the way it was saved")
    check_reshard(found, progress, recipe, accelerator.num_processes)
    drafter = accelerator.unwrap_model(model)
    saved_identity = TargetIdentity.from_dict(read_config(found)["target"])
    if drafter.trains_target_adapter:       # Medusa-2: its LoRA is restored below
        saved_identity = dataclasses.replace(saved_identity, adapter_sha256=drafter.target_identity.adapter_sha256)
    saved_identity.require_same(drafter.target_identity, f"checkpoint {found}")
    if sharding == "fsdp":
        _load_sharded(found, model, optimizer, accelerator)
    else:
        drafter.load_state_dict(read_weights(found), strict=True)
        optimizer.load_state_dict(load_state_file(found / "state" / "optimizer.pt"))
    drafter.load_adapter(found)
    drafter.metadata.update({k: v for k, v in read_config(found).items() if k not in RESERVED})
    scheduler.load_state_dict(read_kept_json(found / "state" / "scheduler.json", "the checkpoint's learning-rate "
                                             "schedule", NO_RESUME, {"last_epoch": int}))
    rng_file = found / "state" / f"rng-{accelerator.process_index}.pt"
    if rng_file.is_file():
        restore_rank_rng(load_state_file(rng_file))
    return progress


def rank_rng_state() -> dict:
    """This process's random state: the CPU generator, Python's, and every CUDA device's (EAGLE-1's feature
    noise and DFlash's anchors draw from the CUDA generator when the drafter trains on a GPU)."""
    return {"torch": torch.get_rng_state(), "python": _python_state(random.getstate()),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rank_rng(state: dict) -> None:
    """Put back what rank_rng_state() saved; CUDA states only onto as many devices as were saved, with a
    warning when the device count differs (the run goes on, but not bit for bit)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = list(state.get("cuda") or [])
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved and here == len(saved):
        torch.cuda.set_rng_state_all(saved)
    elif saved or here:
        log.warning("the checkpoint holds the random state of %d CUDA device(s) and this process sees %d: "
                    "resumed, but the random draws after it differ from an uninterrupted run", len(saved), here)
