"""Held-out validation inside the training loop: top-1 agreement per draft position over the held-out
batches (every process its share), real speculative decoding of a few held-out prompts, and at the
end the check that the replicas of a data-parallel run hold the same weights."""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math

import torch
from accelerate.utils import DistributedType

from draftsmith.heads.decoding.metrics import per_position_acceptance, simulated_tau, tau
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import drafter_from_state
from draftsmith.heads.infra.launch_checks import in_process_group
from draftsmith.heads.registry import registry
from draftsmith.heads.runtime.target import Target

from .accelerator import whole_parameters

log = logging.getLogger(__name__)


class ReplicaError(RuntimeError):
    """The processes of a data-parallel run ended with different weights or at different steps."""


def features_for(target: Target, batch: dict, layers) -> dict:
    """Cached features when the batch carries them (moved to the device), else the target computes them."""
    if "features" in batch:
        return {i: f.to(target.device, non_blocking=True) for i, f in batch["features"].items()}
    if not layers:                      # a drafter that computes its own (Medusa-2)
        return {}
    return target.features(batch["input_ids"], batch["attention_mask"], layers)


@torch.no_grad()
def decode_heldout(recipe, target, drafter, heldout) -> dict:
    """Real speculative decoding of held-out prompts with the drafter as it is now: tau, per-position acceptance."""
    was_training = drafter.training
    drafter.eval()
    accepted: list[int] = []
    for ids, mask in itertools.islice(zip(heldout.rows["input_ids"], heldout.rows["loss_mask"]),
                                      recipe.train.eval_prompts):
        prompt = ids[: mask.index(1)] if 1 in mask else ids
        accepted += decode(target, prompt, recipe.train.eval_max_new_tokens, drafter=drafter).accepted
    drafter.train(was_training)
    depth = max(accepted, default=0)
    return {"eval/tau": tau(accepted), "eval/per_position_acceptance": per_position_acceptance(accepted, max(depth, 1))}


def heldout_decoding(recipe, accelerator, target, model, heldout) -> dict:
    """decode_heldout on the main process, with a drafter that makes no collective call.

    Under DDP the unwrapped drafter is whole on every process.  Under FSDP or ZeRO-3 each layer's
    call gathers its parameters from every process (ZeRO-3's hooks do so, and release them after the
    layer runs, even inside GatheredParameters), so decoding there on the main process alone would
    start an all-gather the other processes never join: a hang.  Instead every process takes part in
    gathering the whole state dict once, and the main process decodes with a plain copy built from it."""
    drafter = accelerator.unwrap_model(model)
    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    if not sharded:
        return decode_heldout(recipe, target, drafter, heldout) if accelerator.is_main_process else {}
    if drafter.trains_target_adapter:
        if accelerator.is_main_process:
            log.warning("held-out decoding is skipped for a %s drafter under %s (its LoRA lives in the target)",
                        recipe.method, accelerator.distributed_type)
        return {}
    weights = accelerator.get_state_dict(model)          # every process: the shards gathered
    if not accelerator.is_main_process:
        return {}
    copy = drafter_from_state(registry()[recipe.method], recipe.drafter, target, weights, "the gathered state")
    copy.metadata = dict(drafter.metadata)
    copy.data_is_target_greedy = getattr(drafter, "data_is_target_greedy", False)
    return decode_heldout(recipe, target, copy.to(target.device), heldout)


def check_replicas(accelerator, model, state: dict, path) -> None:
    """Every process's step and a SHA-256 of its drafter's weights, gathered; under DDP (each process
    holds a whole replica) they must all be equal, or the run stops naming the processes that differ.
    logs/replicas.json keeps what was compared."""
    if accelerator.num_processes == 1 and not in_process_group():
        return
    replicated = accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    mine = {"rank": accelerator.process_index, "step": state["step"], "weights_sha256": None}
    if replicated:                       # sharded runs hold one copy of each weight: nothing to compare
        digest = hashlib.sha256()
        for name, tensor in sorted(accelerator.unwrap_model(model).state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        mine["weights_sha256"] = digest.hexdigest()
    every = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(every, mine)
    if accelerator.is_main_process:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"replicated": replicated, "processes": every}, indent=1))
    steps = {r["step"] for r in every}
    if len(steps) > 1:
        raise ReplicaError(f"the processes ended at different steps ({every}): report it")
    if replicated and len({r["weights_sha256"] for r in every}) > 1:
        raise ReplicaError("the data-parallel replicas ended with different weights: "
                           + ", ".join(f"rank {r['rank']} {r['weights_sha256'][:12]}" for r in every)
                           + "; the checkpoint is rank 0's. Report it with logs/replicas.json")


@torch.no_grad()
def validate(recipe, accelerator, target, model, heldout, state, log_path, calibrate: bool = False) -> dict:
    """Held-out top-1 agreement per draft position (and, at the end, top-k rates for tree building)."""
    with whole_parameters(accelerator, model):
        metrics, logged = _validate(recipe, accelerator, target, model, heldout, state, calibrate)
    if recipe.train.eval_prompts:                # outside the gathered parameters: see heldout_decoding
        decoded = heldout_decoding(recipe, accelerator, target, model, heldout)
        metrics.update(decoded)                  # empty on every process but the main one
    return _log_validation(recipe, accelerator, metrics, logged, state, log_path)


def _validate(recipe, accelerator, target, model, heldout, state, calibrate: bool):
    drafter = accelerator.unwrap_model(model)
    model.eval()
    correct = counted = None
    hits = hit_counted = None
    count, processes, rank = heldout.batch_count(), accelerator.num_processes, accelerator.process_index
    # Streaming: this process collates its own share (batches rank, rank + P, ...), one batch at a time.
    # Every process makes the same number of calls (ZeRO-3 gathers weights inside them, all processes
    # together): one whose share is shorter repeats batch 0, which counts for nothing.
    for i in range(math.ceil(count / processes)):
        index = i * processes + rank
        weight = 1 if index < count else 0
        batch = heldout.batch(index if weight else 0)
        batch = {k: _to_device(v, accelerator.device) for k, v in batch.items()}
        batch["features"] = features_for(target, batch, drafter.required_layers)
        with accelerator.autocast():
            out = drafter.loss(batch)
            found = drafter.topk_hits(batch) if calibrate else None
            if found is not None:
                h, c = (t * weight for t in found)
                hits = h if hits is None else hits + h
                hit_counted = c if hit_counted is None else hit_counted + c
        correct = out.correct * weight if correct is None else correct + out.correct * weight
        counted = out.counted * weight if counted is None else counted + out.counted * weight
        del batch, out
    if calibrate and hits is None:     # this process had no held-out batch (or the drafter has no static trees)
        hits, hit_counted = drafter.topk_hits(None) or (None, None)
    empty = torch.zeros(drafter.draft_positions, device=accelerator.device)
    correct = accelerator.reduce(correct.to(accelerator.device) if correct is not None else empty, reduction="sum")
    counted = accelerator.reduce(counted.to(accelerator.device) if counted is not None else empty.clone(),
                                 reduction="sum")
    agreement = (correct / counted.clamp(min=1)).tolist()
    metrics = {"step": state["step"], "heldout/agreement": agreement, "heldout/simulated_tau": simulated_tau(agreement),
               "heldout/positions": int(counted[0].item()) if counted.numel() else 0}
    if hits is not None:
        hits = accelerator.reduce(hits.to(accelerator.device), reduction="sum")
        hit_counted = accelerator.reduce(hit_counted.to(accelerator.device), reduction="sum")
        drafter.metadata["topk_accuracy"] = (hits / hit_counted.clamp(min=1)[:, None]).tolist()
    logged = {"heldout/simulated_tau": metrics["heldout/simulated_tau"],
              **{f"heldout/agreement_{j}": a for j, a in enumerate(agreement)}}
    return metrics, logged


def _log_validation(recipe, accelerator, metrics, logged, state, log_path) -> dict:
    if "eval/tau" in metrics:
        logged.update({k: v for k, v in metrics.items() if k.startswith("eval/") and not isinstance(v, list)})
        logged.update({f"eval/acceptance_{j}": a for j, a in enumerate(metrics["eval/per_position_acceptance"])})
        if recipe.train.report_to == "wandb":
            import wandb  # optional at run time: only with train.wandb
            rows = [[state["step"], j, a] for j, a in enumerate(metrics["eval/per_position_acceptance"])]
            logged["eval/acceptance_table"] = wandb.Table(columns=["step", "position", "acceptance"], data=rows)
    accelerator.log(logged, step=state["step"])
    if accelerator.is_main_process:
        with open(log_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
    return metrics


def _to_device(value, device):
    """A batch's tensors (and its {layer: features} dict) on the training device."""
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    return value
