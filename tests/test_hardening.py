"""Bad input and faults a user meets: nothing done is lost, nothing wrong passes silently, and every
mistake gets one line (`error: ...`, exit code 2) that names the problem and the fix.

The number in a test's name groups it by the item of the first hardening round it covers (a name says
what it checks); docs/errors.md describes each refusal for users.
"""
import json
import subprocess
import sys
from collections import namedtuple

import pytest
import torch
import yaml
from conftest import build_tiny_target, eagle3_checkpoint, medusa_checkpoint, tiny_recipe
from draftsmith.cli import main
from draftsmith.data import sources
from draftsmith.heads.drafter import CheckpointError, load_drafter, read_config
from draftsmith.export import export
from draftsmith.heads.runtime.target import Target, TargetError
from draftsmith.train.settings import RecipeError, load_recipe, recipe_from_dict


def run_cli(capsys, *argv) -> tuple[int, str]:
    """Exit code and stderr of one `draftsmith` command; a user-facing failure is exactly one error line."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    if code:
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        return code, lines[0]
    return code, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target_dir):
    """A run directory with data, a trained checkpoint (3 steps) and its recipe."""
    tmp = tmp_path_factory.mktemp("trained")
    raw = tiny_recipe(tmp, tiny_target_dir, max_steps=3, eval_prompts=0)
    recipe_path = tmp / "recipe.yaml"
    recipe_path.write_text("# draftsmith train recipe.yaml\n" + yaml.safe_dump(raw))
    assert main(["train", str(recipe_path)]) == 0
    return namedtuple("Trained", "recipe run checkpoint")(recipe_path, tmp / "run", tmp / "run" / "checkpoint")


# -- lost work ---------------------------------------------------------------------------------

def test_1_train_refuses_to_replace_a_trained_checkpoint(trained, capsys):
    before = (trained.checkpoint / "model.safetensors").read_bytes()
    code, line = run_cli(capsys, "train", trained.recipe, "train.max_steps=1")
    assert code == 2 and "already holds a trained drafter (3 steps)" in line and "resume=true" in line
    assert "overwrite=true" in line
    assert (trained.checkpoint / "model.safetensors").read_bytes() == before


def test_1_overwrite_trains_anew_and_that_run_resumes(trained, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained.run, run, ignore=shutil.ignore_patterns(".lock"))
    argv = ["train", trained.recipe, f"output_dir={run}"]
    assert run_cli(capsys, *argv, "overwrite=true", "train.max_steps=2")[0] == 0
    assert json.loads((run / "checkpoint" / "state" / "progress.json").read_text())["step"] == 2
    assert run_cli(capsys, *argv, "resume=true", "train.max_steps=4")[0] == 0     # overwrite is not a resume key
    assert json.loads((run / "checkpoint" / "state" / "progress.json").read_text())["step"] == 4


def test_2_step_and_epoch_counts_are_validated():
    base = {"method": "medusa"}
    for train, message in (({"max_steps": -1}, "train.max_steps must be >= 1, or null"),
                           ({"max_steps": 0}, "train.max_steps must be >= 1, or null"),
                           ({"epochs": 0}, "train.epochs must be > 0"),
                           ({"max_minutes": 0}, "train.max_minutes must be > 0")):
        with pytest.raises(RecipeError, match=message):
            recipe_from_dict({**base, "train": train})


def test_3_export_never_overwrites_a_run_or_a_checkpoint(trained, tiny_target, tmp_path, capsys):
    keep = {p: p.read_bytes() for p in trained.run.rglob("*") if p.is_file() and ".lock" not in p.name}
    for destination in (trained.run, trained.checkpoint, trained.run.parent):
        code, line = run_cli(capsys, "export", trained.checkpoint, "--to", "vllm", destination, "--overwrite")
        assert code == 2 and "cannot export into" in line and "contains) the checkpoint" in line
    (tmp_path / "other-run" / "data").mkdir(parents=True)
    (tmp_path / "other-run" / "recipe.yaml").write_text("method: medusa\n")
    code, line = run_cli(capsys, "export", trained.checkpoint, "--to", "vllm", tmp_path / "other-run", "--overwrite")
    assert code == 2 and "not an earlier draftsmith export (it holds data, recipe.yaml)" in line
    assert {p: p.read_bytes() for p in keep} == keep
    exportable = tmp_path / "ckpt"          # full-vocabulary heads: vLLM's Medusa format takes them
    medusa_checkpoint(tiny_target, exportable, num_heads=2, lm_head="own")
    assert run_cli(capsys, "export", exportable, "--to", "vllm", tmp_path / "out")[0] == 0
    code, line = run_cli(capsys, "export", exportable, "--to", "vllm", tmp_path / "out")
    assert code == 2 and "pass --overwrite" in line
    assert run_cli(capsys, "export", exportable, "--to", "vllm", tmp_path / "out", "--overwrite")[0] == 0


def test_4_repeated_ids_are_made_unique_and_every_chat_is_kept(tiny_target_dir, tmp_path, caplog):
    rows = [{"id": "same", "messages": [{"role": "user", "content": f"the day {i} is water"}]} for i in range(5)]
    (tmp_path / "dup.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    stats = sources.SourceStats()
    convs = list(sources.conversations(str(tmp_path / "dup.jsonl"), stats=stats))
    assert [c.id for c in convs] == ["same", "same#2", "same#3", "same#4", "same#5"]
    assert stats.renamed_duplicate_ids == 4 and "renamed 4 repeated ids" in stats.summary()
    assert "appears more than once" in caplog.text
    for features in ("cache", "online"):          # cache mode ended in KeyError: 'features' before
        (tmp_path / features).mkdir()
        raw = tiny_recipe(tmp_path / features, tiny_target_dir, max_steps=1, eval_prompts=0, features=features,
                          heldout_fraction=0.0)
        raw["data"]["source"] = str(tmp_path / "dup.jsonl")
        from draftsmith.train.loop import fit
        fit(recipe_from_dict(raw), progress=False)
        import datasets
        table = datasets.load_from_disk(str(tmp_path / features / "run" / "data" / "tokenized"))
        assert sorted(table["id"]) == sorted(c.id for c in convs)


def test_5_a_second_process_on_one_output_dir_is_refused(trained, capsys):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom draftsmith.heads.infra.files import DirectoryLock\n"
         f"with DirectoryLock({str(trained.run)!r}, 'test'):\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for verb in ("train", "data"):
            code, line = run_cli(capsys, verb, trained.recipe, "resume=true")
            assert code == 2 and f"is in use by another draftsmith process (pid {holder.pid})" in line
    finally:
        holder.kill()
        holder.wait()
    assert run_cli(capsys, "data", trained.recipe)[0] == 0       # the lock goes with its process


# -- silent wrong results ------------------------------------------------------------------------

def test_7_a_fine_tune_with_the_same_embedding_and_head_is_another_target(tiny_target, tiny_target_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.add_(0.01)      # a "fine-tune" of one decoder layer
    model.save_pretrained(tmp_path / "tuned")
    AutoTokenizer.from_pretrained(tiny_target_dir).save_pretrained(tmp_path / "tuned")
    tuned = Target.load(str(tmp_path / "tuned"), "float32")
    assert tuned.identity.weights_sha256 == tiny_target.identity.weights_sha256
    with pytest.raises(TargetError, match="layers_sha256.*a fine-tune of the same base"):
        load_drafter(tmp_path / "ckpt", tuned)
    same = Target.load(str(tiny_target_dir), "bfloat16")            # another dtype is the same target
    assert same.identity.layers_sha256 == tiny_target.identity.layers_sha256


def test_8_changed_or_truncated_weights_are_a_damaged_checkpoint(tiny_target, tmp_path, capsys):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    weights = tmp_path / "ckpt" / "model.safetensors"
    good = weights.read_bytes()
    flipped = bytearray(good)
    flipped[-10] ^= 0xFF                                            # same size, one byte changed
    for damaged in (bytes(flipped), good[: len(good) // 2]):
        weights.write_bytes(damaged)
        with pytest.raises(CheckpointError, match="damaged checkpoint"):
            load_drafter(tmp_path / "ckpt", tiny_target)
        code, line = run_cli(capsys, "export", tmp_path / "ckpt", "--to", "vllm", tmp_path / "out")
        assert code == 2 and "damaged checkpoint" in line
    weights.write_bytes(good)
    load_drafter(tmp_path / "ckpt", tiny_target)


@pytest.mark.parametrize("argv, message", [
    (["--limit", "0"], "eval.limit must be >= 1"),
    (["--max-new-tokens", "0"], "eval.max_new_tokens must be >= 1"),
    (["--temperature", "-1"], "eval.temperature must be >= 0"),
    (["--baselines", "plain,foo"], "unknown: foo"),
    (["--chain", "-1"], "eval.chain_length must be >= 1"),
    (["--top-p", "0", "--temperature", "0.7"], r"eval.top_p must be in (0, 1]"),
    (["--limit", "abc"], "'limit' must be a whole number, got 'abc'"),
    (["limit=0"], "eval.limit must be >= 1"),
    (["eval.rule=fast"], "eval.rule must be one of auto, greedy, sampling, typical"),
])
def test_9_eval_settings_are_checked_before_anything_loads(argv, message, tiny_target, tmp_path, capsys,
                                                           monkeypatch):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    monkeypatch.setattr(Target, "load", classmethod(lambda *a, **k: pytest.fail("a target was loaded")))
    code, line = run_cli(capsys, "eval", tmp_path / "ckpt", *argv)
    assert code == 2 and message in line


def test_10_max_conversations_is_validated():
    for value in (-2, 0):
        with pytest.raises(RecipeError, match="data.max_conversations must be >= 1, or null"):
            recipe_from_dict({"method": "medusa", "data": {"max_conversations": value}})


def test_11_json_arrays_read_messages_chats_and_name_a_bad_record(tmp_path):
    chats = [{"id": f"m{i}", "messages": [{"role": "user", "content": f"question {i}"},
                                          {"role": "assistant", "content": "answer"}]} for i in range(3)]
    sharegpt = [{"id": "s0", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
    (tmp_path / "mixed.json").write_text(json.dumps(chats + sharegpt))
    convs = list(sources.conversations(str(tmp_path / "mixed.json")))
    assert [c.id for c in convs] == ["m0", "m1", "m2", "s0"]
    assert all(len(c.messages) == 2 for c in convs)
    (tmp_path / "bad.json").write_text(json.dumps(chats + [{"text": "neither"}]))
    with pytest.raises(sources.DataError, match=r"bad.json: record 3: expected a 'messages', 'conversations'"):
        list(sources.conversations(str(tmp_path / "bad.json")))


def test_12_speculators_export_names_the_real_target_architecture(tmp_path):
    qwen = Target.load(str(build_tiny_target(tmp_path / "qwen", "qwen2")), "float32")
    eagle3_checkpoint(qwen, tmp_path / "ckpt")
    assert read_config(tmp_path / "ckpt")["target_architecture"] == "Qwen2ForCausalLM"
    out = export(tmp_path / "ckpt", "speculators", tmp_path / "out")
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["Qwen2ForCausalLM"]


# -- one line where a traceback was -------------------------------------------------------------

def test_13_overrides_are_typed_when_parsed(tmp_path, trained, capsys):
    assert load_recipe(trained.recipe, ["train.lr=1e-4"]).train.lr == pytest.approx(1e-4)
    assert isinstance(load_recipe(trained.recipe, ["train.lr=1e-4"]).train.lr, float)
    code, line = run_cli(capsys, "train", trained.recipe, "train.lr=abc", "output_dir=" + str(tmp_path / "new"))
    assert code == 2 and "'lr' must be a number, got 'abc'" in line
    assert not (tmp_path / "new").exists()                       # refused before any data was made


def test_13_recipe_yaml_with_a_syntax_error(tmp_path, capsys):
    (tmp_path / "broken.yaml").write_text("method: medusa\ntrain:\n  lr: [1e-3\n  epochs: 1\n")
    code, line = run_cli(capsys, "train", tmp_path / "broken.yaml")
    assert code == 2 and "is not valid YAML: " in line and "at line 4" in line


@pytest.mark.parametrize("line_text, kind", [("[1, 2]", "array"), ("42", "number")])
def test_13_jsonl_line_that_is_not_an_object(tmp_path, line_text, kind):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n" + line_text + "\n")
    with pytest.raises(sources.DataError, match=rf"chats.jsonl:2: expected a chat object .* got a JSON {kind}"):
        list(sources.conversations(str(path)))


def test_13_config_json_empty_or_missing_a_key(tiny_target, tmp_path, capsys):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    config_path = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_path.read_text())
    del config["target"]["hidden_size"]
    config_path.write_text(json.dumps(config))
    code, line = run_cli(capsys, "eval", tmp_path / "ckpt")
    assert code == 2 and "config.json: 'target' has no 'hidden_size'" in line
    config_path.write_text("")
    code, line = run_cli(capsys, "export", tmp_path / "ckpt", "--to", "vllm", tmp_path / "out")
    assert code == 2 and "config.json is not valid JSON" in line
    config_path.write_text(json.dumps({"target": {}}))
    with pytest.raises(CheckpointError, match="config.json has no 'kind' key"):
        read_config(tmp_path / "ckpt")


def test_13_truncated_data_shard_is_named(trained, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained.run, run, ignore=shutil.ignore_patterns("checkpoint*", ".lock"))
    shard = sorted((run / "data" / "shards").glob("shard-*.jsonl"))[0]
    shard.write_bytes(shard.read_bytes()[:-40])
    shutil.rmtree(run / "data" / "tokenized")
    code, line = run_cli(capsys, "data", trained.recipe, f"output_dir={run}")
    assert code == 2 and f"damaged data shard {shard}" in line and "delete it and run the same command" in line


def test_13_unwritable_output_dir_and_json_path(trained, tiny_target, tmp_path, capsys, monkeypatch):
    # /sys refuses new files even to root (tests here often run as root, where chmod does not)
    for verb in ("train", "data", "quickstart"):
        argv = [verb, trained.recipe] if verb != "quickstart" else [verb, "--recipe", trained.recipe]
        code, line = run_cli(capsys, *argv, "output_dir=/sys/draftsmith-run")
        assert code == 2 and "output_dir '/sys/draftsmith-run' is not writable" in line
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    monkeypatch.setattr(Target, "load", classmethod(lambda *a, **k: pytest.fail("the eval ran")))
    code, line = run_cli(capsys, "eval", tmp_path / "ckpt", "--json", "/sys/draftsmith/eval.json")
    assert code == 2 and "--json report's directory '/sys/draftsmith' is not writable" in line


def test_13_full_disk_is_named_with_the_space_needed(trained, tmp_path, capsys, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    code, line = run_cli(capsys, "data", trained.recipe, f"output_dir={tmp_path / 'run'}")
    assert code == 2 and "needs about" in line and "only 1000 bytes is free" in line
    assert not list((tmp_path / "run" / "data" / "shards").glob("*.jsonl"))


def test_13_a_time_capped_run_needs_room_for_its_first_shards_not_for_every_conversation(tmp_path, monkeypatch,
                                                                                            caplog):
    """ShareGPT's 17k conversations with an EAGLE-3 cache would need ~40 GB; a 20-minute run makes a few GB."""
    import logging
    import shutil
    from types import SimpleNamespace

    from draftsmith.data import distill, space
    from draftsmith.heads.infra.files import StorageError

    target = SimpleNamespace(hidden_size=64)
    batches = [[None] * 8 for _ in range(20)]
    capped = distill.DataSettings(batch_size=8, max_minutes=1.0)
    measured = space.LengthEstimate(300.0, 250.0, "a probe")
    monkeypatch.setattr(space, "estimate_lengths", lambda *args: measured)

    def needs(conversations):
        return (int(conversations * measured.tokens * space.JSONL_BYTES_PER_TOKEN)
                + distill.feature_cache.estimate_bytes(int(conversations * measured.cached_tokens), [1, 2], 64))

    first = 8 * space.IN_FLIGHT_SHARDS
    usage = shutil.disk_usage(tmp_path)
    for free, settings, refusal in [
            (needs(first) + 10, capped, None),
            (needs(first) - 10, capped, rf"the first {first} conversations of data \(300 tokens per conversation, "
                                        r"a probe\) needs about"),
            (needs(first) + 10, distill.DataSettings(batch_size=8), r"the data for 160 conversations \(300 tokens "
                                                                    r"per conversation, a probe\) needs about")]:
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage._replace(free=free))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            if refusal is None:
                space.check_space(target, settings, tmp_path, batches, [1, 2], tmp_path / "features")
                assert "all 160 conversations would need about" in caplog.text and "data.max_minutes=1.0" in caplog.text
            else:
                with pytest.raises(StorageError, match=refusal):
                    space.check_space(target, settings, tmp_path, batches, [1, 2], tmp_path / "features")


def test_13_a_feature_cache_the_disk_cannot_hold_is_refused_before_it_is_written(trained, tiny_target, tmp_path,
                                                                                    monkeypatch):
    """Data made without a cache, then a cache for it: refused with both numbers, nothing written."""
    import shutil

    from draftsmith.data import features as feature_cache
    from draftsmith.data.distill import shard_paths
    from draftsmith.heads.infra.files import StorageError

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1000))
    out = tmp_path / "cache"
    with pytest.raises(StorageError, match=r"the feature cache \(\d+ tokens x 2 layers x 64 x bf16; "
                                           r"train.features=online needs none\) needs about .* only 1000 bytes is free"):
        feature_cache.build_missing(tiny_target, shard_paths(trained.run / "data"), [0, 1], out, progress=False)
    assert not list(out.glob("*.safetensors"))


def test_unexpected_errors_are_one_line_and_verbose_shows_the_traceback(tiny_target, tmp_path, capsys,
                                                                         monkeypatch):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")

    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")
    monkeypatch.setattr("draftsmith.eval.benchmark.evaluate", boom)
    code, line = run_cli(capsys, "eval", tmp_path / "ckpt")
    assert code == 2 and "RuntimeError: kaboom" in line and "-v" in line
    with pytest.raises(RuntimeError, match="kaboom"):
        main(["-v", "eval", str(tmp_path / "ckpt")])


def test_every_resume_free_key_is_still_a_recipe_key():
    """The recipe keys a resume ignores must exist (a renamed key would silently stop being checked)."""
    from draftsmith.train.checkpointing import RESUME_FREE

    recipe = recipe_from_dict({"method": "medusa"}).to_dict()
    for key in RESUME_FREE:
        node = recipe
        for part in key.split("."):
            assert part in node, key
            node = node[part]


def test_quickstart_keeps_an_earlier_checkpoint_aside(trained, tmp_path):
    from draftsmith.train.checkpointing import set_aside
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained.run, run)
    aside = set_aside(run / "checkpoint")
    assert aside.name.startswith("checkpoint.replaced-") and (aside / "model.safetensors").is_file()
    assert not (run / "checkpoint").exists() and set_aside(run / "checkpoint") is None


def test_the_eval_time_budget_stops_prompts_when_they_run_slower_than_measured():
    """A noisy forward measurement sized too many prompts: the run stops when the next prompt and the
    fp32 check would overrun eval.max_minutes, after at least 3 prompts."""
    from types import SimpleNamespace

    from draftsmith.eval.benchmark import over_budget
    from draftsmith.heads.decoding.settings import EvalSettings

    options = EvalSettings(max_minutes=1.5, exact_prompts=3)      # 90 s
    done = [SimpleNamespace(seconds={"plain": 4.0})] * 3             # each prompt took 12 s in all modes
    assert not over_budget(options, done[:2], 24.0, torch.bfloat16)  # fewer than 3: always go on
    # the fp32 check: 3 prompts x (plain, speculative, transformers' generate) x 4 s x 1.5 = 54 s
    assert not over_budget(options, done, 12.0, torch.bfloat16)      # 12 + 4 + 54 = 70 <= 90
    assert over_budget(options, done, 36.0, torch.bfloat16)          # 36 + 12 + 54 = 102 > 90
    assert not over_budget(EvalSettings(), done, 1e9, torch.bfloat16)   # no budget, no cut
