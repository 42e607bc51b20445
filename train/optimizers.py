"""The training optimizer: AdamW over every trained parameter (`train.optimizer: adamw`, the default), or
Muon over the drafter's hidden matrices with AdamW over the rest (`train.optimizer: muon`), the split
speculators trains EAGLE-3 with in 2026.

Muon orthogonalises each 2-D weight's momentum update by Newton-Schulz iterations (`Muon` below).  It
takes the matrices with both sides above 1 whose name is not a vocabulary's: the embedding, the heads over
the vocabulary (`lm_head`) and DSpark's Markov factors stay with AdamW, as do norms, biases and P-EAGLE's
mask state.  Its settings are speculators' defaults: `train.muon_lr` (null: train.lr, speculators 0.9.0's
rule) with the update scaled to AdamW's RMS (adjust_lr_fn "match_rms_adamw"), momentum 0.95, weight decay
0.1, 5 Newton-Schulz steps.

draftsmith runs the iterations itself rather than through torch.optim.Muon, which runs them in bfloat16
everywhere: right on a GPU, and about 90x slower than float32 on a CPU without bf16 arithmetic (a 1536 x 576
matrix's five iterations took 85 s in bf16 against 0.9 s in fp32 on the 2-core AVX2 EPYC, one thread, beside
another job; a CPU training step took minutes).  Here
they run in bf16 on CUDA and in float32 elsewhere.

The two run as one optimizer object (`MuonWithAdamW`): one set of parameter groups for the learning-rate
schedule and the gradient clip, one state_dict (tensors and numbers only) for the resume state.
"""
from __future__ import annotations

import math

import torch

OPTIMIZERS = ("adamw", "muon")
ADAMW_NAMES = ("embed", "lm_head", "markov_w")       # vocabulary-sized matrices: AdamW, as Muon's practice has it
MUON = {"momentum": 0.95, "weight_decay": 0.1, "ns_steps": 5}
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)            # the quintic iteration's coefficients (Muon's)


def orthogonalize(update: torch.Tensor, steps: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to `update`, approximately (Newton-Schulz, `steps` iterations), in
    `dtype`: by default bf16 on CUDA and float32 elsewhere (a CPU's bf16 matmul is emulated, ~90x slower)."""
    dtype = dtype or (torch.bfloat16 if update.device.type == "cuda" else torch.float32)
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)                  # spectral norm at most 1
    a, b, c = NEWTON_SCHULZ
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """Muon over 2-D weights: Nesterov momentum, the update orthogonalised, scaled by 0.2 sqrt(max(rows,
    cols)) so its RMS matches AdamW's (speculators' `match_rms_adamw`) and applied with decoupled weight decay."""

    def __init__(self, params, lr: float, momentum: float, weight_decay: float, ns_steps: int):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "ns_steps": ns_steps})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buffer = state["momentum_buffer"]
                buffer.lerp_(p.grad, 1 - mu)
                update = orthogonalize(p.grad.lerp(buffer, mu), group["ns_steps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"] * 0.2 * math.sqrt(max(p.shape)))
        return loss


def muon_split(named: list[tuple[str, torch.nn.Parameter]]) -> tuple[list, list]:
    """(Muon's parameters, AdamW's) of one parameter group, by shape and name."""
    muon, adamw = [], []
    for name, p in named:
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(hint in name for hint in ADAMW_NAMES)
        (muon if matrix else adamw).append(p)
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped together, their parameter groups seen as one list (the scheduler and the
    gradient clip act on both), their states saved and restored as one."""

    def __init__(self, *parts: torch.optim.Optimizer):
        self.parts = list(parts)
        super().__init__([p for o in self.parts for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in self.parts for g in o.param_groups]      # the same dicts: lr follows

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon_with_adamw": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict) -> None:
        parts = state_dict.get("muon_with_adamw")
        if not isinstance(parts, list) or len(parts) != len(self.parts):
            raise ValueError("the saved optimizer state is not Muon with AdamW's (train.optimizer muon): resume "
                             "with the optimizer the run was trained with")
        for part, saved in zip(self.parts, parts):
            part.load_state_dict(saved)


def build_optimizer(drafter, settings) -> torch.optim.Optimizer:
    """The optimizer `settings.optimizer` names over `drafter.param_groups(lr)` (each group's own lr kept)."""
    groups = drafter.param_groups(settings.lr)
    if settings.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, weight_decay=settings.weight_decay)
    names = {id(p): n for n, p in drafter.named_parameters()}
    muon_groups, adamw_groups = [], []
    ratio = (settings.muon_lr or settings.lr) / settings.lr        # a group's own lr scaled alike (Medusa-2's)
    for group in groups:
        muon, adamw = muon_split([(names[id(p)], p) for p in group["params"]])
        rest = {k: v for k, v in group.items() if k != "params"}
        if muon:
            muon_groups.append({**rest, "params": muon, **({"lr": rest["lr"] * ratio} if "lr" in rest else {})})
        if adamw:
            adamw_groups.append({**rest, "params": adamw})
    if not muon_groups:
        raise ValueError(f"train.optimizer muon: this {drafter.kind} drafter has no matrix Muon would train (it "
                         "orthogonalises hidden 2-D weights only); use train.optimizer adamw")
    parts = [Muon(muon_groups, lr=settings.muon_lr or settings.lr, **MUON)]
    if adamw_groups:
        parts.append(torch.optim.AdamW(adamw_groups, lr=settings.lr, betas=settings.betas,
                                       weight_decay=settings.weight_decay))
    return MuonWithAdamW(*parts)
