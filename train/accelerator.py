"""The `accelerate` Accelerator a training run uses: device, precision, trackers, and a DeepSpeed
config reconciled with the recipe's batch settings."""
from __future__ import annotations

import logging
import os

import torch
from draftsmith.heads.device import resolve_device
from draftsmith.heads.target import resolve_dtype

from .settings import Recipe

log = logging.getLogger(__name__)


def make_accelerator(recipe: Recipe):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    settings = recipe.train
    device = resolve_device(recipe.target.device)
    if device.type == "cuda" and device.index is not None and "LOCAL_RANK" not in os.environ:
        torch.cuda.set_device(device)          # one process on cuda:N (under a launcher, the rank decides)
    precision = settings.mixed_precision
    if precision == "auto":
        precision = "bf16" if resolve_dtype("auto", device) == torch.bfloat16 else "no"
    log_with = None
    if settings.report_to == "wandb":
        if not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
            log.warning("report_to=wandb without WANDB_API_KEY or WANDB_MODE: logging to W&B offline "
                        "(sync later with `wandb sync`)")
            os.environ["WANDB_MODE"] = "offline"
        log_with = "wandb"
    elif settings.report_to == "tensorboard":
        log_with = "tensorboard"
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    # accelerate keeps one process-wide state; a second fit() in the same process (a notebook, a sweep)
    # may ask for another precision, so the per-run part is cleared (the process group is kept)
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    accelerator = Accelerator(
        cpu=device.type == "cpu", mixed_precision=precision, gradient_accumulation_steps=settings.grad_accum, log_with=log_with,
        # the sampler builds global batches (batch_size x processes) and each process takes its slice,
        # so what a step sees does not depend on how many processes share it
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        project_config=ProjectConfiguration(project_dir=str(recipe.out), logging_dir=str(recipe.out / "logs")))
    _check_deepspeed(accelerator, settings)
    return accelerator


def _check_deepspeed(accelerator, settings) -> None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        reconcile_deepspeed_config(plugin.deepspeed_config, settings, accelerator.num_processes)


def reconcile_deepspeed_config(config: dict, settings, num_processes: int) -> dict:
    """A DeepSpeed config must agree with the recipe's batch settings; "auto" is filled in from the recipe."""
    for key, value, name in (("train_micro_batch_size_per_gpu", settings.batch_size, "train.batch_size"),
                             ("gradient_accumulation_steps", settings.grad_accum, "train.grad_accum")):
        given = config.get(key, "auto")
        if given == "auto":
            config[key] = value
        elif int(given) != value:
            raise ValueError(f"the DeepSpeed config sets {key}={given} but the recipe has {name}={value}; make "
                             'them agree (or write "auto" in the DeepSpeed config)')
    if config.get("gradient_clipping", "auto") == "auto":
        config["gradient_clipping"] = settings.grad_clip
    expected = settings.batch_size * settings.grad_accum * num_processes
    if config.get("train_batch_size", "auto") not in ("auto", expected):
        raise ValueError(f"the DeepSpeed config sets train_batch_size={config['train_batch_size']} but the recipe "
                         f"gives {expected} (train.batch_size x train.grad_accum x {num_processes} processes)")
    config["train_batch_size"] = expected
    return config
