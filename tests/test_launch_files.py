"""The shipped launch files are what the tests launch: each of recipes/accelerate/*.yaml runs exactly as
its first line writes it, with CPU overrides only (2 CPU processes over gloo, a free port, a tiny
target), held-out decoding on, train.max_minutes as the stop, and rank 1 started seconds after rank 0.

What a GPU user meets first is checked here on the CPU: the configs' bf16 against a recipe whose
train.mixed_precision is auto or bf16 (the 8B recipe's), ZeRO-3 and FSDP with held-out decoding (the
main process alone must make no collective call), and one clock for the whole launch (every process
stops at the same step; DDP's replicas end bit-identical)."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from draftsmith.heads.drafter import checkpoint_target, load_drafter
from conftest import tiny_recipe

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("ddp", "fsdp", "deepspeed-zero2", "deepspeed-zero3")
DELAY = 'import os, time\nif os.environ.get("RANK") == "1":\n    time.sleep(float(os.environ["RANK1_DELAY"]))\n'


def documented_command(config: str, recipe: Path) -> list[str]:
    """The config file's first line, RECIPE replaced; `accelerate` is this environment's."""
    first = (REPO / "recipes" / "accelerate" / f"{config}.yaml").read_text().splitlines()[0]
    argv = shlex.split(first.lstrip("# "))
    assert argv[:2] == ["accelerate", "launch"] and argv[-1] == "RECIPE", first
    return [str(Path(sys.executable).with_name("accelerate"))] + argv[1:-1] + [str(recipe)]


def cpu_overrides(command: list[str], port: int) -> list[str]:
    """The CPU overrides: 2 processes, a port of this test's own (after `launch`, before the config)."""
    return command[:2] + ["--num_processes", "2", "--main_process_port", str(port)] + command[2:]


@pytest.fixture(scope="module")
def launch_data(tiny_target_dir, tmp_path_factory):
    """The tiny recipe (train.mixed_precision bf16, as the 8B recipe's) and its data, made once."""
    work = tmp_path_factory.mktemp("launch-files")
    raw = tiny_recipe(work, tiny_target_dir, epochs=100000, log_every=2, save_every=1000, eval_prompts=2,
                      eval_every=0, eval_max_new_tokens=8, max_minutes=0.12, mixed_precision="bf16")
    raw["output_dir"] = str(work / "data-run")
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "draftsmith", "data", str(path)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return path, work / "data-run" / "data"


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", CONFIGS)
def test_a_shipped_launch_file_runs_as_its_first_line_says(config, launch_data, tmp_path):
    import shutil

    recipe, data = launch_data
    out = tmp_path / "run"
    shutil.copytree(data, out / "data")
    site = tmp_path / "site"                       # rank 1 starts late: sitecustomize sleeps in it
    site.mkdir()
    (site / "sitecustomize.py").write_text(DELAY)
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK1_DELAY="4",
               PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    command = cpu_overrides(documented_command(config, recipe), 29600 + CONFIGS.index(config))
    done = subprocess.run(command + [f"output_dir={out}"], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-3000:]

    ran = json.loads((out / "logs" / "launch.json").read_text())
    assert ran["processes"] == 2 and ran["mixed_precision"] == "bf16", ran       # the config's bf16, taken
    assert ran["distributed_type"] == {"ddp": "MULTI_CPU", "fsdp": "FSDP"}.get(config, "DEEPSPEED")
    log = [json.loads(line) for line in (out / "logs" / "train.jsonl").read_text().splitlines()]
    assert any("eval/tau" in r for r in log), "held-out decoding did not run"
    replicas = json.loads((out / "logs" / "replicas.json").read_text())
    steps = [r["step"] for r in replicas["processes"]]
    assert len(steps) == 2 and steps[0] == steps[1], replicas          # one clock: the same last step
    assert json.loads((out / "checkpoint" / "state" / "progress.json").read_text())["step"] == steps[0]
    assert "stopped by max_minutes" in done.stdout, done.stdout[-1500:]
    if config == "ddp":
        assert replicas["replicated"]
        assert replicas["processes"][0]["weights_sha256"] == replicas["processes"][1]["weights_sha256"]
    checkpoint = out / "checkpoint"
    drafter = load_drafter(checkpoint, checkpoint_target(json.loads((checkpoint / "config.json").read_text()),
                                                         "float32", "cpu"))
    assert drafter.kind == "medusa"


def test_every_shipped_launch_file_takes_the_8b_recipes_bf16(monkeypatch):
    """The 8B recipe trains in bf16.  DDP's and FSDP's launch files say bf16; accelerate refuses a
    mixed_precision beside a DeepSpeed JSON and exports `no` for it, so under DeepSpeed the JSON's
    bf16.enabled is what counts: "auto" in the shipped JSONs (the recipe decides), true or false compared."""
    from draftsmith.train.accelerator import launch_precision

    recipe = yaml.safe_load((REPO / "recipes" / "eagle3-llama-3.1-8b.yaml").read_text())["train"]["mixed_precision"]
    assert recipe == "bf16"
    for config in CONFIGS:
        launch = yaml.safe_load((REPO / "recipes" / "accelerate" / f"{config}.yaml").read_text())
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", str(launch.get("mixed_precision", "no")))  # as launched
        if config.startswith("deepspeed"):
            monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
            monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE",
                               str(REPO / launch["deepspeed_config"]["deepspeed_config_file"]))
        assert launch_precision(recipe) == "bf16", config
        monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
        monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)


def test_a_deepspeed_json_that_contradicts_the_recipe_is_named(monkeypatch, tmp_path):
    from draftsmith.train.accelerator import launch_precision

    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"bf16": {"enabled": False}}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(config))
    assert launch_precision("no") == "no" and launch_precision("auto") == "no"
    with pytest.raises(ValueError, match=r"DeepSpeed config '.*ds.json' sets bf16.enabled=false but the recipe has "
                                         r"train.mixed_precision=bf16"):
        launch_precision("bf16")


def test_a_precision_contradiction_names_the_launch_file(tmp_path):
    """Under `accelerate launch --config_file F`, the refusal of a recipe's other precision names F
    (read from the launcher's command line)."""
    script = tmp_path / "child.py"
    script.write_text("import sys\nfrom draftsmith.train.accelerator import launch_config_file\n"
                      "print(launch_config_file())\n")
    wrapper = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))",
               sys.executable, str(script), "--config_file", "recipes/accelerate/deepspeed-zero3.yaml"]
    # the child's parent is the wrapper, whose command line carries --config_file
    done = subprocess.run(wrapper, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.stdout.strip() == "(recipes/accelerate/deepspeed-zero3.yaml)", done.stdout + done.stderr
