"""Hardening, second round: no verb overwrites work it did not make, no input silently changes the result,
a full disk loses nothing, and every bad input is one `error:` line with exit code 2.

The numbers in the test names are the items of the second hardening round (docs/errors.md: Outputs,
Inputs, Bounds, push, one line).  Each runs the real CLI (draftsmith.cli.main, in process) and checks what
was kept: the checkpoint's bytes, the source export, no temporaries.
"""
import errno
import json
import logging
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import yaml
from conftest import chats_file, eagle3_checkpoint, fake_hub, medusa_checkpoint, tiny_recipe
from draftsmith.cli import main
from draftsmith.export import export


def run_cli(capsys, *argv) -> tuple[int, str]:
    """Exit code and stderr of one command; a failure is exactly one `error:` line and no traceback."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    if code == 2:
        lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
        assert "(unexpected: run again" not in lines[0], lines[0]
        return code, lines[0]
    return code, captured.err + captured.out


def snapshot(directory: Path) -> dict:
    return {p.relative_to(directory): p.read_bytes() for p in sorted(Path(directory).rglob("*"))
            if p.is_file() and p.name != ".lock"}


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).rglob("*") if ".tmp" in p.name)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_target_dir):
    """A run with data and a trained Medusa checkpoint (3 steps), and its recipe."""
    tmp = tmp_path_factory.mktemp("trained2")
    raw = tiny_recipe(tmp, tiny_target_dir, max_steps=3, eval_prompts=0)
    recipe_path = tmp / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(recipe_path)]) == 0
    return namedtuple("Trained", "recipe run checkpoint")(recipe_path, tmp / "run", tmp / "run" / "checkpoint")


@pytest.fixture(scope="module")
def eagle_export(tiny_target, tmp_path_factory):
    """An EAGLE-3 checkpoint with the default layer ids, and its vLLM export."""
    from draftsmith.heads.eagle3 import default_layer_ids

    tmp = tmp_path_factory.mktemp("e3")
    eagle3_checkpoint(tiny_target, tmp / "ckpt", layer_ids=default_layer_ids(tiny_target.num_layers))
    return tmp / "ckpt", export(tmp / "ckpt", "vllm", tmp / "vllm", dtype="float32")


def small_eval(checkpoint, tmp_path, *extra):
    prompts = chats_file(tmp_path / "p.jsonl", 2)
    return ("eval", checkpoint, *extra, "--prompts", prompts, "--limit", "1", "--max-new-tokens", "4",
            "--exact-prompts", "1", "--baselines", "plain")


# -- lost work ---------------------------------------------------------------------------------

def test_1_import_never_replaces_a_trained_checkpoint_or_its_source(trained, eagle_export, tiny_target_dir,
                                                                    tmp_path, capsys):
    _, vllm = eagle_export
    before, source = snapshot(trained.checkpoint), snapshot(vllm)
    for out in (trained.checkpoint, vllm):
        for extra in ((), ("--overwrite",)):
            code, line = run_cli(capsys, "import", vllm, "--from", "vllm", out, "--target", tiny_target_dir, *extra)
            assert code == 2, line
            assert ("already holds a checkpoint" in line) if out == trained.checkpoint else ("its own source" in line)
    assert snapshot(trained.checkpoint) == before and snapshot(vllm) == source
    out = tmp_path / "imported"
    assert run_cli(capsys, "import", vllm, "--from", "vllm", out, "--target", tiny_target_dir)[0] == 0
    code, line = run_cli(capsys, "import", vllm, "--from", "vllm", out, "--target", tiny_target_dir)
    assert code == 2 and "pass --overwrite" in line
    assert run_cli(capsys, "import", vllm, "--from", "vllm", out, "--target", tiny_target_dir, "--overwrite")[0] == 0
    assert leftovers(tmp_path) == []


def test_1_reports_never_replace_files_they_did_not_write(trained, tiny_target, tmp_path, capsys):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    mine = tmp_path / "mine.json"
    mine.write_text('{"mine": 1}')
    code, line = run_cli(capsys, *small_eval(tmp_path / "ckpt", tmp_path, "--json", mine))
    assert code == 2 and "other files that eval --json did not make" in line and mine.read_text() == '{"mine": 1}'
    before = snapshot(trained.checkpoint)
    for out in (trained.checkpoint, trained.run, trained.checkpoint / "bench"):
        code, line = run_cli(capsys, "bench", tmp_path / "ckpt", "--out", out)
        assert code == 2 and ("did not make" in line or "inside the checkpoint" in line), line
    assert snapshot(trained.checkpoint) == before
    code, line = run_cli(capsys, "train", trained.recipe, f"output_dir={trained.checkpoint}")
    assert code == 2 and "already holds a checkpoint that train did not make" in line
    assert snapshot(trained.checkpoint) == before


def test_2_eval_json_on_a_full_disk_keeps_the_report(tiny_target, tmp_path, capsys, monkeypatch):
    from draftsmith.eval import report as report_module

    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    full = tmp_path / "full"
    full.mkdir()
    real = report_module.write_atomic

    def write(path, content):
        if Path(path).parent == full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, content)

    monkeypatch.setattr(report_module, "write_atomic", write)
    code, line = run_cli(capsys, *small_eval(tmp_path / "ckpt", tmp_path, "--json", full / "eval.json"))
    assert code == 2 and "could not be written to" in line and "nothing measured is lost" in line
    kept = Path(line.split("it was written to '")[1].split("'")[0]) / "eval.json"
    assert json.loads(kept.read_text())["prompts"] == 1
    assert not list(full.iterdir())


def test_2_bench_out_on_a_full_disk_keeps_the_report(tiny_target, tmp_path, capsys, monkeypatch):
    from draftsmith.eval import bench_report

    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    monkeypatch.setattr(bench_report, "write_atomic", lambda path, content: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    code, line = run_cli(capsys, "bench", tmp_path / "ckpt", "--prompts", chats_file(tmp_path / "p.jsonl", 2),
                         "--limit", "1", "--repeats", "1", "--max-new-tokens", "4", "--out", tmp_path / "bench")
    assert code == 2 and "the bench report could not be written" in line and "printed above" in line


def test_2_train_checks_space_for_its_checkpoint_and_a_full_disk_is_one_line(trained, tmp_path, capsys, monkeypatch):
    from draftsmith.train import checkpointing

    run = tmp_path / "run"
    shutil.copytree(trained.run / "data", run / "data")
    argv = ["train", trained.recipe, f"output_dir={run}", "train.max_steps=2"]
    monkeypatch.setattr(checkpointing, "free_bytes", lambda path: 1000)
    code, line = run_cli(capsys, *argv)
    assert code == 2 and "a checkpoint of this drafter needs about" in line and "1000 bytes is free" in line
    assert not (run / "checkpoint").exists()
    monkeypatch.undo()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpointing, "save_recipe", full)
    code, line = run_cli(capsys, *argv)
    assert code == 2 and "the disk is full writing the checkpoint" in line and "free on that filesystem" in line
    assert leftovers(run) == [] and not (run / "checkpoint").exists()


def test_2_export_on_a_full_disk_leaves_nothing(tiny_target, tmp_path, capsys, monkeypatch):
    from draftsmith.export import core

    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    monkeypatch.setattr(core, "free_bytes", lambda path: 10, raising=False)
    from draftsmith.heads.infra import files
    monkeypatch.setattr(files, "free_bytes", lambda path: 10)
    code, line = run_cli(capsys, "export", tmp_path / "ckpt", "--to", "vllm", tmp_path / "exports" / "x")
    assert code == 2 and "the export needs about" in line
    monkeypatch.undo()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(core, "save_tensors", full)
    code, line = run_cli(capsys, "export", tmp_path / "ckpt", "--to", "vllm", tmp_path / "exports" / "x")
    assert code == 2 and "the disk is full writing the export" in line
    assert not (tmp_path / "exports").exists() and leftovers(tmp_path) == []


def test_3_export_never_writes_inside_a_checkpoint(trained, capsys):
    before = snapshot(trained.checkpoint)
    code, line = run_cli(capsys, "export", trained.checkpoint, "--to", "vllm", trained.checkpoint / "sub")
    assert code == 2 and "inside the checkpoint" in line
    assert snapshot(trained.checkpoint) == before and not (trained.checkpoint / "sub").exists()


# -- silent wrong results ------------------------------------------------------------------------

def test_4_import_reads_the_exports_manifest_and_the_layer_convention(eagle_export, tiny_target, tiny_target_dir,
                                                                      tmp_path, capsys):
    _, vllm = eagle_export
    code, line = run_cli(capsys, "import", vllm, "--from", "sglang", tmp_path / "a", "--target", tiny_target_dir)
    assert code == 2 and "exported by draftsmith as 'vllm'" in line and "--from vllm" in line
    bare = tmp_path / "bare"
    shutil.copytree(vllm, bare)
    (bare / "draftsmith-export.json").unlink()
    code, line = run_cli(capsys, "import", bare, "--from", "sglang", tmp_path / "b", "--target", tiny_target_dir)
    assert code == 2 and "default of the other layer-id convention" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    medusa_checkpoint(tiny_target, tmp_path / "m", num_heads=2, lm_head="own")
    medusa = export(tmp_path / "m", "vllm", tmp_path / "mx", dtype="float32")
    (medusa / "draftsmith-export.json").unlink()
    for fmt in ("sglang", "speculators", "trtllm", "eagle", "medusa-original"):
        code, line = run_cli(capsys, "import", medusa, "--from", fmt, tmp_path / "c", "--target", tiny_target_dir)
        assert code == 2 and "--from vllm" in line, (fmt, line)


def test_5_a_chat_template_path_that_does_not_exist_is_an_error(tmp_path, capsys):
    code, line = run_cli(capsys, "show", "medusa-smollm2-135m", f"target.chat_template={tmp_path}/nope.jinja")
    assert code == 2 and "neither a file nor a template" in line
    (tmp_path / "plain.jinja").write_text("just words")
    code, line = run_cli(capsys, "show", "medusa-smollm2-135m", f"target.chat_template={tmp_path}/plain.jinja")
    assert code == 2 and "holds no template syntax" in line
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }")
    code, line = run_cli(capsys, "show", "medusa-smollm2-135m", f"target.chat_template={tmp_path}/bad.jinja")
    assert code == 2 and "is not valid Jinja at line 1" in line
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert run_cli(capsys, "show", "medusa-smollm2-135m", f"target.chat_template={inline}")[0] == 0


def test_5_an_injected_template_is_one_line(trained, tmp_path, capsys):
    injected = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    code, line = run_cli(capsys, "data", trained.recipe, f"output_dir={tmp_path / 'run'}",
                         f"target.chat_template={injected}")
    assert code == 2 and "the sandbox forbids" in line


def test_6_a_prompt_longer_than_the_context_is_cut_with_a_warning_or_refused(tiny_target, tmp_path, capsys, caplog):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "long", "prompt": " ".join(["the day"] * 1100)}) + "\n")   # 2200 > 2048 positions
    argv = ("eval", tmp_path / "ckpt", "--prompts", long, "--limit", "1", "--max-new-tokens", "4", "--exact-prompts",
            "1", "--baselines", "plain")
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        assert run_cli(capsys, *argv)[0] == 0
    assert "longer than the target's context of 2048" in caplog.text and "'long'" in caplog.text
    code, line = run_cli(capsys, *argv, "--long-prompts", "refuse")
    assert code == 2 and "prompt 'long' has" in line and "does not fit the target's context of 2048" in line
    code, line = run_cli(capsys, "bench", tmp_path / "ckpt", "--prompts", long, "--limit", "1", "--repeats", "1",
                         "--max-new-tokens", "4", "--out", tmp_path / "bench", "--long-prompts", "refuse")
    assert code == 2 and "does not fit the target's context of 2048" in line


def test_7_a_missing_checksum_is_a_warning_or_with_the_setting_an_error(tiny_target, tmp_path, capsys, caplog):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config["weights_sha256"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        assert run_cli(capsys, *small_eval(tmp_path / "ckpt", tmp_path))[0] == 0
    assert "has no weights checksum" in caplog.text and "cannot be verified" in caplog.text
    code, line = run_cli(capsys, *small_eval(tmp_path / "ckpt", tmp_path, "require_checksum=true"))
    assert code == 2 and "has no weights checksum" in line


def test_8_duplicate_recipe_keys_are_an_error_naming_both_lines(tmp_path, capsys):
    (tmp_path / "r.yaml").write_text("method: medusa\nseed: 1\ntrain:\n  lr: 0.001\nseed: 2\n")
    code, line = run_cli(capsys, "show", tmp_path / "r.yaml")
    assert code == 2 and "key 'seed' is given twice, at line 2 and line 5" in line


# -- resource exhaustion ---------------------------------------------------------------------------

def test_9_a_dry_run_refuses_a_drafter_before_allocating_it(trained, tiny_target_dir, tmp_path, capsys):
    import resource

    code, line = run_cli(capsys, "train", "--dry-run", trained.recipe, "drafter.num_heads=100000")
    assert code == 2 and "at most 64" in line
    raw = yaml.safe_load(trained.recipe.read_text())
    raw.update(method="eagle3", drafter={"intermediate_size": 2 * 10 ** 7, "draft_vocab_size": 64})
    (tmp_path / "e3.yaml").write_text(yaml.safe_dump(raw))
    code, line = run_cli(capsys, "train", "--dry-run", tmp_path / "e3.yaml")
    assert code == 2 and "needs about" in line and "cpu has in all" in line
    raw["drafter"]["intermediate_size"] = 10 ** 13                    # one tensor past what the allocator reserves
    (tmp_path / "e3.yaml").write_text(yaml.safe_dump(raw))
    code, line = run_cli(capsys, "train", "--dry-run", tmp_path / "e3.yaml")
    assert code == 2 and "TiB) larger than this machine can allocate" in line
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 16 * 2 ** 20       # KiB: nowhere near 24 GB


def test_10_a_yaml_alias_bomb_is_refused_at_once(tmp_path, capsys):
    import time

    lines = ["method: medusa", "a: &a [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        previous = chr(ord("a") + i - 1)
        lines.append(f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [{', '.join(['*' + previous] * 9)}]")
    lines.append("target:\n  chat_template_kwargs: {bomb: *j}")
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    start = time.time()
    code, line = run_cli(capsys, "show", tmp_path / "bomb.yaml")
    assert code == 2 and "expands to more than 100,000 values" in line
    assert time.time() - start < 10


# -- what leaves the machine ---------------------------------------------------------------------------

def test_11_push_uploads_an_allowlist_without_local_paths(trained, tiny_target, tmp_path, capsys, monkeypatch):
    from huggingface_hub import HfApi

    checkpoint = tmp_path / "ckpt"
    medusa_checkpoint(tiny_target, checkpoint, num_heads=2, lm_head="own")      # exportable to vLLM
    shutil.copy(trained.checkpoint / "recipe.yaml", checkpoint / "recipe.yaml")   # absolute paths in it
    assert str(trained.run) in (checkpoint / "recipe.yaml").read_text()
    (checkpoint / "adapter").mkdir()
    (checkpoint / "adapter" / "adapter_config.json").write_text("{}")
    (checkpoint / "adapter" / "stray.pt").write_bytes(b"pickle")
    (checkpoint / "notes.txt").write_text("mine")
    before = snapshot(checkpoint)
    seen = fake_hub(monkeypatch)
    code, out = run_cli(capsys, "push", checkpoint, "me/x", "--export", "vllm")
    assert code == 0, out
    names = set(seen["files"])
    assert "adapter/adapter_config.json" in names and "model.safetensors" in names and "README.md" in names
    assert not names & {"adapter/stray.pt", "notes.txt"} and not any(n.startswith("state/") for n in names)
    home = str(Path.home())
    for name, content in seen["files"].items():
        if name.endswith((".json", ".yaml", ".md")):
            text = content.decode()
            assert str(tmp_path) not in text and home + "/" not in text, name
    assert snapshot(checkpoint) == before                       # the card was made in the staging only

    def offline(self, *a, **k):
        raise ConnectionError("Max retries exceeded with url: /api/repos/create")

    monkeypatch.setattr(HfApi, "create_repo", offline)
    code, line = run_cli(capsys, "push", checkpoint, "me/x")
    assert code == 2 and "nothing was uploaded" in line and "ConnectionError" in line
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "no-hf-home"))
    code, line = run_cli(capsys, "push", checkpoint, "me/x")
    assert code == 2 and "no Hugging Face token" in line and "nothing was uploaded" in line
    assert snapshot(checkpoint) == before


# -- order of checks ------------------------------------------------------------------------------------

def test_12_every_setting_is_checked_before_any_work(trained, tmp_path, capsys):
    for bad, message in (("train.lr=.nan", "must be a finite number"), ("train.lr=.inf", "must be a finite number"),
                         ("train.betas=[0.9,", "is not a valid YAML value")):
        code, line = run_cli(capsys, "train", trained.recipe, f"output_dir={tmp_path / 'new'}", bad)
        assert code == 2 and message in line, line
        assert not (tmp_path / "new").exists()


def test_13_ctrl_c_in_bench_start_up_says_nothing_was_written(tiny_target, tmp_path, capsys, monkeypatch):
    from draftsmith.eval import bench

    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run_draftsmith", interrupt)
    code = main(["bench", str(tmp_path / "ckpt"), "--out", str(tmp_path / "bench")])
    err = capsys.readouterr().err
    assert code == 130 and "no report was written" in err and "report.md" not in err
    assert not (tmp_path / "bench" / "report.md").exists()


# -- errors that are one clear line --------------------------------------------------------------------

def test_14_a_checkpoint_config_with_a_wrong_type_is_named(tiny_target, tmp_path, capsys):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["drafter"]["num_heads"] = "four"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    code, line = run_cli(capsys, *small_eval(tmp_path / "ckpt", tmp_path))
    assert code == 2 and "num_heads" in line and "'four'" in line


def test_14_import_names_a_damaged_export(eagle_export, tiny_target, tiny_target_dir, tmp_path, capsys):
    _, vllm = eagle_export
    broken = tmp_path / "broken"
    shutil.copytree(vllm, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, line = run_cli(capsys, "import", broken, "--from", "vllm", tmp_path / "a", "--target", tiny_target_dir)
    assert code == 2 and "cannot be read as safetensors" in line and "model.safetensors" in line
    (broken / "config.json").write_text("{garbage")
    code, line = run_cli(capsys, "import", broken, "--from", "vllm", tmp_path / "a", "--target", tiny_target_dir)
    assert code == 2 and f"{broken / 'config.json'} is not valid JSON" in line
    medusa_checkpoint(tiny_target, tmp_path / "m", num_heads=2, lm_head="own")
    medusa = export(tmp_path / "m", "vllm", tmp_path / "mx", dtype="float32")
    code, line = run_cli(capsys, "import", medusa, "--from", "medusa-original", tmp_path / "b",
                         "--target", tiny_target_dir)
    assert code == 2 and "--from vllm" in line


class Pickled:
    """An object only unpickling can make: weights_only refuses it."""


def test_14_a_pickled_resume_state_is_refused_in_one_line(trained, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(trained.run, run, ignore=shutil.ignore_patterns(".lock"))
    torch.save({"evil": Pickled()}, run / "checkpoint" / "state" / "optimizer.pt")
    code, line = run_cli(capsys, "train", trained.recipe, f"output_dir={run}", "resume=true", "train.max_steps=4")
    assert code == 2 and "never unpickles code" in line and "weights_only=False" not in line


def test_14_a_bad_adapter_config_is_named_with_its_file(trained, tmp_path, capsys):
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_config.json").write_text("{not json")
    code, line = run_cli(capsys, "show", trained.recipe, f"target.adapter={tmp_path / 'lora'}")
    assert code == 2 and "adapter_config.json" in line and "recipe section 'target'" not in line


def test_14_prompt_files_name_the_line_that_is_not_utf8(tiny_target, tmp_path, capsys):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "the day"}\n{"prompt": "\xff\xfe"}\n')
    code, line = run_cli(capsys, "bench", tmp_path / "ckpt", "--prompts", tmp_path / "p.jsonl", "--out",
                         tmp_path / "bench")
    assert code == 2 and f"{tmp_path / 'p.jsonl'}:2: not UTF-8" in line


def test_14_a_csv_whose_messages_are_strings_says_so(trained, tmp_path, capsys):
    (tmp_path / "chats.csv").write_text('id,messages\nc1,"hello there"\nc2,"more words"\n')
    code, line = run_cli(capsys, "data", trained.recipe, f"output_dir={tmp_path / 'run'}",
                         f"data.source={tmp_path / 'chats.csv'}")
    assert code == 2 and "'messages'" in line and "(has ['messages'])" not in line and "list" in line


def test_14_show_and_import_exit_2_on_bad_input(tmp_path, capsys):
    assert run_cli(capsys, "show", tmp_path / "missing.yaml")[0] == 2
    assert run_cli(capsys, "import", tmp_path, "--from", "vllm", tmp_path / "out")[0] == 2
