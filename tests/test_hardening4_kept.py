"""Hardening, fourth round (issue 57), the files draftsmith keeps: what a run leaves on disk and reads back later
(the data's manifest and template, a checkpoint's state, an interrupted checkpoint swap, a last evaluation, an
export folder) is checked when read, and nothing a user put beside it is lost.  Each case runs the real CLI.
"""
import json
import shutil
import subprocess
import sys

import pytest
import yaml
from test_hardening2 import run_cli
from test_hardening4 import trained4  # noqa: F401 - the module's fixture: a run with data and a checkpoint


@pytest.fixture
def run_copy(trained4, tmp_path):  # noqa: F811
    """A copy of the trained run (data, feature cache, checkpoint) and a recipe pointing at it."""
    run = tmp_path / "run"
    shutil.copytree(trained4 / "run", run)
    raw = yaml.safe_load((trained4 / "recipe.yaml").read_text())
    raw["output_dir"] = str(run)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    return run, tmp_path / "recipe.yaml"


# -- 2: what training depends on ------------------------------------------------------------------------------

def test_2_the_targets_own_chat_template_edited_after_data_is_refused(tiny_target_dir, tmp_path, capsys):
    """The target's own chat_template.jinja, edited between `data` and `train`, was not in the data's
    fingerprint (a recipe's template was): training went on silently on the old prompt format."""
    from conftest import tiny_recipe
    target = tmp_path / "target"
    shutil.copytree(tiny_target_dir, target)
    raw = tiny_recipe(tmp_path, target, max_steps=1, eval_prompts=0)
    raw["data"]["max_conversations"] = 8
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    code, out = run_cli(capsys, "data", recipe)
    assert code == 0, out
    template = target / "chat_template.jinja"
    template.write_text(template.read_text().replace("{{", "[turn] {{", 1))
    code, line = run_cli(capsys, "train", recipe)
    assert code == 2 and "the chat template the target renders" in line and "chat_template.jinja" in line, line


def test_2_a_leftover_checkpoint_old_is_restored_and_named_never_deleted(run_copy, capsys, caplog):
    """Only checkpoint.old/ present (a kill inside the checkpoint swap): `train` without resume started anew
    and deleted it."""
    run, recipe = run_copy
    weights = (run / "checkpoint" / "model.safetensors").read_bytes()
    (run / "checkpoint").rename(run / "checkpoint.old")
    code, line = run_cli(capsys, "train", recipe)
    assert code == 2 and "already holds a trained drafter" in line, line      # restored, so not replaced unasked
    assert "restored" in caplog.text and "checkpoint.old" in caplog.text
    assert (run / "checkpoint" / "model.safetensors").read_bytes() == weights
    assert not (run / "checkpoint.old").exists()
    shutil.copytree(run / "checkpoint", run / "checkpoint.old")               # the swap's last step not done
    caplog.clear()
    code, line = run_cli(capsys, "train", recipe)
    assert code == 2 and "removing" in caplog.text and "checkpoint.old: the checkpoint before" in caplog.text, line
    assert not (run / "checkpoint.old").exists() and (run / "checkpoint" / "model.safetensors").is_file()


# -- 3: every kept file is checked when read back --------------------------------------------------------------

@pytest.mark.parametrize("case", ["data manifest", "training position", "schedule"])
def test_3_a_damaged_kept_file_is_named_with_its_fix(run_copy, capsys, case):
    """A kept file cut short or edited gave a KeyError or a JSON error naming no file."""
    run, recipe = run_copy
    path, content, extra = {
        "data manifest": (run / "data" / "manifest.json", '{"fingerprint": "abc", "target": ', ["overwrite=true"]),
        "training position": (run / "checkpoint" / "state" / "progress.json", '{"step": "three"}', ["resume=true"]),
        "schedule": (run / "checkpoint" / "state" / "scheduler.json", "[]", ["resume=true"]),
    }[case]
    path.write_text(content)
    code, line = run_cli(capsys, "train", recipe, *extra)
    assert code == 2 and str(path) in line and "is damaged" in line, line
    assert ("draftsmith data" in line) if case == "data manifest" else ("start without resume=true" in line), line


def test_3_a_damaged_last_eval_is_left_out_of_the_card_and_prediction_with_a_warning(run_copy, capsys, caplog):
    """A last_eval.json with a missing field made the card's writer raise KeyError at the next checkpoint save."""
    from draftsmith.eval.predict import profile_of
    from draftsmith.heads.card import model_card
    run, _ = run_copy
    (run / "checkpoint" / "last_eval.json").write_text(json.dumps({"tau": 1.5, "per_position_acceptance": [2.0]}))
    card = model_card(run / "checkpoint")
    assert "Last `draftsmith eval`" not in card and "last_eval.json (the checkpoint's last evaluation)" in caplog.text
    assert profile_of(run / "checkpoint", 3).source.startswith("simulated")


# -- 5: exports -----------------------------------------------------------------------------------------------

@pytest.fixture
def exportable(tiny_target, tmp_path):
    """A full-vocabulary Medusa checkpoint, as vLLM's format takes it."""
    from conftest import medusa_checkpoint
    medusa_checkpoint(tiny_target, tmp_path / "run" / "checkpoint", num_heads=2, lm_head="own")
    return tmp_path / "run"


def test_5_export_overwrite_deletes_only_what_an_export_wrote(exportable, tmp_path, capsys):
    """`export --overwrite` deleted a user's checkpoint kept inside an export folder."""
    run = exportable
    out = tmp_path / "exported"
    assert run_cli(capsys, "export", run / "checkpoint", "--to", "vllm", out)[0] == 0
    listed = json.loads((out / "draftsmith-export.json").read_text())["files"]
    assert set(listed) == {p.name for p in out.iterdir()} - {"draftsmith-export.json"}
    shutil.copytree(run / "checkpoint", out / "my-checkpoint")
    code, line = run_cli(capsys, "export", run / "checkpoint", "--to", "vllm", out, "--overwrite")
    assert code == 2 and "my-checkpoint" in line and "did not write" in line, line
    assert (out / "my-checkpoint" / "model.safetensors").is_file()
    shutil.rmtree(out / "my-checkpoint")
    assert run_cli(capsys, "export", run / "checkpoint", "--to", "vllm", out, "--overwrite")[0] == 0


def test_5_an_export_into_a_folder_another_export_is_writing_is_refused(exportable, tmp_path, capsys):
    """Two concurrent exports into one folder both reported success, and the merged target/ was gone."""
    run = exportable
    out = tmp_path / "exported"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys; from draftsmith.heads.infra.files import DirectoryLock\n"
        f"with DirectoryLock({str(tmp_path)!r}, 'export', name='.exported.export-lock'):\n"
        "    print('held', flush=True); sys.stdin.read()")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        code, line = run_cli(capsys, "export", run / "checkpoint", "--to", "vllm", out)
        assert code == 2 and f"'{out}' is in use by another draftsmith process (pid {holder.pid})" in line, line
        assert not out.exists()
    finally:
        holder.communicate("")
    assert run_cli(capsys, "export", run / "checkpoint", "--to", "vllm", out)[0] == 0


# -- 4: traffic samples read like every other source ----------------------------------------------------------

def test_4_a_traffic_sample_is_read_through_the_bounded_reader(tmp_path):
    """eval/traffic.py had its own line reader: a FIFO hung it and a .gz that was not gzip gave gzip's message."""
    import os

    from draftsmith.eval.traffic import TrafficError, load_traffic
    os.mkfifo(tmp_path / "traffic.jsonl")
    with pytest.raises(TrafficError, match="is not a regular file"):
        load_traffic(None, str(tmp_path / "traffic.jsonl"), 4, 0, 16)
    (tmp_path / "t.jsonl.gz").write_text('{"prompt": "hello"}\n')
    with pytest.raises(TrafficError, match="is named .gz but is not gzip-compressed"):
        load_traffic(None, str(tmp_path / "t.jsonl.gz"), 4, 0, 16)


# -- 3, through the CLI: the kept cost table and --cost-context -----------------------------------------------

@pytest.fixture
def predictable(tiny_target, tmp_path, monkeypatch):
    """An EAGLE-3 checkpoint with a measured chain, and a cache of its own for kept cost tables."""
    from conftest import eagle3_checkpoint
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "ckpt"
    eagle3_checkpoint(tiny_target, checkpoint)
    (checkpoint / "last_eval.json").write_text(json.dumps({
        "per_position_acceptance": [0.7, 0.4, 0.1], "proposal": "chain of 3", "temperature": 0.0}))
    return ["bench", checkpoint, "--predict", "--batch-sizes", "1", "--max-k", "3", "--device", "cpu",
            "--dtype", "float32"]


@pytest.mark.parametrize("case", ["negative costs", "garbage"])
def test_3_bench_predict_measures_a_bad_kept_table_again(predictable, tmp_path, capsys, caplog, case):
    """With negative kept costs `bench --predict` exited 0, predicted 2.01x and wrote K = 2 where a measured
    table said 0.76x; garbage gave "Expecting value: line 1 column 1", naming no file."""
    assert run_cli(capsys, *predictable, "--out", tmp_path / "p1")[0] == 0
    first = json.loads((tmp_path / "p1" / "predict.json").read_text())
    (kept,) = (tmp_path / "cache" / "costs").glob("draftsmith-*.json")
    raw = json.loads(kept.read_text())
    raw["verify_ms"] = {b: {k: -10.0 - int(k) for k in row} for b, row in raw["verify_ms"].items()}
    kept.write_text(json.dumps(raw) if case == "negative costs" else "\x00 not json")
    code, out = run_cli(capsys, *predictable, "--out", tmp_path / "p2")
    assert code == 0, out
    assert f"cost table {kept} cannot be used" in caplog.text and "measured again" in caplog.text
    again = json.loads((tmp_path / "p2" / "predict.json").read_text())
    assert all(ms > 0 for row in again["costs"]["verify_ms"].values() for ms in row.values())
    assert set(again["speedup"]["1"]) == set(first["speedup"]["1"])


def test_3_cost_context_past_the_targets_positions_is_refused_by_the_cli(predictable, tmp_path, capsys):
    """--cost-context 5000 on a target with a 2048-token context was timed silently past the context."""
    code, line = run_cli(capsys, *predictable, "--cost-context", "5000", "--out", tmp_path / "p")
    assert code == 2 and "--cost-context 5000" in line and "past the 2048 positions" in line, line
