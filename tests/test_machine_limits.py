"""The engine against this machine's limit (eval/machine_limits.py, issue 58): the weights' bytes as the engine
reads them, both bounds, and `scripts/decode_timing.py` printing the measured curve beside them."""
import subprocess
import sys
from pathlib import Path

from torch import nn
from draftsmith.eval import machine_limits
from draftsmith.heads.runtime.cpu_linear import PackedLinear, fbgemm_fp16_available

REPO = Path(__file__).resolve().parents[1]


def test_weights_are_counted_as_the_engine_reads_them():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False), nn.LayerNorm(4))
    assert machine_limits.linear_weights(model) == (8 * 16 + 16 * 4, 4 * (8 * 16 + 16 * 4))
    if fbgemm_fp16_available():                     # packed fp16: half the bytes, each weight counted once
        model[0] = PackedLinear(model[0])
        assert machine_limits.linear_weights(model) == (8 * 16 + 16 * 4, 2 * 8 * 16 + 4 * 16 * 4)


def test_the_bounds_follow_bytes_and_flops():
    model = nn.Linear(1000, 1000, bias=False)
    limits = machine_limits.bounds(model, [1, 1000], bandwidth=4e9, flops=2e9)
    assert limits[1]["memory_s"] == limits[1000]["memory_s"] == 4e6 / 4e9
    assert limits[1]["compute_s"] == 2 * 1e6 / 2e9 and limits[1000]["compute_s"] == 1000 * limits[1]["compute_s"]
    assert limits[1]["bound_s"] == limits[1]["memory_s"] and limits[1000]["bound_s"] == limits[1000]["compute_s"]
    assert machine_limits.memory_bandwidth(megabytes=16, repeats=2) > 1e8
    assert machine_limits.gemm_rate(size=128, repeats=2) > 1e7


def test_decode_timing_prints_the_curve_beside_the_limit(tiny_target_dir):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "decode_timing.py"), "--target", str(tiny_target_dir),
                          "--prompts", "1", "--prompt-tokens", "8", "--max-new-tokens", "4", "--rounds", "1",
                          "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 2, 4, 8, 16, 32]
    assert "read bandwidth" in out.stdout and all(r.rstrip().endswith("x |") for r in rows)
