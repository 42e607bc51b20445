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
from conftest import tiny_recipe

REPO = Path(__file__).resolve().parents[1]


def run_train(recipe_path, output_dir, *overrides, processes=1, config=None, port=29517):
    """`draftsmith train` in one process, or under `accelerate launch --config_file
    recipes/accelerate/<config>.yaml` with `processes` CPU processes, as the README writes it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if config is None:
        env["ACCELERATE_USE_CPU"] = "true"
        command = [sys.executable, "-m", "draftsmith", "train"]
    else:
        command = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                   f"recipes/accelerate/{config}.yaml", "--num_processes", str(processes), "--mixed_precision", "no",
                   "--main_process_port", str(port), "-m", "draftsmith", "train"]
    done = subprocess.run(command + [str(recipe_path), f"output_dir={output_dir}", *overrides],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (Path(output_dir) / "logs" / "train.jsonl").read_text().splitlines()]


def chats_of_unequal_replies(path: Path, count: int) -> Path:
    """Conversations whose source replies run from 1 to 40 words: prefilled, the rows of one batch
    hold very different numbers of reply tokens."""
    words = ["the", "time", "is", "one", "of", "the", "day", "and", "the", "night", "of", "water"]
    rows = []
    for i in range(count):
        prompt = " ".join(words[(i + j) % len(words)] for j in range(3 + i % 5))
        reply = " ".join(words[(2 * i + j) % len(words)] for j in range(1 + (i * 7) % 40))
        rows.append({"id": f"c{i}", "messages": [{"role": "user", "content": prompt},
                                                 {"role": "assistant", "content": reply}]})
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


LAUNCHES = ["ddp", "fsdp", "deepspeed-zero2", "deepspeed-zero3"]


@pytest.fixture(scope="module")
def one_process_run(tiny_target_dir, tmp_path_factory):
    """The reference: one process, batch 8, on conversations whose reply lengths differ widely."""
    tmp_path = tmp_path_factory.mktemp("one-process")
    raw = tiny_recipe(tmp_path, tiny_target_dir, epochs=2, log_every=1, eval_prompts=0)
    raw["data"].update(source=str(chats_of_unequal_replies(tmp_path / "unequal.jsonl", 40)), mode="prefill")
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    return recipe_path, run_train(recipe_path, tmp_path / "one", "train.batch_size=8"), tmp_path / "one"


@pytest.mark.multiprocess
@pytest.mark.parametrize("launch", LAUNCHES)
def test_two_processes_reach_the_losses_of_one_with_the_same_global_batch(one_process_run, tmp_path, launch):
    """`accelerate launch --config_file recipes/accelerate/<launch>.yaml --num_processes 2` on CPU
    against one process.  Stated tolerance: per-step losses within 1e-4 relative, final weights within
    1e-4 absolute.  The rows' reply lengths differ widely, so a loss averaged over each process's own
    half would not match (each loss term is divided by the step's global token count instead).
    The checkpoint is whole and loads."""
    import shutil

    from draftsmith.heads.drafter import checkpoint_target, load_drafter
    recipe_path, one, one_dir = one_process_run
    shutil.copytree(one_dir / "data", tmp_path / "two" / "data")     # the same data for both
    two = run_train(recipe_path, tmp_path / "two", "train.batch_size=4", processes=2, config=launch,
                    port=29517 + LAUNCHES.index(launch))
    ran = json.loads((tmp_path / "two" / "logs" / "launch.json").read_text())     # not a silent fallback to DDP
    assert ran["processes"] == 2 and ran["distributed_type"] == {"ddp": "MULTI_CPU", "fsdp": "FSDP"}.get(launch, "DEEPSPEED")
    if launch.startswith("deepspeed"):
        assert ran["zero_stage"] == int(launch[-1])
    losses_one = [r["train/loss"] for r in one if "train/loss" in r]
    losses_two = [r["train/loss"] for r in two if "train/loss" in r]
    assert len(losses_one) == len(losses_two) >= 4
    for a, b in zip(losses_one, losses_two):
        assert abs(a - b) <= 1e-4 * abs(a), (losses_one, losses_two)
    w1 = load_file(str(one_dir / "checkpoint" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoint" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    for key in w1:
        assert w1[key].shape == w2[key].shape and torch.allclose(w1[key], w2[key], atol=1e-4), key
    checkpoint = tmp_path / "two" / "checkpoint"
    drafter = load_drafter(checkpoint, checkpoint_target(json.loads((checkpoint / "config.json").read_text()), "float32", "cpu"))
    assert drafter.kind == "medusa"


@pytest.mark.multiprocess
def test_eagle3_under_zero3_with_an_uneven_held_out_split_matches_one_process(tiny_target_dir, tmp_path):
    """EAGLE-3 under ZeRO-3, whose weights are gathered inside every call: the held-out batches do not
    divide evenly between the processes (each still makes the same calls, or they would wait on each
    other forever), and the run reaches the one-process losses and weights."""
    import shutil

    from draftsmith.heads.runtime.target import Target
    from draftsmith.train.batches import load_training_data
    from draftsmith.train.settings import recipe_from_dict

    raw = tiny_recipe(tmp_path, tiny_target_dir, epochs=2, log_every=1, eval_prompts=0, heldout_fraction=0.3)
    raw.update(method="eagle3", drafter={"draft_vocab_size": 64, "ttt_steps": 2})
    raw["data"].update(source=str(chats_of_unequal_replies(tmp_path / "unequal.jsonl", 40)), mode="prefill")
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    one = run_train(recipe_path, tmp_path / "one", "train.batch_size=8")
    data = load_training_data(recipe_from_dict({**raw, "output_dir": str(tmp_path / "one")}),
                              Target.load(str(tiny_target_dir), "float32"))
    assert -(-len(data.heldout["id"]) // 4) % 2 == 1        # an odd number of held-out batches of 4
    shutil.copytree(tmp_path / "one" / "data", tmp_path / "two" / "data")
    two = run_train(recipe_path, tmp_path / "two", "train.batch_size=4", processes=2, config="deepspeed-zero3",
                    port=29551)
    losses_one = [r["train/loss"] for r in one if "train/loss" in r]
    losses_two = [r["train/loss"] for r in two if "train/loss" in r]
    assert len(losses_one) == len(losses_two) >= 4
    for a, b in zip(losses_one, losses_two):
        assert abs(a - b) <= 1e-4 * abs(a), (losses_one, losses_two)
    w1 = load_file(str(tmp_path / "one" / "checkpoint" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoint" / "model.safetensors"))
    for key in w1:
        assert torch.allclose(w1[key], w2[key], atol=1e-4), key
    assert [r for r in one if "heldout/agreement" in r][-1]["heldout/agreement"] == pytest.approx(
        [r for r in two if "heldout/agreement" in r][-1]["heldout/agreement"], abs=1e-6)

@pytest.mark.multiprocess
def test_an_fsdp_run_killed_and_resumed_ends_where_one_process_does(one_process_run, tmp_path):
    """FSDP's optimizer state is gathered whole into the checkpoint and spread again on resume: a
    2-process FSDP run killed mid-run (SIGKILL to the launcher's process group) and resumed reaches the
    one-process run's weights.  Resuming it without FSDP is refused, naming both."""
    import shutil

    from conftest import kill_at_step
    recipe_path, _, one_dir = one_process_run
    settings = ["train.epochs=6", "train.save_every=1"]
    run_train(recipe_path, tmp_path / "one", "train.batch_size=8", *settings)     # data: a copy of the fixture's
    shutil.copytree(one_dir / "data", tmp_path / "two" / "data")
    launch = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file", "recipes/accelerate/fsdp.yaml",
              "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "29531", "-m", "draftsmith",
              "train", str(recipe_path), f"output_dir={tmp_path / 'two'}", "train.batch_size=4", *settings]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(launch, env=env, cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    saved = kill_at_step(proc, tmp_path / "two" / "checkpoint", 4, group=True)
    assert 4 <= saved["step"] < 18 and saved["sharding"] == "fsdp", "the kill did not land mid-run"
    done = subprocess.run([sys.executable, "-m", "draftsmith", "train", str(recipe_path), f"output_dir={tmp_path / 'two'}",
                           "train.batch_size=4", *settings, "resume=true"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 2 and "saved under FSDP and this run uses one process or DDP" in done.stderr
    run_train(recipe_path, tmp_path / "two", "train.batch_size=4", *settings, "resume=true", processes=2,
              config="fsdp", port=29532)
    w1 = load_file(str(tmp_path / "one" / "checkpoint" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "two" / "checkpoint" / "model.safetensors"))
    for key in w1:
        assert torch.allclose(w1[key], w2[key], atol=1e-4), key

def _rows_of_unequal_length(target, seed=0):
    """Four rows whose lengths and reply lengths all differ (a mean per micro-batch would weigh them unequally)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for prompt, reply in ((3, 4), (5, 17), (2, 9), (6, 30)):
        ids = torch.randint(4, target.vocab_size, (prompt + reply,), generator=g)
        rows.append({"input_ids": ids.tolist(), "loss_mask": [0] * prompt + [1] * reply, "shard": "", "row": 0})
    return rows


def _loss_and_grads(drafter, target, rows, denominators=None):
    from draftsmith.train.batches import collate

    batch = collate(rows)
    batch["features"] = target.features(batch["input_ids"], batch["attention_mask"], drafter.required_layers) \
        if drafter.required_layers else {}
    if denominators is not None:
        batch["loss_denominators"] = denominators
    loss = drafter.loss(batch).loss
    grads = torch.autograd.grad(loss, [p for p in drafter.parameters() if p.requires_grad], allow_unused=True)
    return loss.detach(), grads


@pytest.mark.parametrize("kind", ["medusa", "eagle3", "eagle", "medusa2"])
def test_a_loss_split_over_micro_batches_with_the_steps_counts_equals_the_whole_batchs(tiny_target_dir, kind):
    """The loss of one batch of four rows, and the sum over two micro-batches of two rows each with the
    step's token counts as denominators, are equal, and so are their gradients.  Dividing each
    micro-batch by its own counts (what a per-micro-batch mean does) is shown to differ."""
    from draftsmith.heads.registry import registry
    from draftsmith.heads.runtime.target import Target
    from draftsmith.train.batches import collate

    target = Target.load(str(tiny_target_dir), "float32")
    cls = registry()[kind]
    settings = {"medusa": {"num_heads": 3, "lm_head": "own"}, "eagle3": {"ttt_steps": 3, "draft_vocab_size": 64},
                "eagle": {"noise": 0.0}, "medusa2": {"num_heads": 2, "lora_r": 4, "heads_only_steps": 0, "ramp_steps": 0,
                                         "heads_coefficient": 0.5}}[kind]
    torch.manual_seed(0)
    drafter = cls(cls.config_class(**settings), target)
    if kind == "medusa2":
        drafter.attach_backbone()
        for name, p in drafter.named_parameters():        # LoRA B starts at zero: give the KL term something
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.05)
    drafter.train()
    rows = _rows_of_unequal_length(target)
    counts = drafter.loss_counts(collate(rows))
    whole, whole_grads = _loss_and_grads(drafter, target, rows)
    parts = [_loss_and_grads(drafter, target, rows[i:i + 2], denominators=counts) for i in (0, 2)]
    torch.testing.assert_close(parts[0][0] + parts[1][0], whole, rtol=1e-5, atol=1e-6)
    for a, b, g in zip(parts[0][1], parts[1][1], whole_grads):
        if g is not None:
            torch.testing.assert_close(a + b, g, rtol=1e-4, atol=1e-6)
    own = [_loss_and_grads(drafter, target, rows[i:i + 2])[0] for i in (0, 2)]       # per-micro-batch means
    assert abs(float((own[0] + own[1]) / 2 - whole)) > 1e-3 * float(whole)

@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_cache_mode_training_loads_only_the_targets_embedding_and_head(tiny_target_dir, tmp_path, method):
    """With the feature cache all there and no held-out decoding, training reads two matrices of the
    target instead of the whole model, and ends on the same weights as with the whole target."""
    from draftsmith.heads.runtime.target import Target

    raw = tiny_recipe(tmp_path, tiny_target_dir, epochs=1, eval_prompts=1)
    if method == "eagle3":
        raw.update(method="eagle3", drafter={"draft_vocab_size": 64, "ttt_steps": 2})
    whole = fit(recipe_from_dict(raw), progress=False)          # makes the data and cache; decodes: whole target
    assert json.loads((tmp_path / "run" / "logs" / "launch.json").read_text())["target"] == "whole"
    w1 = load_file(str(Path(whole.checkpoint) / "model.safetensors"))
    light = Target.load(str(tiny_target_dir), "float32", "cpu", layers=False)
    assert not light.layers_loaded and light.identity == Target.load(str(tiny_target_dir), "float32", "cpu").identity
    raw["train"].update(eval_prompts=0)
    raw["overwrite"] = True
    again = fit(recipe_from_dict(raw), progress=False)
    assert json.loads((tmp_path / "run" / "logs" / "launch.json").read_text())["target"] == "embedding and lm_head only"
    assert again.heldout_agreement == pytest.approx(whole.heldout_agreement, abs=1e-6)
    w2 = load_file(str(Path(again.checkpoint) / "model.safetensors"))
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


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
    import wandb
    wandb.teardown()        # finish() may return before the W&B service has flushed the run file (seen on CI)
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


def test_the_launchers_mixed_precision_fills_auto_and_a_contradiction_is_named(monkeypatch):
    from draftsmith.train.accelerator import launch_precision

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert launch_precision("auto") == "auto" and launch_precision("no") == "no"        # no launcher: the recipe
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert launch_precision("auto") == "bf16" and launch_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match=r"accelerate config sets mixed_precision=bf16 but the recipe "
                                         r"has train.mixed_precision=no"):
        launch_precision("no")


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
