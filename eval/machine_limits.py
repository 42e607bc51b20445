"""How far the engine's forward is from what this machine allows (docs/metrics.md, "The machine's limit").

A target forward over n new tokens must at least read every weight it multiplies by once (memory bound:
weight bytes / bandwidth) and do 2 x weights x n multiply-adds (compute bound: FLOPs / GEMM rate); the
larger of the two is the least it can cost here.  Both rates are measured on this machine, with the
threads torch uses: the bandwidth as a read of a buffer far larger than any cache, the GEMM rate as a large
fp32 matrix product (the best this CPU's BLAS does; the small blocks of decoding reach less).  The bytes are
the weights as the engine reads them: packed fp16 linears (heads/runtime/cpu_linear.py) count 2 bytes per
weight, others their own dtype; embeddings are read a row at a time and are left out (a tied output head is
counted, as the linear it is).
"""
from __future__ import annotations

import time

import torch
from torch import nn

from draftsmith.heads.infra.device import synchronize
from draftsmith.heads.runtime.cpu_linear import PackedLinear


def _median_seconds(work, repeats: int, device) -> float:
    work()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def memory_bandwidth(device="cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a streaming read (a sum over a buffer of `megabytes`)."""
    buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32, device=device)
    return buffer.numel() * 4 / _median_seconds(lambda: buffer.sum(), repeats, device)


def gemm_rate(device="cpu", size: int = 1024, repeats: int = 5) -> float:
    """Floating-point operations per second of a square fp32 matrix product."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    return 2 * size ** 3 / _median_seconds(lambda: a @ b, repeats, device)


def linear_weights(model: nn.Module) -> tuple[int, int]:
    """(weights, bytes read) of every linear layer, as the engine reads them."""
    count = read = 0
    seen = set()
    for module in model.modules():
        if isinstance(module, PackedLinear):
            weight, size = module.weight, 2
        elif isinstance(module, nn.Linear):
            weight, size = module.weight, module.weight.element_size()
        else:
            continue
        if id(module) in seen or any(id(m) in seen for m in module.modules()):
            continue
        seen.update(id(m) for m in module.modules())
        count += weight.numel()
        read += weight.numel() * size
    return count, read


def bounds(model: nn.Module, sizes: list[int], bandwidth: float, flops: float) -> dict[int, dict[str, float]]:
    """For each block size n: the memory bound, the compute bound and their maximum, in seconds."""
    weights, read = linear_weights(model)
    out = {}
    for n in sizes:
        memory, compute = read / bandwidth, 2 * weights * n / flops
        out[n] = {"memory_s": memory, "compute_s": compute, "bound_s": max(memory, compute)}
    return out


def table(measured: dict[int, float], limits: dict[int, dict[str, float]], bandwidth: float, flops: float,
          weight_bytes: int) -> str:
    """The measured cost curve beside the machine's limit, as a Markdown table."""
    lines = [f"this machine: read bandwidth {bandwidth / 1e9:.1f} GB/s, fp32 GEMM {flops / 1e9:.0f} GFLOP/s; "
             f"linear weights read per forward {weight_bytes / 1e6:.0f} MB",
             "", "| tokens n | measured ms | memory bound ms | compute bound ms | measured / bound |",
             "|---:|---:|---:|---:|---:|"]
    for n, seconds in sorted(measured.items()):
        limit = limits[n]
        lines.append(f"| {n} | {seconds * 1000:.1f} | {limit['memory_s'] * 1000:.1f} | {limit['compute_s'] * 1000:.1f} "
                     f"| {seconds / limit['bound_s']:.1f}x |")
    return "\n".join(lines)
