"""The training optimizer: AdamW over every trained parameter (`train.optimizer: adamw`, the default), or
Muon over the drafter's hidden matrices with AdamW over the rest (`train.optimizer: muon`), the split
speculators trains EAGLE-3 with in 2026.

Muon (torch.optim.Muon) orthogonalises each 2-D weight's momentum update by Newton-Schulz iterations.  It
takes the matrices with both sides above 1 whose name is not a vocabulary's: the embedding, the heads over
the vocabulary (`lm_head`) and DSpark's Markov factors stay with AdamW, as do norms, biases and P-EAGLE's
mask state.  Its settings are speculators' defaults: the group's learning rate with the update scaled to
AdamW's RMS (adjust_lr_fn "match_rms_adamw"), momentum 0.95, weight decay 0.1, 5 Newton-Schulz steps.

The two run as one optimizer object (`MuonWithAdamW`): one set of parameter groups for the learning-rate
schedule and the gradient clip, one state_dict (tensors and numbers only) for the resume state.
"""
from __future__ import annotations

import torch

OPTIMIZERS = ("adamw", "muon")
ADAMW_NAMES = ("embed", "lm_head", "markov_w")       # vocabulary-sized matrices: AdamW, as Muon's practice has it
MUON = {"momentum": 0.95, "weight_decay": 0.1, "ns_steps": 5, "adjust_lr_fn": "match_rms_adamw"}


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
    for group in groups:
        muon, adamw = muon_split([(names[id(p)], p) for p in group["params"]])
        rest = {k: v for k, v in group.items() if k != "params"}
        if muon:
            muon_groups.append({**rest, "params": muon})
        if adamw:
            adamw_groups.append({**rest, "params": adamw})
    if not muon_groups:
        raise ValueError(f"train.optimizer muon: this {drafter.kind} drafter has no matrix Muon would train (it "
                         "orthogonalises hidden 2-D weights only); use train.optimizer adamw")
    parts = [torch.optim.Muon(muon_groups, lr=settings.lr, **MUON)]
    if adamw_groups:
        parts.append(torch.optim.AdamW(adamw_groups, lr=settings.lr, betas=settings.betas,
                                       weight_decay=settings.weight_decay))
    return MuonWithAdamW(*parts)
