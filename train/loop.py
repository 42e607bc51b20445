"""The one training loop, shared by every drafter, written for `accelerate`.

setup -> fit -> validate, as plain functions.  The frozen target computes the
features the drafter asks for (`required_layers`); the drafter's
`loss(batch) -> StepOutput` is all a method contributes.  The same code runs
in one process or under `accelerate launch` (DDP, FSDP, DeepSpeed): only the
drafter is prepared, so the target never reaches the optimizer.

Resume: `checkpoint/state/` holds the optimizer, scheduler, RNG and the data
position; `resume=true` continues exactly where the last save stopped.  A
non-finite loss stops the run and keeps the last good checkpoint.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from draftsmith.heads.card import write_card
from draftsmith.heads.decoding.metrics import simulated_tau
from draftsmith.heads.draft_vocab import assistant_token_counts, coverage, draft_vocabulary
from draftsmith.heads.drafter import save_drafter, warm_start
from draftsmith.heads.infra.device import same_device
from draftsmith.heads.infra.files import DirectoryLock
from draftsmith.heads.infra.launch_checks import check_launch
from draftsmith.heads.registry import registry
from draftsmith.heads.runtime.target import Target, TargetError

from .accelerator import fill_deepspeed_sizes, make_accelerator, whole_target, zero_stage
from .batches import (Batches, feature_layers, load_training_data, require_data_for_launch, step_denominators,
                      training_target)
from .checkpointing import guard_output, load_state, require_checkpoint_space, save_checkpoint, sharding_of
from .optimizers import build_optimizer
from .plan import check_drafter_size, check_sequence_memory
from .schedule import LaunchClock, warmup_cosine
from .validation import check_replicas, features_for, validate
from .settings import Recipe, RecipeError, loader_workers

log = logging.getLogger(__name__)


class TrainingError(ValueError):
    """Training cannot go on (non-finite loss, inconsistent resume)."""


@dataclass
class TrainReport:
    steps: int
    seconds: float
    tokens: int
    stopped_by: str                   # epochs | max_steps | max_minutes
    heldout_agreement: list[float]    # top-1 agreement per draft position on held-out data
    heldout_simulated_tau: float
    checkpoint: str
    history: list[dict] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def build_drafter(recipe: Recipe, target: Target, train_rows):
    cls = registry()[recipe.method]
    drafter = cls(recipe.drafter, target)
    drafter.attach_backbone()                          # Medusa-2: a LoRA on the target trains with the heads
    if recipe.train.gradient_checkpointing and not drafter.enable_gradient_checkpointing():
        log.warning("train.gradient_checkpointing: a %s drafter keeps too little for it to matter; ignored",
                    recipe.method)
    # greedy regeneration: every reply token is the target's argmax
    drafter.data_is_target_greedy = recipe.data.mode == "regenerate" and recipe.data.temperature == 0
    vocab_size = recipe.drafter.draft_vocab_size
    if vocab_size:
        counts = assistant_token_counts(train_rows["input_ids"], train_rows["loss_mask"], target.vocab_size)
        vocab = draft_vocabulary(counts, vocab_size, always=target.eos_token_ids)
        drafter.set_draft_vocabulary(vocab)
        drafter.metadata["draft_vocab_coverage"] = coverage(counts, vocab)
        log.info("draft vocabulary: %d tokens cover %.1f%% of training reply tokens", vocab_size,
                 100 * drafter.metadata["draft_vocab_coverage"])
    init_from = recipe.drafter.init_from
    if init_from:                  # its weights, its draft vocabulary (the rows of its lm_head) included
        warm_start(drafter, init_from)
        log.info("warm start from %s", init_from)
    return drafter


def fit(recipe: Recipe, target: Target | None = None, progress: bool = True) -> TrainReport:
    """Train the recipe's drafter on output_dir/data (made first if missing); write output_dir/checkpoint.

    Refuses, before any work, an output_dir it cannot write, one that another process is using, and
    one whose trained checkpoint would be replaced without resume=true or overwrite=true."""
    guard_output(recipe)
    accelerator = make_accelerator(recipe)
    # before any work, on every process: one output_dir all of them see, one recipe (heads/infra/launch_checks.py)
    check_launch(recipe.out, recipe.to_dict(), accelerator.process_index, accelerator.num_processes)
    if not accelerator.is_main_process:    # the main process holds output_dir's lock for the whole run
        return _fit(recipe, accelerator, target, progress)
    with DirectoryLock(recipe.out, "training run"):
        return _fit(recipe, accelerator, target, progress)


def _fit(recipe: Recipe, accelerator, target: Target | None, progress: bool) -> TrainReport:
    torch.manual_seed(recipe.seed)
    require_data_for_launch(recipe, accelerator.num_processes)
    if target is None:
        target = training_target(recipe, accelerator)
    elif not same_device(target.device, accelerator.device):
        raise ValueError(f"the target given to fit() is on {target.device} but training runs on "
                         f"{accelerator.device}: load it with device={str(accelerator.device)!r}")
    check_drafter_size(recipe, target, accelerator.num_processes)      # before data is made or it is allocated
    check_sequence_memory(recipe, target, accelerator.num_processes)   # and the length it trains at
    layers = feature_layers(recipe, target)
    try:            # under a launch, each process checks and builds its own share of the feature cache
        data = load_training_data(recipe, target, layers, accelerator)
    except TargetError:
        if target.layers_loaded:
            raise
        log.info("the feature cache needs work: loading the whole target")     # a shard to (re)build
        with whole_target(accelerator):
            target = recipe.target.load(accelerator.device)
        data = load_training_data(recipe, target, layers, accelerator)
    seed = recipe.seed if recipe.train.seed is None else recipe.train.seed     # train.seed: init and batch order
    torch.manual_seed(seed)             # the drafter's init must not depend on what ran before (data, checks)
    drafter = build_drafter(recipe, target, data.train).to(accelerator.device)
    require_checkpoint_space(recipe.out / "checkpoint", drafter)         # before any step is trained
    global_batch = recipe.train.batch_size * accelerator.num_processes
    batches = Batches(data.train, global_batch, seed, data.features)
    heldout = Batches(data.heldout, recipe.train.batch_size, 0, data.features)
    steps_per_epoch = max(1, len(batches) // recipe.train.grad_accum)
    total_steps = math.ceil(steps_per_epoch * recipe.train.epochs)
    if recipe.train.max_steps:
        total_steps = min(total_steps, recipe.train.max_steps)
    if recipe.train.optimizer == "muon" and sharding_of(accelerator):
        raise RecipeError(f"train.optimizer muon runs under DDP or in one process; this launch shards the drafter "
                          f"with {sharding_of(accelerator)}, whose optimizer state draftsmith saves for AdamW only: "
                          "launch with recipes/accelerate/ddp.yaml, or set train.optimizer adamw")
    optimizer = build_optimizer(drafter, recipe.train)
    clock = LaunchClock(recipe.train.max_minutes * 60 if recipe.train.max_minutes else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(recipe.train.warmup_steps, total_steps, clock))
    fill_deepspeed_sizes(accelerator, target.hidden_size)
    model, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)
    _write_launch(recipe, accelerator, target)

    progress_state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "tokens": 0, "seconds": 0.0}
    checkpoint_dir = recipe.out / "checkpoint"
    if recipe.resume:
        progress_state = load_state(checkpoint_dir, recipe, accelerator, model, optimizer, scheduler)
        log.info("resuming at step %d (epoch %d, batch %d)", progress_state["step"], progress_state["epoch"],
                 progress_state["batch_in_epoch"])
    if recipe.train.report_to != "none":
        accelerator.init_trackers(recipe.train.wandb_project, config=_flat(recipe.to_dict()),
                                  init_kwargs={"wandb": {"dir": str(recipe.out / "logs")}})
    report = _run(recipe, accelerator, target, model, optimizer, scheduler, batches, heldout,
                  total_steps, progress_state, checkpoint_dir, progress, clock)
    # the DDP wrapper (and its gradient reducer) must go before end_training() destroys the process group:
    # freed afterwards, the reducer holds the last reference and gloo's teardown deadlocks on the GIL
    del model, optimizer, scheduler
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()
    return report


def _write_launch(recipe, accelerator, target) -> None:
    """logs/launch.json: how the run was spread (what accelerate actually did, not what was asked)."""
    if accelerator.is_main_process:
        (recipe.out / "logs").mkdir(parents=True, exist_ok=True)
        (recipe.out / "logs" / "launch.json").write_text(json.dumps({
            "distributed_type": accelerator.distributed_type.name if hasattr(accelerator.distributed_type, "name")
            else str(accelerator.distributed_type),
            "processes": accelerator.num_processes, "device": str(accelerator.device),
            "zero_stage": zero_stage(accelerator), "mixed_precision": accelerator.mixed_precision,
            "target": "whole" if target.layers_loaded else "embedding and lm_head only"}, indent=1))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


class Window:
    """Running sums between two log steps, kept on the training device: the host waits for the device
    only at a log step or a checkpoint, never per micro-batch.  A non-finite loss is noted on the device
    too (its step and value) and raised at the next log step or checkpoint, whichever comes first, so
    no checkpoint is ever written after it."""

    def __init__(self, device, first_step: int = 0, cache_note: str = ""):
        self.device = device
        self.first_step, self.cache_note = first_step, cache_note   # a bad first step: the cache named
        self.unflushed_tokens = torch.zeros((), dtype=torch.long, device=device)   # for state["tokens"]
        self.first_bad_step = torch.full((), -1, dtype=torch.long, device=device)
        self.first_bad_loss = torch.zeros((), device=device)
        self.reset()

    def reset(self) -> None:
        self.correct = self.counted = self.grad_norm = None
        self.loss = torch.zeros((), device=self.device)
        self.tokens = torch.zeros((), dtype=torch.long, device=self.device)
        self.steps = 0
        self.start = time.time()

    def add(self, out, tokens: torch.Tensor, share: float, step: int) -> None:
        loss = out.loss.detach().float()
        self.correct = out.correct.detach() if self.correct is None else self.correct + out.correct.detach()
        self.counted = out.counted.detach() if self.counted is None else self.counted + out.counted.detach()
        self.loss += loss * share
        self.tokens += tokens
        self.unflushed_tokens += tokens
        first = (self.first_bad_step < 0) & ~torch.isfinite(loss)
        self.first_bad_step = torch.where(first, step, self.first_bad_step)
        self.first_bad_loss = torch.where(first, loss, self.first_bad_loss)

    def flush(self, state: dict, checkpoint_dir) -> None:
        """One wait for the device: the non-finite check, and this process's tokens into `state`."""
        bad = int(self.first_bad_step)
        if bad >= 0:
            cause = (self.cache_note if bad == self.first_step and self.cache_note else
                     "lower train.lr or check the data")
            raise TrainingError(
                f"the loss became {float(self.first_bad_loss)} at step {bad}: training stopped. The last good "
                f"checkpoint ({checkpoint_dir}) is kept; {cause}, then resume=true")
        state["tokens"] += int(self.unflushed_tokens)
        self.unflushed_tokens.zero_()


def cache_note(settings) -> str:
    """What a non-finite loss at a run's first step points to when the feature cache was not wholly hashed."""
    if settings.features != "cache" or settings.verify_cache == "always":
        return ""
    return ("at the first step of this run a damaged feature cache is the likely cause (this run hashed only parts "
            f"of it: train.verify_cache={settings.verify_cache}): run again with train.verify_cache=always, which "
            "rebuilds any shard whose bytes changed; otherwise lower train.lr or check the data")


def _run(recipe, accelerator, target, model, optimizer, scheduler, batches, heldout, total_steps,
         state, checkpoint_dir, progress, clock: LaunchClock) -> TrainReport:
    settings = recipe.train
    drafter = accelerator.unwrap_model(model)
    layers = drafter.required_layers
    log_path = recipe.out / "logs" / "train.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    history: list[dict] = []
    window = Window(accelerator.device, state["step"], cache_note(settings))
    clock.restart(state["seconds"])        # the steps begin now (a resume: after the seconds trained before)
    stopped_by = "epochs"
    done = state["step"] >= total_steps
    share = 1 / (accelerator.num_processes * settings.grad_accum)   # this micro-batch's share of the step's mean
    workers = loader_workers(settings, accelerator.device)
    while not done:
        sampler = batches.epoch(state["epoch"])
        loader = accelerator.prepare(sampler.loader(workers, pin_memory=accelerator.device.type == "cuda"))
        skipped = accelerator.skip_first_batches(loader, state["batch_in_epoch"]) if state["batch_in_epoch"] else loader
        for batch in skipped:
            if state["batch_in_epoch"] % settings.grad_accum == 0:        # an optimizer step begins
                denominators = step_denominators(drafter, sampler, state["batch_in_epoch"],
                                                 settings.grad_accum).to(accelerator.device, non_blocking=True)
            batch["loss_denominators"] = denominators            # integers: no mixed precision casts them
            batch["loss_share"] = accelerator.num_processes * settings.grad_accum
            out = _train_step(accelerator, model, optimizer, scheduler, target, batch, layers, settings, window)
            state["batch_in_epoch"] += 1
            window.add(out, batch["attention_mask"].sum(), share, state["step"])
            if not accelerator.sync_gradients:
                continue
            state["step"] += 1
            window.steps += 1
            if clock.due(state["step"], settings.log_every, accelerator.num_processes):
                state["seconds"] = clock.sync(accelerator)      # rank 0's, the same step on every process
            stop = _stop_reason(settings, state, total_steps)
            saves = state["step"] % settings.save_every == 0 or bool(stop)
            if state["step"] % settings.log_every == 0 or state["step"] == total_steps:
                window.flush(state, checkpoint_dir)
                history.append(_log_window(accelerator, window, state, scheduler, log_path, progress))
            elif saves:
                window.flush(state, checkpoint_dir)
            if settings.eval_every and state["step"] % settings.eval_every == 0:
                history.append(validate(recipe, accelerator, target, model, heldout, state, log_path))
            if saves:
                save_checkpoint(checkpoint_dir, recipe, accelerator, model, optimizer, scheduler, state)
            if stop:
                stopped_by, done = stop, True
                break
        else:
            state["epoch"] += 1
            state["batch_in_epoch"] = 0
            if state["epoch"] >= math.ceil(settings.epochs):
                window.flush(state, checkpoint_dir)
                save_checkpoint(checkpoint_dir, recipe, accelerator, model, optimizer, scheduler, state)
                done = True
    final = validate(recipe, accelerator, target, model, heldout, state, log_path, calibrate=True)
    history.append(final)
    weights = accelerator.get_state_dict(model)             # gathered under FSDP / ZeRO-3
    check_replicas(accelerator, model, state, recipe.out / "logs" / "replicas.json")
    if accelerator.is_main_process:
        save_drafter(drafter, checkpoint_dir, state=weights,
                     extra={"heldout": {k: v for k, v in final.items() if k.startswith(("heldout", "eval"))}})
        write_card(checkpoint_dir)          # the model card, with the held-out figures just measured
    return TrainReport(steps=state["step"], seconds=state["seconds"], tokens=total_tokens(accelerator, state),
                       stopped_by=stopped_by, heldout_agreement=final["heldout/agreement"],
                       heldout_simulated_tau=final["heldout/simulated_tau"], checkpoint=str(checkpoint_dir),
                       history=history)


def total_tokens(accelerator, state: dict) -> int:
    """All processes' training tokens (state["tokens"] counts this process's share: what resume restores)."""
    mine = torch.tensor(state["tokens"], dtype=torch.float64, device=accelerator.device)
    return int(accelerator.reduce(mine, reduction="sum").item())


def _train_step(accelerator, model, optimizer, scheduler, target, batch, layers, settings, window):
    """One micro-batch: features, loss, backward; the optimizer steps when accumulation is complete.
    Nothing here waits for the device (the loss is checked in `Window.flush`)."""
    model.train()
    with accelerator.accumulate(model):
        batch["features"] = features_for(target, batch, layers)
        with accelerator.autocast():
            out = model(batch)
        accelerator.backward(out.loss)
        if accelerator.sync_gradients and settings.grad_clip > 0:
            norm = accelerator.clip_grad_norm_(model.parameters(), settings.grad_clip)   # DeepSpeed: None (it
            if norm is not None:                                                         # clips in its own step)
                window.grad_norm = norm.detach() if torch.is_tensor(norm) else torch.tensor(float(norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return out


def _stop_reason(settings, state, total_steps) -> str | None:
    if state["step"] >= total_steps:
        return "max_steps" if settings.max_steps and state["step"] >= settings.max_steps else "epochs"
    if settings.max_minutes is not None and state["seconds"] >= settings.max_minutes * 60:
        return "max_minutes"
    return None


def _log_window(accelerator, window: Window, state, scheduler, log_path, progress) -> dict:
    """Every process's window summed (each tensor on the accelerator's device, as NCCL requires), logged."""
    device = accelerator.device
    empty = torch.zeros(1, device=device)
    sums = torch.cat([window.correct.float().to(device) if window.correct is not None else empty,
                      window.counted.float().to(device) if window.counted is not None else empty,
                      window.loss.float().to(device).reshape(1), window.tokens.float().to(device).reshape(1)])
    sums = accelerator.reduce(sums, reduction="sum").cpu()
    k = (len(sums) - 2) // 2
    correct, counted, loss, tokens = sums[:k], sums[k:2 * k], float(sums[-2]), float(sums[-1])
    agreement = (correct / counted.clamp(min=1)).tolist()
    elapsed = time.time() - window.start
    metrics = {
        "step": state["step"], "epoch": state["epoch"],
        "train/loss": loss / max(1, window.steps),
        "train/simulated_tau": simulated_tau(agreement),
        "train/lr": scheduler.get_last_lr()[0],
        "train/tokens_per_second": tokens / elapsed if elapsed > 0 else 0.0,
        "train/step_seconds": elapsed / max(1, window.steps),
    }
    if window.grad_norm is not None:
        metrics["train/grad_norm"] = float(window.grad_norm)
    if device.type == "cuda":       # this process's peak so far (rank 0's is logged)
        metrics["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    for j, a in enumerate(agreement):
        metrics[f"train/agreement_{j}"] = a
    accelerator.log(metrics, step=state["step"])
    if accelerator.is_main_process:
        with open(log_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if progress:
            heads = " ".join(f"{a:.2f}" for a in agreement)
            print(f"step {state['step']:>5}  loss {metrics['train/loss']:.3f}  agreement [{heads}]  "
                  f"sim-tau {metrics['train/simulated_tau']:.2f}  lr {metrics['train/lr']:.2e}  "
                  f"{metrics['train/tokens_per_second']:.0f} tok/s", flush=True)
    window.reset()
    return metrics


