"""Data at scale: data health (a target writing junk is caught), data-parallel generation over ranks,
shards bounded in bytes, the batch size chosen from memory, and the vLLM settings' checks."""
from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import WORDS, build_tiny_target, chats_file, free_port, tiny_recipe
from draftsmith.data.distill import DataSettings, make_data, read_shard, shard_paths
from draftsmith.data.health import DegenerateData, Health, loop_tokens, require_healthy, verdict, limits_from
from draftsmith.heads.runtime.target import Target

REPO = Path(__file__).resolve().parents[1]


def test_the_loop_detector_counts_loops_and_not_text():
    assert loop_tokens([5] * 20) == 20
    assert loop_tokens([1, 2, 3] * 10) == 30
    assert loop_tokens(list(range(50))) == 0
    text = random.Random(0).choices(range(300), k=200)
    assert loop_tokens(text) == 0
    assert loop_tokens(text[:50] + [7, 8] * 10 + text[50:]) == 20       # only the loop inside the text


@pytest.fixture(scope="module")
def looping_target_dir(tmp_path_factory):
    """A tiny model made to loop: its final norm is zero, so every logit is 0 and greedy always picks
    token 0, made "," in its vocabulary, and never a stop token (`, , , , ...`)."""
    directory = build_tiny_target(tmp_path_factory.mktemp("looping"), "llama", seed=3)
    from safetensors.torch import load_file, save_file
    weights = load_file(str(directory / "model.safetensors"))
    weights["model.norm.weight"].zero_()
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = json.loads((directory / "tokenizer.json").read_text())     # id 0 becomes ",", <unk> takes its id
    vocab = tokenizer["model"]["vocab"]
    comma = vocab[","]
    vocab["<unk>"], vocab[","] = comma, 0
    for added in tokenizer.get("added_tokens", []):
        if added["content"] == "<unk>":
            added["id"] = comma
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def healthy_file(path: Path, count: int) -> Path:
    """Conversations whose replies are varied text (random words), for prefill."""
    rng = random.Random(1)
    words = [w for w in WORDS if w.isalpha()]
    rows = [{"id": f"h{i}", "messages": [{"role": "user", "content": " ".join(rng.choices(words, k=6))},
                                          {"role": "assistant", "content": " ".join(rng.choices(words, k=30))}]}
            for i in range(count)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_a_target_that_loops_is_caught_after_its_first_shards_and_the_override_keeps_the_data(
        looping_target_dir, tmp_path, caplog):
    target = Target.load(str(looping_target_dir), "float32", "cpu")
    settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", 200)), max_conversations=None,
                            batch_size=32, max_new_tokens=12)
    with pytest.raises(DegenerateData, match=r"first 128 replies.*loop_share 1\.00.*data\.mode=prefill.*"
                                             r"data\.allow_degenerate=true"):
        make_data(target, settings, tmp_path / "data", seed=0, progress=False)
    made = len(shard_paths(tmp_path / "data"))
    assert 4 <= made < 7, made                  # stopped after 128 replies, not after all 200 conversations
    allowed = DataSettings(**{**settings.__dict__, "allow_degenerate": True})
    with caplog.at_level(logging.WARNING):
        report = make_data(target, allowed, tmp_path / "data", seed=0, progress=False)      # resumes, keeps all
    assert report.conversations == 200 and report.health["loop_share"] > 0.99
    assert report.health["top_token_share"] > 0.99 and report.health["stopped_share"] == 0
    assert "data health (all 200 replies)" in caplog.text and "chat_template" in caplog.text
    saved = json.loads((tmp_path / "data" / "health.json").read_text())
    assert saved["stops"] and len(saved["shards"]) == len(shard_paths(tmp_path / "data"))
    with pytest.raises(DegenerateData, match="health.json"):           # training refuses it ...
        require_healthy(tmp_path / "data", DataSettings())
    require_healthy(tmp_path / "data", allowed)                         # ... unless told to keep it


def test_healthy_data_raises_nothing(tiny_target, tmp_path, caplog):
    settings = DataSettings(source=str(healthy_file(tmp_path / "h.jsonl", 64)), max_conversations=None,
                            batch_size=16, mode="prefill")
    with caplog.at_level(logging.WARNING):
        report = make_data(tiny_target, settings, tmp_path / "data", seed=0, progress=False)
    assert "data health" not in caplog.text
    figures = report.health
    assert figures["replies"] == 64 and figures["loop_share"] < 0.05 and figures["top_token_share"] < 0.1
    assert verdict(figures, limits_from(None)).healthy
    assert json.loads((tmp_path / "data" / "health.json").read_text())["stops"] == []


def test_health_limits_are_recipe_settings_and_checked():
    assert limits_from({"loop_share_stop": 0.9})["loop_share"][1] == 0.9
    with pytest.raises(ValueError, match="unknown limit 'loops_stop'"):
        DataSettings(health={"loops_stop": 0.5})
    with pytest.raises(ValueError, match=r"share in \[0, 1\]"):
        DataSettings(health={"loop_share_warn": 3})
    health = Health()
    for _ in range(40):
        health.add_reply([9] * 30, [2])
    assert verdict(health.figures(), limits_from({"loop_share_stop": None, "top_token_share_stop": None,
                                                  "distinct_share_stop": None})).stops == []


def test_eval_reports_the_targets_own_output_health():
    from draftsmith.data.health import eval_line, of_outputs

    junk = of_outputs([[5] * 32 for _ in range(6)], 32, [2])
    assert not junk["representative"] and "not representative" in eval_line(junk)
    rng = random.Random(0)
    text = of_outputs([rng.choices(range(10, 400), k=20) + [2] for _ in range(6)], 32, [2])
    assert text["representative"] and text["stopped_share"] == 1.0 and "not representative" not in eval_line(text)


def test_bad_data_settings_are_errors():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        DataSettings(vllm={"gpu_memory_utilization": 1.5})
    with pytest.raises(ValueError, match="unknown key"):
        DataSettings(vllm={"memory": 0.5})
    with pytest.raises(ValueError, match="shard_mb must be > 0"):
        DataSettings(shard_mb=0)
    with pytest.raises(ValueError, match="batch_size must be a whole number or auto"):
        DataSettings(batch_size="big")
    from draftsmith.data.vllm_backend import check_launch, engine_settings
    with pytest.raises(ValueError, match="data_parallel_size=4, but this launch has 2"):
        check_launch(engine_settings({"data_parallel_size": 4}), 2, 0, "cpu")


def test_tensor_parallelism_larger_than_the_visible_gpus_is_an_error(monkeypatch):
    from draftsmith.data.vllm_backend import check_launch, engine_settings

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert check_launch(engine_settings({"tensor_parallel_size": 2}), 1, 0, "cuda") == [0, 1]
    with pytest.raises(ValueError, match=r"needs 4 GPUs, and 2 are visible: \['GPU0', 'GPU1'\]"):
        check_launch(engine_settings({"tensor_parallel_size": 4}), 1, 0, "cuda")


def test_shards_past_shard_mb_are_written_as_parts_and_hold_the_same_records(tiny_target, tmp_path):
    source = str(chats_file(tmp_path / "c.jsonl", 16))
    layers = [1, tiny_target.num_layers]
    whole = DataSettings(source=source, max_conversations=None, batch_size=8, max_new_tokens=16)
    make_data(tiny_target, whole, tmp_path / "whole", seed=0, progress=False, capture_layers=layers)
    small = DataSettings(**{**whole.__dict__, "shard_mb": 0.02})              # 20 kB: a few records a file
    report = make_data(tiny_target, small, tmp_path / "small", seed=0, progress=False, capture_layers=layers)
    files = shard_paths(tmp_path / "small")
    assert len(files) > len(shard_paths(tmp_path / "whole")) and any(".part" in f.name for f in files)
    from safetensors import safe_open
    for f in (tmp_path / "small" / "features").glob("*/*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            if handle.get_tensor("offsets").numel() > 2:      # a record larger than the bound is a file alone
                assert handle.get_slice("features").get_shape()[0] * 2 * 64 * 2 <= 0.02e6, f
    assert report.conversations == 16

    def records(d):
        return sorted((r["id"], r["input_ids"]) for f in shard_paths(d) for r in read_shard(f))
    assert records(tmp_path / "small") == records(tmp_path / "whole")
    from draftsmith.data import features as feature_cache
    for f in files:
        problem = feature_cache.check_shard(feature_cache.cache_dir(tmp_path / "small", layers) / f"{f.stem}.safetensors",
                                            layers, tiny_target.identity.weights_sha256)
        assert problem is None, problem


def test_auto_batch_size_fits_the_memory_budget(tiny_target):
    from draftsmith.data.space import auto_rows

    settings = DataSettings(batch_size="auto", max_prompt_tokens=100, max_new_tokens=100)
    one = auto_rows(tiny_target, settings, [1, 2], free=10 ** 6)
    ten = auto_rows(tiny_target, settings, [1, 2], free=10 ** 7)
    assert 1 <= one < ten <= 512
    pinned = auto_rows(tiny_target, DataSettings(batch_size="auto", memory_gb=0.001), [1])
    assert pinned >= 1


def _launch(recipe_path: Path, processes: int, *overrides, check=True, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
                "--master-port", str(free_port()), "-m", "draftsmith", "data", str(recipe_path), *overrides]
               if processes > 1 else [sys.executable, "-m", "draftsmith", "data", str(recipe_path), *overrides])
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, timeout=timeout)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _records(data_dir: Path) -> dict:
    return {r["id"]: (r["input_ids"], r["loss_mask"]) for f in shard_paths(data_dir) for r in read_shard(f)}


def _features(data_dir: Path) -> dict:
    from safetensors.torch import load_file
    return {f.stem: load_file(str(f))["features"] for f in sorted((data_dir / "features").glob("*/*.safetensors"))}


@pytest.mark.multiprocess
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_two_ranks_write_exactly_what_one_process_writes(tiny_target_dir, tmp_path, temperature):
    raw = tiny_recipe(tmp_path, tiny_target_dir)
    raw["data"].update(temperature=temperature, batch_size=4)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    _launch(recipe_path, 1, f"output_dir={tmp_path / 'one'}")
    two = _launch(recipe_path, 2, f"output_dir={tmp_path / 'two'}")
    assert "over 2 processes" in two.stdout, two.stdout
    one_records, two_records = _records(tmp_path / "one" / "data"), _records(tmp_path / "two" / "data")
    assert len(one_records) == 40 and one_records == two_records
    one_features, two_features = _features(tmp_path / "one" / "data"), _features(tmp_path / "two" / "data")
    assert one_features.keys() == two_features.keys() and len(one_features) == 10
    for k in one_features:          # the same tokens' states; a batch of other rows may round one bf16 step apart
        assert torch.allclose(one_features[k].float(), two_features[k].float(), atol=2e-2, rtol=2e-2), k
    health = json.loads((tmp_path / "two" / "data" / "health.json").read_text())
    assert health["total"]["replies"] == 40 and len(health["shards"]) == 10


@pytest.mark.multiprocess
def test_a_rank_killed_mid_run_and_a_rerun_with_another_world_size_lose_and_duplicate_nothing(
        tiny_target_dir, tmp_path):
    raw = tiny_recipe(tmp_path, tiny_target_dir)
    raw["data"].update(batch_size=2, max_new_tokens=48)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    _launch(recipe_path, 1, f"output_dir={tmp_path / 'whole'}")
    shards = tmp_path / "cut" / "data" / "shards"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-port", str(free_port()), "-m", "draftsmith", "data", str(recipe_path),
                             f"output_dir={tmp_path / 'cut'}"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import signal
    import time
    deadline = time.time() + 300
    children = []            # the ranks, found before their first shard: a loaded machine must not let them finish
    while time.time() < deadline and len(children) < 2:
        victims = subprocess.run(["pgrep", "-f", f"output_dir={tmp_path / 'cut'}"], capture_output=True, text=True)
        children = [int(p) for p in victims.stdout.split() if int(p) != proc.pid]
        time.sleep(0.05)
    assert len(children) >= 2, f"rank processes not found: {children}"
    while time.time() < deadline and len(list(shards.glob("shard-*.jsonl"))) < 2:
        time.sleep(0.01)
    os.kill(children[-1], signal.SIGKILL)                   # one rank dies; the launcher ends the other
    proc.wait(timeout=120)
    made = len(list(shards.glob("shard-*.jsonl")))
    assert 0 < made < 20, made
    _launch(recipe_path, 3, f"output_dir={tmp_path / 'cut'}")      # another world size finishes it
    assert _records(tmp_path / "cut" / "data") == _records(tmp_path / "whole" / "data")
    assert len(_records(tmp_path / "whole" / "data")) == 40


@pytest.mark.multiprocess
def test_a_second_launch_on_the_same_directory_is_refused_on_every_rank(tiny_target_dir, tmp_path):
    from draftsmith.heads.infra.files import DirectoryLock

    raw = tiny_recipe(tmp_path, tiny_target_dir)
    recipe_path = tmp_path / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    with DirectoryLock(tmp_path / "run", "another run"):          # this process holds it: a launch must not start
        done = _launch(recipe_path, 2, check=False, timeout=300)
    assert done.returncode != 0
    assert done.stderr.count("is in use by another draftsmith process") >= 2, done.stderr[-3000:]
    assert not (tmp_path / "run" / "data" / "shards").exists() or not shard_paths(tmp_path / "run" / "data")


R1_TEMPLATE = (   # an R1-style template: the generation prompt opens the reasoning block
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}")


def successor_target(directory: Path, cycle_length: int | None) -> Path:
    """A tiny Llama that writes each word's successor on a cycle through the word tokens (every special
    token leads to the cycle's first word), inside the reasoning block its template opens: it never closes
    the block nor stops.  cycle_length None: through every word (long, non-repeating reasoning); 3: a loop.
    Its layers add nothing (o_proj and down_proj zero), so the last hidden state is the token's embedding and
    the head scores its successor."""
    from transformers import AutoModelForCausalLM

    from tiny_models import make_config, make_tokenizer
    tok = make_tokenizer()
    tok.add_tokens(["<think>", "</think>"], special_tokens=True)
    tok.chat_template = R1_TEMPLATE
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("llama", len(tok)))
    special = set(tok.all_special_ids) | set(tok.convert_tokens_to_ids(["user", "assistant", "system", "<think>",
                                                                        "</think>"]))
    words = [i for i in range(len(tok)) if i not in special]
    cycle = words if cycle_length is None else words[:cycle_length]
    successor = {x: cycle[(k + 1) % len(cycle)] for k, x in enumerate(cycle)}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        for x in range(len(tok)):
            if embed[x].norm() > 0:                 # the padding row is zero
                head[successor.get(x, cycle[0])] += 4 * embed[x] / embed[x].norm()
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("cycle", [None, 3], ids=["long-reasoning", "looping-in-reasoning"])
def test_replies_cut_inside_reasoning_are_counted_apart_and_a_loop_there_still_stops(cycle, tmp_path, caplog):
    target = Target.load(str(successor_target(tmp_path / "t", cycle)), "float32", "cpu")
    settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", 40)), max_conversations=None,
                            batch_size=20, max_new_tokens=24)
    if cycle is not None:
        with pytest.raises(DegenerateData, match=r"loop_share 1\.00.*every one cut inside reasoning"):
            make_data(target, settings, tmp_path / "data", seed=0, progress=False)
        return
    with caplog.at_level(logging.WARNING):
        report = make_data(target, settings, tmp_path / "data", seed=0, progress=False)
    figures = report.health
    assert figures["replies"] == 40 and figures["cut_in_reasoning_share"] == 1.0, figures
    assert figures["stopped_share"] is None and figures["loop_share"] == 0 and figures["distinct_share"] == 1.0
    assert "data health" not in caplog.text             # a healthy reasoning model cut at max_new_tokens
    require_healthy(tmp_path / "data", settings)


def test_prefilled_replies_are_not_judged_by_whether_they_stop(tiny_target_dir, tmp_path, caplog):
    """In data.mode=prefill the replies are the source's text: a base model's run (plain text, no stop token
    after a reply) must not warn that few replies stop, and junk in the source is named as the source's."""
    target = Target.load(str(tiny_target_dir), "float32", "cpu", chat={"template": "none"})
    settings = DataSettings(source=str(healthy_file(tmp_path / "h.jsonl", 40)), max_conversations=None,
                            batch_size=20, mode="prefill")
    with caplog.at_level(logging.WARNING):
        report = make_data(target, settings, tmp_path / "data", seed=0, progress=False)
    assert report.health["stopped_share"] < 0.1           # what the old rule warned about
    assert "data health" not in caplog.text
    junk = tmp_path / "junk.jsonl"
    junk.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "the day"},
                                                      {"role": "assistant", "content": " ".join(["of"] * 30)}]})
                              for _ in range(40)))
    with pytest.raises(DegenerateData, match=r"loop_share 1\.00") as raised:
        make_data(target, DataSettings(**{**settings.__dict__, "source": str(junk)}), tmp_path / "junk", seed=0,
                  progress=False)
    assert "source's own text" in str(raised.value) and "use data.mode=prefill" not in str(raised.value)
