"""Scale-out and tracking: DDP equals one process, W&B offline logs, DeepSpeed/FSDP configs, accelerate launches."""
import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from draftsmith.train.accelerator import reconcile_deepspeed_config
from draftsmith.train.loop import fit
from draftsmith.train.settings import TrainSettings, recipe_from_dict
from safetensors.torch import load_file
from test_train import tiny_recipe

REPO = Path(__file__).resolve().parents[1]


def run_train(recipe_path, output_dir, *overrides, processes=1):
    env = dict(os.environ, PYTHONPATH=str(REPO), ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1")
    if processes == 1:
        command = [sys.executable, "-m", "draftsmith", "train"]
    else:    # accelerate runs several CPU processes only under MPI or a torchrun-style launcher
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", "29517", "-m", "draftsmith", "train"]
    done = subprocess.run(command + [str(recipe_path), f"output_dir={output_dir}", *overrides],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (Path(output_dir) / "logs" / "train.jsonl").read_text().splitlines()]


def test_ddp_two_processes_reach_the_losses_of_one_with_the_same_global_batch(tiny_target_dir, tmp_path):
    """Stated tolerance: per-step losses within 1e-4 relative, final weights within 1e-4 absolute
    (each process normalises its loss by its own half's tokens; observed: equal to 6 digits)."""
    import shutil
    raw = tiny_recipe(tmp_path, tiny_target_dir, epochs=2, log_every=1, eval_prompts=0)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    one = run_train(recipe_path, tmp_path / "one", "train.batch_size=8")
    shutil.copytree(tmp_path / "one" / "data", tmp_path / "two" / "data")     # the same data for both
    two = run_train(recipe_path, tmp_path / "two", "train.batch_size=4", processes=2)
    losses_one = [r["train/loss"] for r in one if "train/loss" in r]
    losses_two = [r["train/loss"] for r in two if "train/loss" in r]
    assert len(losses_one) == len(losses_two) >= 4
    for a, b in zip(losses_one, losses_two):
        assert abs(a - b) <= 1e-4 * abs(a), (losses_one, losses_two)
    w1 = load_file(str(tmp_path / "one" / "checkpoint" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoint" / "model.safetensors"))
    for key in w1:
        assert torch.allclose(w1[key], w2[key], atol=1e-4), key


# -- W&B ---------------------------------------------------------------------------------------------

def wandb_history_keys(run_file: Path) -> set[str]:
    """Keys of every history row in a W&B offline transaction log (LevelDB-style records of protobufs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, keys = 32768, 7, b"", set()
    while pos + 7 <= len(data):
        if block - pos % block < 7:                        # block trailer padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload, pos = data[pos + 7: pos + 7 + length], pos + 7 + length
        if kind in (1, 4):                                 # FULL, or LAST of a split record
            record = pb.Record()
            record.ParseFromString(pending + payload if kind == 4 else payload)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                keys |= {item.key or ".".join(item.nested_key) for item in record.history.item}
        elif kind in (2, 3):                               # FIRST / MIDDLE
            pending += payload
    return keys


@pytest.mark.parametrize("mode_set", [True, False], ids=["offline", "no-network-no-mode"])
def test_wandb_logs_curves_offline(tiny_target_dir, tmp_path, monkeypatch, caplog, mode_set):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    if mode_set:
        monkeypatch.setenv("WANDB_MODE", "offline")
    else:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    raw = tiny_recipe(tmp_path, tiny_target_dir, epochs=2, report_to="wandb", eval_every=4, eval_prompts=2,
                      eval_max_new_tokens=16)
    with caplog.at_level(logging.WARNING):
        report = fit(recipe_from_dict(raw), progress=False)
    assert report.steps > 4
    if not mode_set:
        assert "logging to W&B offline" in caplog.text
    run_files = list((tmp_path / "run" / "logs").rglob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    keys = wandb_history_keys(run_files[0])
    per_step = {"train/loss", "train/simulated_tau", "train/lr", "train/grad_norm", "train/tokens_per_second",
                "train/agreement_0", "train/agreement_1", "train/agreement_2"}
    per_eval = {"heldout/simulated_tau", "heldout/agreement_0", "eval/tau", "eval/acceptance_0",
                "eval/acceptance_table._type"}     # a W&B Table: one row per draft position
    assert per_step <= keys, per_step - keys
    assert per_eval <= keys, per_eval - keys


# -- DeepSpeed / FSDP / accelerate configs --------------------------------------------------------------

CONFIGS = sorted((REPO / "recipes" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_accelerate_configs_are_complete_and_name_their_command(path):
    config = yaml.safe_load(path.read_text())
    assert path.read_text().startswith("# accelerate launch --config_file recipes/accelerate/")
    assert config["distributed_type"] in ("MULTI_GPU", "FSDP", "DEEPSPEED")
    assert config["num_processes"] >= 1 and config["num_machines"] >= 1
    if config["distributed_type"] == "DEEPSPEED":
        ds_file = REPO / config["deepspeed_config"]["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] == int(path.stem[-1])
        reconcile_deepspeed_config(dict(ds), TrainSettings(batch_size=2, grad_accum=4), 8)
    if config["distributed_type"] == "FSDP":
        assert config["fsdp_config"]["fsdp_state_dict_type"] == "FULL_STATE_DICT"   # checkpoints stay whole


def test_deepspeed_config_that_disagrees_with_the_recipe_is_named():
    settings = TrainSettings(batch_size=4, grad_accum=2)
    filled = reconcile_deepspeed_config({"train_micro_batch_size_per_gpu": "auto"}, settings, 8)
    assert filled["train_micro_batch_size_per_gpu"] == 4 and filled["train_batch_size"] == 64
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=16 but the recipe has train.batch_size=4"):
        reconcile_deepspeed_config({"train_micro_batch_size_per_gpu": 16}, settings, 8)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=1 but the recipe has train.grad_accum=2"):
        reconcile_deepspeed_config({"gradient_accumulation_steps": 1}, settings, 8)
    with pytest.raises(ValueError, match=r"train_batch_size=10 but the recipe gives 64"):
        reconcile_deepspeed_config({"train_batch_size": 10}, settings, 8)
