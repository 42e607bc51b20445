"""The GPU check is executed in CI: its CPU mode (`DEVICE=cpu bash scripts/gpu_check.sh`) runs every stage
that does not need CUDA through the same code as on a GPU, in a fresh virtual environment that holds only
what a GPU image brings (torch and the packages the check requires: no pytest, no default-target
package) plus what the script itself installs.  An import or API break in the script fails here."""
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IMAGE = ["torch", "transformers", "accelerate", "datasets", "peft", "safetensors", "pyyaml", "tqdm", "gguf"]


@pytest.mark.multiprocess
def test_the_gpu_checks_cpu_mode_passes_in_a_bare_image(tmp_path):
    image = tmp_path / "image"
    subprocess.run([sys.executable, "-m", "venv", str(image)], check=True, timeout=300)
    python = str(image / "bin" / "python")
    pins = [f"{name}=={version(name)}" for name in IMAGE]           # what this environment runs: no new build
    for group in (pins[:1], pins[1:]):                               # torch first: its CPU build, never CUDA's
        done = subprocess.run([python, "-m", "pip", "install", "-q", *group], capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    assert subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode != 0
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(DEVICE="cpu", SKIP_DEFAULT="1", SKIP_LAUNCHES="1", PYTHON=python, OMP_NUM_THREADS="1",
               GPU_CHECK_SITE=str(tmp_path / "site"), TMPDIR=str(tmp_path))
    done = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1500)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert done.returncode == 0, "\n".join(lines) + done.stdout[-3000:] + done.stderr[-3000:]
    passed = {line.split("  ")[1].strip() for line in lines if line.startswith("PASS")}
    for name in ("tiny: build", "tiny: data", "tiny: train medusa", "tiny: train eagle3", "tiny: eval medusa",
                 "tiny: eval eagle3", "tiny: export medusa", "tiny: export eagle3", "tiny: torchrun 1 process, gloo",
                 "data: tiny shapes, transformers, batch auto", "rehearsal: tiny shapes"):
        assert any(p.startswith(name) for p in passed), (name, lines)
    assert any(line.startswith("SKIP") and "NCCL" in line and "needs CUDA" in line for line in lines), lines
    assert not any(line.startswith("FAIL") for line in lines), lines
