"""EAGLE-3's training-time-test attention at an 8B drafter's shapes: memory kept for backward and time,
through scaled_dot_product_attention (draftsmith) against the eager fp32 scores it replaced.

    python scripts/bench_ttt_attention.py --batch 2 --seq 2048 --steps 7

One draft attention of Llama-3.1-8B's shape (32 heads, 8 KV heads, head dim 128, input 2 x 4096),
random weights, unrolled `--steps` test-time steps, then backward.  "kept" is what autograd saves for
backward over all steps (saved_tensors_hooks, each storage counted once): the activation memory the
attention adds to a training step.  The eager path is tests/test_eagle3.py's reference (the code
before the change).  fp32 on CPU (where draftsmith's kernel runs in fp32), bf16 on CUDA.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    from test_eagle3 import _eager_ttt

    from draftsmith.heads.eagle_layer import DraftAttention, LayerShape, Rotary

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = LayerShape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
                       rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                       max_position_embeddings=131072)
    torch.manual_seed(0)
    attention = DraftAttention(shape, 2 * shape.hidden_size).to(device, dtype)
    rotary = Rotary(shape).to(device)
    b, s = args.batch, args.seq
    x = torch.randn(b, s, 2 * shape.hidden_size, device=device, dtype=dtype) * 0.1
    valid = torch.ones(b, s, dtype=torch.bool, device=device)
    positions = torch.arange(s, device=device)[None].expand(b, s)
    ways = {"eager (before)": lambda *a: _eager_ttt(attention, *a), "sdpa (draftsmith)": attention.ttt}
    print(f"draft attention, Llama-3.1-8B shapes: batch {b} x {s} tokens, {args.steps} test-time steps, {dtype}, "
          f"{device}, {torch.get_num_threads()} threads")
    for name, ttt in ways.items():
        saved = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        past, total = [], torch.zeros((), device=device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = x.requires_grad_()
            for step in range(args.steps):
                cos, sin = rotary(hidden, positions + step)
                total = total + ttt(hidden, cos, sin, past, valid).float().pow(2).mean()
        total.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        weights = sum(p.numel() * p.element_size() for p in attention.parameters())
        kept = sum(saved.values()) - weights
        peak = f", peak GPU memory {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB" if device.type == "cuda" else ""
        print(f"  {name:18s} kept for backward {kept / 2 ** 30:6.2f} GiB   forward + backward {seconds:6.1f} s{peak}")
        x.grad = None
        attention.zero_grad()


if __name__ == "__main__":
    main()
