"""Soft cross-entropy against a given distribution, fused: forward and backward in row chunks.

    loss_i = weight_i * (logsumexp(z_i) * sum(p_i) - p_i . z_i)      (= -sum_v p_iv log softmax(z_i)_v)
    d loss_i / d z_i = weight_i * (softmax(z_i) * sum(p_i) - p_i)

The plain form, `-(p * log_softmax(z)).sum(-1)`, keeps an fp32 [m, v] log-softmax for backward and
spends an [m, v] product each way.  Here the forward keeps only the logits as they came (bf16 under
autocast) and the backward recomputes softmax a chunk at a time; the drafter's argmax comes out
of the same pass.  On the default target's EAGLE-3 training step this is the largest cost after the
matrix products (README, "Training step cost").
"""
from __future__ import annotations

import torch

CHUNK_ROWS = 512         # an fp32 chunk of 512 x 8k logits is 16 MiB: it stays in cache-sized pieces


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, probs, weight):
        work = torch.promote_types(logits.dtype, torch.float32)           # fp32, or fp64 for fp64 logits
        loss = torch.empty(logits.shape[0], dtype=work, device=logits.device)
        total = torch.empty_like(loss)                                   # sum(p_i): 1 for a distribution
        top = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], CHUNK_ROWS):
                rows = slice(start, start + CHUNK_ROWS)
                z, p = logits[rows].to(work), probs[rows]
                total[rows] = p.sum(-1)
                loss[rows] = (torch.logsumexp(z, -1) * total[rows] - torch.linalg.vecdot(p, z)) * weight[rows]
                top[rows] = z.argmax(-1)
        ctx.save_for_backward(logits, probs, weight, total)
        ctx.mark_non_differentiable(top)
        return loss, top

    @staticmethod
    def backward(ctx, grad_loss, _grad_top):
        logits, probs, weight, total = ctx.saved_tensors
        grad = torch.empty_like(logits)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], CHUNK_ROWS):
                rows = slice(start, start + CHUNK_ROWS)
                scale = (grad_loss[rows] * weight[rows])[:, None]
                chunk = torch.softmax(logits[rows].to(total.dtype), -1).mul_(total[rows, None] * scale)
                grad[rows] = chunk.addcmul_(probs[rows], scale, value=-1)
        return grad, None, None


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor,
                       weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [m, v] (any float dtype), probs [m, v] (no gradient), weight [m] or None (all ones)
    -> (per-row loss [m] in fp32 (fp64 for fp64 logits), argmax of the logits [m])."""
    if logits.shape != probs.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and probs {tuple(probs.shape)} differ in shape")
    if weight is None:
        weight = torch.ones(logits.shape[0], device=logits.device)
    work = torch.promote_types(logits.dtype, torch.float32)
    return _SoftCrossEntropy.apply(logits, probs.detach().to(work), weight.detach().to(work))


class _HardCrossEntropy(torch.autograd.Function):
    """Cross-entropy against one label per row, the same way: loss_i = weight_i * (logsumexp(z_i) - z_i[y_i]),
    d loss_i / d z_i = weight_i * (softmax(z_i) - onehot(y_i)).  F.cross_entropy on fp32 copies of the
    logits keeps an fp32 [m, v] log-softmax per head: 2 GiB a head for 4k rows of a 128k vocabulary."""

    @staticmethod
    def forward(ctx, logits, labels, weight):
        work = torch.promote_types(logits.dtype, torch.float32)
        loss = torch.empty(logits.shape[0], dtype=work, device=logits.device)
        top = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], CHUNK_ROWS):
                rows = slice(start, start + CHUNK_ROWS)
                z = logits[rows].to(work)
                picked = z.gather(1, labels[rows, None])[:, 0]
                loss[rows] = (torch.logsumexp(z, -1) - picked) * weight[rows]
                top[rows] = z.argmax(-1)
        ctx.save_for_backward(logits, labels, weight)
        ctx.mark_non_differentiable(top)
        return loss, top

    @staticmethod
    def backward(ctx, grad_loss, _grad_top):
        logits, labels, weight = ctx.saved_tensors
        grad = torch.empty_like(logits)
        work = torch.promote_types(logits.dtype, torch.float32)
        with torch.autocast(logits.device.type, enabled=False):
            for start in range(0, logits.shape[0], CHUNK_ROWS):
                rows = slice(start, start + CHUNK_ROWS)
                scale = (grad_loss[rows] * weight[rows]).to(work)[:, None]
                chunk = torch.softmax(logits[rows].to(work), -1).mul_(scale)
                chunk.scatter_add_(1, labels[rows, None], -scale)
                grad[rows] = chunk
        return grad, None, None


def hard_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                       weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [m, v] (any float dtype), labels [m] in [0, v), weight [m] or None (all ones)
    -> (per-row loss [m] in fp32 (fp64 for fp64 logits), argmax of the logits [m])."""
    if labels.shape != logits.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    if weight is None:
        weight = torch.ones(logits.shape[0], device=logits.device)
    work = torch.promote_types(logits.dtype, torch.float32)
    return _HardCrossEntropy.apply(logits, labels.long(), weight.detach().to(work))


LOSSES = ("soft_ce", "tv", "lk")


def acceptance_loss(logits: torch.Tensor, probs: torch.Tensor, weight: torch.Tensor | None,
                    kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance-shaped losses, as soft_cross_entropy returns (per-row loss [m] fp32, argmax [m]).

    With q the drafter's distribution and p the target's, a draft drawn from q is accepted with probability
    a = sum_x min(p(x), q(x)) = 1 - TV(p, q).  `tv`: 1 - a (the total variation distance); `lk`: -log a
    (the log-likelihood of acceptance, steeper where acceptance is low).  `soft_ce`: -sum p log q.  The two
    acceptance losses hold one fp32 [m, v] softmax (soft_ce streams in chunks instead)."""
    if kind == "soft_ce":
        return soft_cross_entropy(logits, probs, weight)
    if kind not in LOSSES:
        raise ValueError(f"drafter.loss must be one of {', '.join(LOSSES)}, got '{kind}'")
    if weight is None:
        weight = torch.ones(logits.shape[0], device=logits.device)
    with torch.autocast(logits.device.type, enabled=False):
        q = torch.softmax(logits.float(), dim=-1)
        accepted = torch.minimum(q, probs.detach().float()).sum(-1)
        per_row = 1 - accepted if kind == "tv" else -torch.log(accepted.clamp_min(1e-6))
    return per_row * weight.detach().float(), logits.detach().argmax(-1)
