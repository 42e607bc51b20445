"""The `accelerate` Accelerator a training run uses: device, precision, trackers, and a DeepSpeed
config reconciled with the recipe's batch settings.

`accelerate launch --config_file recipes/accelerate/<fsdp|deepspeed-*>.yaml` runs as written on
CPU processes too (gloo).  accelerate itself applies FSDP and DeepSpeed only to GPU process groups:
on CPU it would fall back to plain DDP without a word.  Here the launcher's choice is honoured:
DeepSpeed picks its own CPU accelerator, and FSDP2 is applied to a CPU process group through
accelerate's own FSDP plugin (read from the launcher's FSDP_* environment)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState, PartialState
from accelerate.utils import (DataLoaderConfiguration, DeepSpeedPlugin, DistributedDataParallelKwargs, DistributedType,
                              FullyShardedDataParallelPlugin, InitProcessGroupKwargs, ProjectConfiguration)
from transformers.integrations import deepspeed as hf_deepspeed

from draftsmith.heads.infra.device import resolve_device
from draftsmith.heads.runtime.target import resolve_dtype

from .settings import Recipe

log = logging.getLogger(__name__)


def make_accelerator(recipe: Recipe):

    settings = recipe.train
    device = resolve_device(recipe.target.device)
    if device.type == "cuda" and device.index is not None and "LOCAL_RANK" not in os.environ:
        torch.cuda.set_device(device)          # one process on cuda:N (under a launcher, the rank decides)
    precision = launch_precision(settings.mixed_precision)
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

    # accelerate keeps one process-wide state; a second fit() in the same process (a notebook, a sweep)
    # may ask for another precision, so the per-run part is cleared (the process group is kept)
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    launcher = launched_with()
    accelerator = Accelerator(
        cpu=device.type == "cpu", mixed_precision=precision, gradient_accumulation_steps=settings.grad_accum, log_with=log_with,
        # the sampler builds global batches (batch_size x processes) and each process takes its slice,
        # so what a step sees does not depend on how many processes share it
        # (pinned batches are copied to a GPU without the host waiting for them)
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=device.type == "cuda"),
        # a drafter's buffers (its draft-vocabulary maps, rotary frequencies) are equal on every process by
        # construction and never trained: DDP need not send them from rank 0 before every forward; the
        # gradients are views into DDP's buckets rather than a second copy (1.7 GB for an 8B EAGLE-3 drafter).
        # The process group's timeout is the recipe's (a cache built or verified at scale outlasts 10 minutes)
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False, gradient_as_bucket_view=True),
                         InitProcessGroupKwargs(timeout=timedelta(minutes=settings.dist_timeout_minutes))],
        project_config=ProjectConfiguration(project_dir=str(recipe.out), logging_dir=str(recipe.out / "logs")))
    if launcher and accelerator.distributed_type == DistributedType.MULTI_CPU:
        _fsdp_on_cpu(accelerator) if launcher == "fsdp" else _deepspeed_on_cpu(accelerator, settings.dist_timeout_minutes)
    _check_deepspeed(accelerator, settings)
    _check_fsdp(accelerator)
    return accelerator


def launch_precision(recipe_value: str) -> str:
    """The recipe's train.mixed_precision, reconciled with the `mixed_precision` of `accelerate launch`
    (its config file or flag): 'auto' takes the launcher's; two values that differ are refused.

    Under DeepSpeed with a `deepspeed_config_file` the precision is the JSON's: accelerate refuses a
    `mixed_precision` in such a launch file and exports `no` for it, which means nothing.  The JSON's
    `bf16.enabled` (or `fp16.enabled`) true or false is compared with the recipe; "auto" (the shipped
    configs) lets the recipe decide."""
    json_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if json_file and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return _deepspeed_json_precision(json_file, recipe_value)
    given = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if not given:
        return recipe_value
    if recipe_value == "auto":
        return given
    if given != recipe_value:
        raise ValueError(f"the accelerate config{launch_config_file()} sets mixed_precision={given} but the recipe "
                         f"has train.mixed_precision={recipe_value}; make them agree (--mixed_precision "
                         f"{recipe_value} on the launch line, or train.mixed_precision=auto)")
    return recipe_value


def _deepspeed_json_precision(path: str, recipe_value: str) -> str:
    try:
        config = json.loads(open(path).read())
    except (OSError, ValueError) as err:
        raise ValueError(f"the DeepSpeed config '{path}' cannot be read ({err}); fix the deepspeed_config_file "
                         "of the accelerate config") from None
    enabled = {name: str(config.get(name, {}).get("enabled", "auto")).lower() for name in ("bf16", "fp16")}
    if enabled["fp16"] == "true":
        raise ValueError(f"the DeepSpeed config '{path}' enables fp16, which draftsmith does not train in; set "
                         '"fp16": {"enabled": false} and "bf16": {"enabled": "auto"} there')
    given = {"true": "bf16", "false": "no"}.get(enabled["bf16"])
    if given is None or recipe_value == "auto":
        return given or recipe_value
    if given != recipe_value:
        raise ValueError(f"the DeepSpeed config '{path}' sets bf16.enabled={enabled['bf16']} but the recipe has "
                         f"train.mixed_precision={recipe_value}; make them agree (\"bf16\": {{\"enabled\": \"auto\"}} "
                         "lets the recipe decide)")
    return recipe_value


def launch_config_file(pid: int | None = None) -> str:
    """' (FILE)': the --config_file of the `accelerate launch` this process runs under, read from its
    ancestors' command lines (Linux /proc; the launcher exports no variable naming it), or ''."""
    pid = pid or os.getppid()
    for _ in range(4):                    # launcher -> torchrun's agent -> this process, and a shell or two
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return ""
        for i, arg in enumerate(argv):
            if arg in ("--config_file", "--config-file") and i + 1 < len(argv):
                return f" ({argv[i + 1]})"
            if arg.startswith(("--config_file=", "--config-file=")):
                return f" ({arg.split('=', 1)[1]})"
        if parent <= 1:
            return ""
        pid = parent
    return ""


def launched_with() -> str | None:
    """'fsdp' or 'deepspeed' when `accelerate launch` was given such a config, else None."""
    for name in ("deepspeed", "fsdp"):
        if os.environ.get(f"ACCELERATE_USE_{name.upper()}", "false").lower() == "true":
            return name
    return None


def _switch_to(accelerator, kind) -> None:
    # both shared states: accelerate copies the process state's type into each AcceleratorState it builds
    PartialState._shared_state["distributed_type"] = kind
    accelerator.state.distributed_type = kind


def _fsdp_on_cpu(accelerator) -> None:
    plugin = FullyShardedDataParallelPlugin()          # fsdp_version, state dict type ... from FSDP_* variables
    if plugin.fsdp_version != 2:
        raise ValueError("FSDP on CPU processes needs fsdp_version: 2 in the accelerate config (FSDP1 is GPU only)")
    _switch_to(accelerator, DistributedType.FSDP)
    accelerator.state.fsdp_plugin = plugin
    log.info("FSDP2 on %d CPU processes (gloo)", accelerator.num_processes)


def _deepspeed_on_cpu(accelerator, timeout_minutes: float) -> None:
    """DeepSpeed over the gloo process group accelerate made (asked for the GPU way, accelerate would
    see no backend and run every process as if it were alone)."""
    try:
        import deepspeed  # optional: only under a DeepSpeed launch
    except ImportError:
        raise ImportError('the accelerate config asks for DeepSpeed, which is not installed: pip install '
                          '"draftsmith[deepspeed]" (or use recipes/accelerate/ddp.yaml or fsdp.yaml)') from None

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False,     # adopts the existing group
                                    timeout=timedelta(minutes=timeout_minutes))
    plugin = DeepSpeedPlugin()                         # the config file and ZeRO stage from the launcher
    plugin.set_mixed_precision(accelerator.mixed_precision)
    _switch_to(accelerator, DistributedType.DEEPSPEED)
    plugin.select(_from_accelerator_state=True)
    accelerator.state.deepspeed_plugins = plugin
    log.info("DeepSpeed ZeRO-%d on %d CPU processes (gloo)", zero_stage(accelerator), accelerator.num_processes)


def _check_fsdp(accelerator) -> None:
    """Checkpoints are written whole: a sharded state-dict setting would save one rank's shard only."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if accelerator.distributed_type != DistributedType.FSDP or plugin is None:
        return
    kind = getattr(plugin.state_dict_type, "name", str(plugin.state_dict_type))
    if kind != "FULL_STATE_DICT":
        raise ValueError(f"the FSDP config sets fsdp_state_dict_type={kind} but draftsmith writes whole "
                         "checkpoints: set fsdp_state_dict_type: FULL_STATE_DICT in the accelerate config")


@contextlib.contextmanager
def whole_parameters(accelerator, model):
    """Inside: the drafter's parameters are whole on every process, so its methods (held-out loss,
    decoding) can be called directly, outside the wrapped forward.  Every process must enter."""
    if accelerator.distributed_type == DistributedType.FSDP and hasattr(model, "unshard"):
        model.unshard()
        try:
            yield
        finally:
            model.reshard()
    elif accelerator.distributed_type == DistributedType.DEEPSPEED and zero_stage(accelerator) == 3:
        import deepspeed  # optional: only under a DeepSpeed launch

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            yield
    else:
        yield


def fill_deepspeed_sizes(accelerator, hidden_size: int) -> None:
    """ZeRO's "auto" bucket sizes, from the hidden size (accelerate would look for a `config.hidden_size`
    on the drafter, which has none): the values accelerate itself derives from it."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        return
    zero = plugin.deepspeed_config.get("zero_optimization", {})
    for key, value in (("reduce_bucket_size", hidden_size * hidden_size),
                       ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
                       ("stage3_param_persistence_threshold", 10 * hidden_size)):
        if zero.get(key) == "auto":
            zero[key] = value


@contextlib.contextmanager
def whole_target(accelerator):
    """Inside: the frozen target loads whole.  Under ZeRO-3 transformers would partition any model it
    loads over the processes; the target is never trained, so each process keeps its own copy."""
    if zero_stage(accelerator) != 3:
        yield
        return

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def zero_stage(accelerator) -> int:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0)) if plugin else 0


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
