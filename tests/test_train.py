"""Recipes, the training loop, checkpoints, resume and the errors a user meets first."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import build_tiny_target, tiny_recipe
from draftsmith.heads.drafter import load_drafter
from draftsmith.heads.registry import registry
from draftsmith.heads.medusa import Medusa, MedusaConfig
from draftsmith.heads.runtime.target import Target, TargetError
from draftsmith.train import loop
from draftsmith.train.loop import TrainingError, fit
from draftsmith.train.settings import RecipeError, load_recipe, recipe_from_dict
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_recipe_loads_and_names_its_command(path):
    recipe = load_recipe(path)
    first = path.read_text().splitlines()[0]
    assert first.startswith(("# draftsmith ", "# accelerate launch", "# torchrun ")), first
    assert recipe.method in registry()


def test_unknown_recipe_key_is_named_with_the_valid_keys():
    with pytest.raises(RecipeError, match=r"unknown key\(s\) \['lr_max'\] in recipe section 'train'.*'lr'"):
        recipe_from_dict({"method": "medusa", "train": {"lr_max": 1}})
    with pytest.raises(RecipeError, match=r"unknown recipe key\(s\) \['tarjet'\]"):
        recipe_from_dict({"method": "medusa", "tarjet": {}})
    with pytest.raises(RecipeError, match="method"):
        recipe_from_dict({"method": "lookahead"})


def test_training_end_to_end_writes_a_checkpoint_that_reloads(tiny_target_dir, tmp_path):
    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_target_dir, epochs=4))
    report = fit(recipe, progress=False)
    from draftsmith.train.batches import load_training_data
    data = load_training_data(recipe, Target.load(str(tiny_target_dir), "float32"))
    train_rows, heldout_rows = data.train, data.heldout
    assert len(train_rows["id"]) + len(heldout_rows["id"]) == 40 and len(heldout_rows["id"]) > 0
    assert report.steps == 4 * (len(train_rows["id"]) // 4) and report.stopped_by == "epochs"   # full batches, 4 epochs
    losses = [h["train/loss"] for h in report.history if "train/loss" in h]
    assert losses[-1] < 0.75 * losses[0]                                   # it learns ...
    assert report.heldout_agreement[0] > 0.2                               # ... what the target says
    ckpt = Path(report.checkpoint)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["kind"] == "medusa" and config["target_layer_ids"] == [2] and len(config["topk_accuracy"]) == 3
    weights = load_file(str(ckpt / "model.safetensors"))
    assert "draft_to_target" in weights and not any(k.startswith("target") for k in weights)
    assert (ckpt / "recipe.yaml").is_file() and (ckpt / "state" / "optimizer.pt").is_file()
    target = Target.load(str(tiny_target_dir), "float32")
    drafter = load_drafter(ckpt, target)
    assert torch.equal(drafter.draft_to_target, weights["draft_to_target"])


def test_a_drafter_refuses_another_target(tiny_target_dir, tmp_path):
    target = Target.load(str(tiny_target_dir), "float32")
    drafter = Medusa(MedusaConfig(num_heads=2), target)
    from draftsmith.heads.drafter import save_drafter
    save_drafter(drafter, tmp_path / "ckpt")
    other = Target.load(str(build_tiny_target(tmp_path / "other", seed=9)), "float32")
    with pytest.raises(TargetError, match="weights_sha256"):
        load_drafter(tmp_path / "ckpt", other)


def test_target_errors_are_clear(tmp_path):
    from draftsmith.heads.runtime.assets import AssetError
    with pytest.raises(AssetError, match="not found"):
        Target.load(str(tmp_path / "nowhere"))
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(AssetError, match="no config.json"):
        Target.load(str(tmp_path / "notamodel"))
    from transformers import BertConfig, BertModel
    BertModel(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path / "bert")
    with pytest.raises(TargetError, match="causal LM"):
        Target.load(str(tmp_path / "bert"))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny_target_dir, tmp_path, monkeypatch):
    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_target_dir, epochs=1))
    original = Medusa.loss
    calls = {"n": 0}

    def poisoned(self, batch):
        out = original(self, batch)
        calls["n"] += 1
        if calls["n"] == 5:
            out.loss = out.loss * float("nan")
        return out
    monkeypatch.setattr(Medusa, "loss", poisoned)
    monkeypatch.setattr(loop, "check_sequence_memory", lambda *a: None)     # its probe's losses would count
    with pytest.raises(TrainingError, match="loss became nan at step 4.*last good checkpoint"):
        fit(recipe, progress=False)
    progress = json.loads((tmp_path / "run" / "checkpoint" / "state" / "progress.json").read_text())
    assert progress["step"] == 3                                          # saved at step 3, nothing after


TRAIN_SCRIPT = """
import sys, time
from draftsmith.train.loop import fit
from draftsmith.train.settings import load_recipe
fit(load_recipe(sys.argv[1], sys.argv[2:]), progress=False)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_training_killed_and_resumed_ends_with_the_same_weights(tiny_target_dir, tmp_path, optimizer):
    """Muon's momentum and AdamW's moments are in the resume state: a run killed and resumed ends where the
    uninterrupted run ends, bit for bit, with either optimizer."""
    raw = tiny_recipe(tmp_path, tiny_target_dir, save_every=1, optimizer=optimizer)
    raw["drafter"]["num_layers"] = 1                     # a hidden matrix per head, which Muon trains
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    env = dict(os.environ)
    base = [sys.executable, str(script), str(recipe_path)]
    # the data once, shared by both runs (so only training is compared)
    subprocess.run(base + [f"output_dir={tmp_path / 'whole'}"], check=True, env=env, timeout=600)
    import shutil
    shutil.copytree(tmp_path / "whole" / "data", tmp_path / "killed" / "data")

    from conftest import kill_at_step
    proc = subprocess.Popen(base + [f"output_dir={tmp_path / 'killed'}"], env=env)
    step_at_kill = kill_at_step(proc, tmp_path / "killed" / "checkpoint", 5)["step"]
    assert 5 <= step_at_kill < 16, "the kill did not land mid-run"
    subprocess.run(base + [f"output_dir={tmp_path / 'killed'}", "resume=true"], check=True, env=env, timeout=600)

    whole = load_file(str(tmp_path / "whole" / "checkpoint" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "killed" / "checkpoint" / "model.safetensors"))
    assert whole.keys() == resumed.keys()
    for key in whole:
        assert torch.equal(whole[key], resumed[key]), key


def test_resume_refuses_a_different_recipe(tiny_target_dir, tmp_path):
    raw = tiny_recipe(tmp_path, tiny_target_dir, epochs=1)
    fit(recipe_from_dict(raw), progress=False)
    raw["resume"] = True
    raw["train"]["lr"] = 2e-2
    with pytest.raises(ValueError, match=r"train.lr: saved 0.01, now 0.02"):
        fit(recipe_from_dict(raw), progress=False)


def test_cached_and_online_features_give_the_same_loss(tiny_target_dir, tmp_path):
    from draftsmith.train.batches import Batches, load_training_data
    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_target_dir))
    target = Target.load(str(tiny_target_dir), "float32")
    layers = (target.num_layers,)
    data = load_training_data(recipe, target, layers)
    assert data.features is not None
    batch = Batches(data.train, 4, 0, data.features).batch(0)
    torch.manual_seed(0)
    drafter = Medusa(recipe.drafter, target)
    cached = drafter.loss({**batch, "features": {i: f.float() for i, f in batch["features"].items()}})
    online = drafter.loss({**batch, "features": target.features(batch["input_ids"], batch["attention_mask"], layers)})
    assert torch.allclose(cached.loss, online.loss, rtol=1e-2)        # the cache stores bf16
    assert torch.equal(cached.counted, online.counted)


def test_a_cache_with_more_layers_serves_a_drafter_that_needs_fewer(tiny_target_dir, tmp_path):
    from draftsmith.train.batches import load_training_data
    target = Target.load(str(tiny_target_dir), "float32")
    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_target_dir))
    from draftsmith.data.distill import make_data
    make_data(target, recipe.data, tmp_path / "run" / "data", 0, progress=False,
              capture_layers=(0, 1, 2))                                 # EAGLE-3-like layers, cached
    data = load_training_data(recipe, target, (2,))                     # Medusa's: no second cache
    assert sorted(p.name for p in (tmp_path / "run" / "data" / "features").iterdir()) == ["L0-1-2"]
    batch = data.features.batch([{k: data.train[k][0] for k in ("input_ids", "shard", "row")}], 40)
    assert list(batch) == [2]
    expected = target.features(torch.tensor([data.train["input_ids"][0]]), None, [2])[2]
    n = len(data.train["input_ids"][0])
    assert torch.allclose(batch[2][0, : n - 1].float(), expected[0, : n - 1], atol=0.03, rtol=0.02)


def test_recipes_lists_the_shipped_ones_and_show_prints_what_a_run_reads(capsys, tmp_path):
    from draftsmith.cli import main

    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    shipped = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    assert [line for line in listed.splitlines() if not line.startswith(" ")] == shipped
    assert "Medusa-1 heads (frozen backbone) for SmolLM2-135M-Instruct" in listed
    assert main(["show", "medusa-smollm2-135m", "train.max_minutes=3", "drafter.num_heads=2"]) == 0
    shown = capsys.readouterr().out
    assert "  max_minutes: 3.0    # Stop after this many minutes" in shown
    assert "  num_heads: 2    # " in shown and "  device_map: null    # A target bigger than one device" in shown
    import yaml
    body = yaml.safe_load(shown)           # the comments aside, it is the resolved recipe itself
    assert body["train"]["max_minutes"] == 3.0 and body["method"] == "medusa" and body["drafter"]["num_heads"] == 2
    assert main(["show", "medusa-smollm2-135m", "train.lr=abc"]) == 2
    assert "'lr' must be a number" in capsys.readouterr().err


def test_the_python_api_of_the_docs_runs(tiny_target_dir, tmp_path):
    """The Python API of docs/usage.md (linked from the README), on a tiny model: load_recipe,
    make_recipe_data, fit, evaluate, export."""
    from draftsmith.eval.benchmark import EvalSettings, evaluate
    from draftsmith.export import export
    from draftsmith.train.batches import make_recipe_data
    from draftsmith.train.settings import load_recipe

    readme = (REPO / "docs" / "usage.md").read_text()
    for call in ("load_recipe(", "make_recipe_data(recipe, recipe.target.load())", "report = fit(recipe)",
                 "evaluate(report.checkpoint, EvalSettings(", "export(report.checkpoint, \"vllm\""):
        assert call in readme, call
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(tiny_recipe(tmp_path, tiny_target_dir, epochs=1, eval_prompts=0)))
    recipe = load_recipe(recipe_file, ["drafter.draft_vocab_size=null", "drafter.lm_head=shared"])
    make_recipe_data(recipe, recipe.target.load(), progress=False)
    report = fit(recipe, progress=False)
    result = evaluate(report.checkpoint, EvalSettings(prompts=str(tmp_path / "chats.jsonl"), limit=2, max_new_tokens=8,
                                                     exact_prompts=1, baselines=("plain",)), progress=False)
    assert result.greedy_exact and result.tau >= 1.0
    assert result.engine_matches_transformers is True and result.engine_check["tokens"] >= 1
    steps = sum(len(r["accepted"]) for r in result.per_prompt)
    assert sum(b["steps"] for b in result.acceptance_by_context) == steps > 0
    out = export(report.checkpoint, "vllm", tmp_path / "vllm")
    assert (Path(out) / "model.safetensors").is_file()
    assert load_recipe("medusa-smollm2-135m").method == "medusa"          # a shipped recipe, by name


def test_dry_run_prints_the_plan_from_a_probe_and_writes_nothing(tiny_target_dir, tmp_path, capsys):
    from draftsmith.cli import main

    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(yaml.safe_dump(tiny_recipe(tmp_path, tiny_target_dir)))
    for verb in ("data", "train"):
        assert main([verb, str(recipe_file), "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert f"{verb} --dry-run: {tmp_path / 'run'} (nothing written)" in out
        assert "source " in out and ": 40 conversations, 40 taken (5 batches of 8" in out
        assert "feature cache: about" in out and "free" in out and "tokens/s measured here" in out
        assert ("training:" in out) == (verb == "train")
        assert not (tmp_path / "run").exists()


def test_train_seed_trains_again_on_the_same_data_and_held_out_split(tiny_target_dir, tmp_path):
    """train.seed changes the drafter's initial weights and the batch order, not the data (checked against the
    recipe's seed) nor the held-out split: a second seed of a setting runs on the data already made."""
    import shutil

    first = recipe_from_dict(tiny_recipe(tmp_path, tiny_target_dir, max_steps=2))
    report = fit(first, progress=False)
    raw = tiny_recipe(tmp_path, tiny_target_dir, max_steps=2, seed=1)
    raw["output_dir"] = str(tmp_path / "again")
    shutil.copytree(tmp_path / "run" / "data", tmp_path / "again" / "data")
    again = fit(recipe_from_dict(raw), progress=False)          # the data made with seed 0 is accepted
    assert again.steps == report.steps == 2
    mine, theirs = (load_file(str(Path(r.checkpoint) / "model.safetensors")) for r in (report, again))
    assert any(not torch.equal(mine[k], theirs[k]) for k in mine if k != "draft_to_target")
    from draftsmith.train.batches import load_training_data
    target = Target.load(str(tiny_target_dir), "float32")
    split = [sorted(load_training_data(r, target).heldout["id"]) for r in (first, recipe_from_dict(raw))]
    assert split[0] == split[1] and split[0]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tiny_target):
    """The split by shape and name, and one step of each part: matrices move by Muon's orthogonalised update,
    norms and the vocabulary head by AdamW's; the schedule's lr reaches both; a bad name is refused."""
    from draftsmith.heads.eagle3 import Eagle3, Eagle3Config
    from draftsmith.train.optimizers import MuonWithAdamW, build_optimizer
    from draftsmith.train.settings import TrainSettings

    drafter = Eagle3(Eagle3Config(layer_ids=[1, 1, 2], draft_vocab_size=40), tiny_target)
    optimizer = build_optimizer(drafter, TrainSettings(optimizer="muon", lr=1e-2))
    assert isinstance(optimizer, MuonWithAdamW)
    muon, adamw = optimizer.parts
    names = {id(p): n for n, p in drafter.named_parameters()}
    on_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert "fc.weight" in on_muon and any("q_proj" in n for n in on_muon) and any("down_proj" in n for n in on_muon)
    assert "lm_head.weight" in on_adamw and all(drafter.get_parameter(n).ndim == 1 or "lm_head" in n for n in on_adamw)
    assert on_muon | on_adamw == {n for n, p in drafter.named_parameters() if p.requires_grad}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert {g["lr"] for g in muon.param_groups + adamw.param_groups} == {5e-3}
    before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
    for p in drafter.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    scheduler.step()
    moved = {n for n, p in drafter.named_parameters() if not torch.equal(p, before[n])}
    assert moved == on_muon | on_adamw
    saved = optimizer.state_dict()
    fresh = build_optimizer(drafter, TrainSettings(optimizer="muon", lr=1e-2))
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.parts[0].state[drafter.fc.weight]["momentum_buffer"],
                       muon.state[drafter.fc.weight]["momentum_buffer"])
    with pytest.raises(ValueError, match="not Muon with AdamW's"):
        fresh.load_state_dict(torch.optim.AdamW(drafter.parameters()).state_dict())
    from draftsmith.train.settings import RecipeError
    with pytest.raises(RecipeError, match="train.optimizer must be adamw or muon, got 'sgd'"):
        TrainSettings(optimizer="sgd")
    tenfold = build_optimizer(drafter, TrainSettings(optimizer="muon", lr=1e-2, muon_lr=0.1))
    assert {g["lr"] for g in tenfold.parts[0].param_groups} == {0.1}
    assert {g["lr"] for g in tenfold.parts[1].param_groups} == {1e-2}
    with pytest.raises(RecipeError, match="train.muon_lr must be > 0"):
        TrainSettings(muon_lr=0)


def test_draftsmiths_muon_steps_as_torchs_reference_and_orthogonalises():
    """One Muon step here equals torch.optim.Muon's (momentum, Nesterov, the update scaled to AdamW's RMS,
    decoupled weight decay) within torch's bf16 Newton-Schulz rounding, on two small matrices; the
    orthogonalised update of a random matrix has singular values near 1."""
    from draftsmith.train.optimizers import MUON, Muon, orthogonalize

    torch.manual_seed(0)
    mine = [torch.nn.Parameter(torch.randn(8, 24)), torch.nn.Parameter(torch.randn(20, 6))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    ours = Muon(mine, lr=0.02, **MUON)
    reference = torch.optim.Muon(theirs, lr=0.02, adjust_lr_fn="match_rms_adamw", **MUON)
    for step in range(3):
        grads = [torch.randn_like(p) for p in mine]
        for p, q, g in zip(mine, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        reference.step()
        for p, q in zip(mine, theirs):
            torch.testing.assert_close(p, q, rtol=0, atol=0.02 * 0.02 * 0.2 * 24 ** 0.5)
    singular = torch.linalg.svdvals(orthogonalize(torch.randn(64, 32), 5))
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_muon_under_a_sharded_launch_is_refused_by_name(tiny_target_dir, tmp_path, monkeypatch):
    """FSDP and DeepSpeed save AdamW's state only: a launch that shards the drafter refuses train.optimizer muon
    before any step, naming the launch and the two ways out."""
    from draftsmith.train import loop
    from draftsmith.train.settings import RecipeError

    monkeypatch.setattr(loop, "sharding_of", lambda accelerator: "fsdp")
    with pytest.raises(RecipeError, match="shards the drafter with fsdp.*ddp.yaml, or set train.optimizer adamw"):
        fit(recipe_from_dict(tiny_recipe(tmp_path, tiny_target_dir, optimizer="muon")), progress=False)
    assert not (tmp_path / "run" / "checkpoint").exists()
