"""Hardening, third round: nothing private leaves the machine, no corrupted cache trains silently, and what
other tools load is what they expect.

The numbers in the test names are the cases of the third round (docs/errors.md).  Each runs the real CLI
(draftsmith.cli.main, in process) where a command is involved, and the class behind a case (any symlink kind,
any secret shape, any absolute path) is tested beside it.
"""
import errno
import json
import os
import shlex
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import yaml
from conftest import chats_file, fake_hub, medusa_checkpoint, tiny_recipe
from draftsmith.cli import main
from test_hardening2 import run_cli, snapshot, trained  # noqa: F401 - trained: a module fixture, used here too


def copy_run(trained, tmp_path) -> tuple[Path, Path]:
    """A private copy of the trained run (data, cache, checkpoint) and a recipe pointing at it."""
    recipe, run = trained.recipe, trained.run
    shutil.copytree(run, tmp_path / "run")
    raw = yaml.safe_load(recipe.read_text())
    raw["output_dir"] = str(tmp_path / "run")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    return tmp_path / "recipe.yaml", tmp_path / "run"


@pytest.fixture
def hub(monkeypatch):
    return fake_hub(monkeypatch)


@pytest.fixture
def pushable(tiny_target, tmp_path):
    checkpoint = tmp_path / "ckpt"
    medusa_checkpoint(tiny_target, checkpoint, num_heads=2, lm_head="own")
    return checkpoint


# -- 1-4: what leaves the machine ---------------------------------------------------------------------

LINKS = ["adapter/x.safetensors", "adapter/adapter_config.json", "adapter", "recipe.yaml", "last_eval.json"]


@pytest.mark.parametrize("name", LINKS)
def test_1_push_refuses_a_symlink_under_any_uploaded_name(pushable, hub, tmp_path, capsys, name):
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    (secret / "adapter_config.json").write_text("{}")
    if name.startswith("adapter/"):
        (pushable / "adapter").mkdir()
    link = pushable / name
    link.symlink_to(secret if name == "adapter" else secret / "id_rsa")
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code == 2 and "symbolic link" in line and "nothing was uploaded" in line, line
    assert "files" not in hub
    link.unlink()
    link.symlink_to(pushable / "config.json")             # even a link inside the checkpoint
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code == 2 and "symbolic link" in line and "files" not in hub


def test_1_push_refuses_a_pipe_under_an_uploaded_name(pushable, hub, capsys):
    os.mkfifo(pushable / "last_eval.json")
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code == 2 and "not a regular file" in line and "files" not in hub


SECRETS = {
    "hf": "hf_" + "aB3" * 12,
    "openai": "sk-proj-" + "Zx9_" * 8,
    "aws": "AKIA" + "ABCDEFGHIJ234567",
    "wandb": "0123456789abcdef" * 2 + "01234567",
    "wandb_v1": "wandb_v1_" + "q" * 30,
    "password": "hunter2-not-a-shape",
}


def saved_recipe(checkpoint: Path, tmp_path: Path, target_dir: Path, **sections) -> None:
    """A recipe.yaml as training saves it (save_recipe), with `sections` merged into the tiny recipe."""
    from draftsmith.train.settings import recipe_from_dict, save_recipe
    raw = tiny_recipe(tmp_path, target_dir)
    raw["drafter"] = {"num_heads": 2, "lm_head": "own"}
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    save_recipe(recipe_from_dict(raw), checkpoint / "recipe.yaml")


def test_2_push_redacts_secrets_and_lists_each(pushable, hub, capsys, tmp_path, tiny_target_dir):
    saved_recipe(pushable, tmp_path, tiny_target_dir, target={"chat_template_kwargs": {
        "report": {"wandb_api_key": SECRETS["wandb"]}, "notes": f"pushed with {SECRETS['hf']} and {SECRETS['openai']}",
        "aws": {"access_key_id": SECRETS["aws"], "region": "us-east-1"}, "wandb_key_v1": SECRETS["wandb_v1"]}},
        train={"lr": 0.001})
    (pushable / "adapter").mkdir()
    (pushable / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"r": 8, "password": SECRETS["password"], "mask_token_id": 7, "max_new_tokens": 8}))
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    uploaded = b"".join(hub["files"].values()).decode(errors="replace")
    for kind, value in SECRETS.items():
        assert value not in uploaded, kind
    assert out.count("redacted ") >= 6 and "recipe.yaml: the value of 'target.chat_template_kwargs.report." \
        "wandb_api_key'" in out and "adapter/adapter_config.json" in out
    assert not any(value in out for value in SECRETS.values())           # the listing names places, not values
    kept = json.loads(hub["files"]["adapter/adapter_config.json"])
    assert kept["r"] == 8 and kept["mask_token_id"] == 7 and kept["max_new_tokens"] == 8
    assert yaml.safe_load(hub["files"]["recipe.yaml"])["train"]["lr"] == 0.001
    assert "uploading" in out and "in all" in out                         # the total shown before the upload


@pytest.mark.parametrize("text, secret", [
    ('{"api_key": "abc123xyz"}', "abc123xyz"), ("token: tok-123-xyz", "tok-123-xyz"),
    ("HF_TOKEN=" + SECRETS["hf"], SECRETS["hf"]), ("client_secret: 's3cr3t'", "s3cr3t"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG", "wJalrXUtnFEMI/K7MDENG"),
    ("export WANDB_API_KEY=" + SECRETS["wandb"], SECRETS["wandb"]), ("see " + SECRETS["openai"], SECRETS["openai"]),
    ("- password: p@ss", "p@ss"), ('"private_key": "-----BEGIN"', "-----BEGIN"),
])
def test_every_secret_shape_is_redacted(text, secret, tmp_path):
    from draftsmith.export.redaction import clean_text
    found = []
    out = clean_text(text, "f.yaml", found, tmp_path)
    assert secret not in out and found


@pytest.mark.parametrize("text", [
    "pad_token: <pad>", '"eos_token_id": 2', "max_new_tokens: 128", "num_speculative_tokens: 3",
    '"mask_token_id": 7', "tokens: 1200", "token: null", "commit 0123456789abcdef0123456789abcdef01234567",
])
def test_what_is_not_a_secret_is_kept(text, tmp_path):
    from draftsmith.export.redaction import clean_text
    found = []
    assert clean_text(text, "f.yaml", found, tmp_path) == text and found == []


def test_3_push_scrubs_every_absolute_path_existing_or_not(pushable, hub, capsys, tmp_path, tiny_target_dir):
    from draftsmith.export.staging import local_paths
    config = json.loads((pushable / "config.json").read_text())
    config["target_source"] = "/home/alice/acme-confidential/target model"
    (pushable / "config.json").write_text(json.dumps(config))
    saved_recipe(pushable, tmp_path, tiny_target_dir, data={"source": "/home/alice/acme-confidential/data.jsonl"},
                 eval={"prompts": "C:\\Users\\alice\\acme\\prompts.jsonl"},
                 target={"chat_template_kwargs": {"chat": "/home/alice/my data/chat template.jinja",
                                                  "other": "~/acme-private/x.jsonl"}},
                 output_dir="\\\\fileserver\\acme\\runs")
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    for name, content in hub["files"].items():
        if name.endswith((".json", ".yaml", ".md")):
            text = content.decode()
            assert "alice" not in text and "acme" not in text and not local_paths(text), (name, text)
    assert yaml.safe_load(hub["files"]["recipe.yaml"])["data"]["source"] == "data.jsonl"


@pytest.mark.parametrize("text", [
    "/home/alice/acme-confidential/data.jsonl", '"/srv/a b/c d.jsonl"', "C:\\Users\\alice\\x.jsonl",
    '"C:\\\\Users\\\\alice\\\\x.jsonl"', "~/secret/x.jsonl", "~alice/secret/x", "see `/opt/acme/run 1/x`",
    "D:/work/acme/x", "\\\\server\\acme\\x.jsonl",
])
def test_any_absolute_path_is_scrubbed(text, tmp_path):
    from draftsmith.export.staging import local_paths, scrub
    out = scrub(text, tmp_path / "ckpt")
    assert "acme" not in out and "alice" not in out and "Users" not in out and not local_paths(out), out


def test_urls_and_relative_paths_are_kept(tmp_path):
    from draftsmith.export.staging import scrub
    text = "see https://huggingface.co/me/x and docs/metrics.md, ./model.safetensors, 3/4 and tok/s"
    assert scrub(text, tmp_path / "ckpt") == text


def test_4_push_checks_each_file_is_its_kind_and_size(pushable, hub, capsys):
    adapter = pushable / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with open(adapter / "adapter_model.safetensors", "wb") as f:       # 1 GB of zeros, sparse
        f.truncate(1 << 30)
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code == 2 and "adapter/adapter_model.safetensors" in line and "files" not in hub, line
    from safetensors.torch import save_file
    save_file({"base_model.model.q_proj.lora_A.weight": torch.zeros(2, 4)}, str(adapter / "adapter_model.safetensors"))
    with open(adapter / "adapter_model.safetensors", "ab") as f:
        f.write(b"\0" * 100)                                              # trailing bytes no tensor owns
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code == 2 and "not a valid safetensors file" in line
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_config.json").write_text("{not json")
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code == 2 and "does not parse as JSON" in line
    (adapter / "adapter_config.json").write_text("{}")
    weights = bytearray((pushable / "model.safetensors").read_bytes())
    weights[-3] ^= 0xFF
    (pushable / "model.safetensors").write_bytes(bytes(weights))
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code == 2 and "weights_sha256" in line and "files" not in hub


def test_16_a_full_staging_disk_is_named(pushable, hub, capsys, monkeypatch):
    import draftsmith.export.hub as hub_module

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub_module.shutil, "copyfile", full)
    before = snapshot(pushable)
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code == 2 and "staging the upload" in line and "TMPDIR" in line and str(pushable) not in line
    assert snapshot(pushable) == before and "files" not in hub


# -- 5: integrity by default ---------------------------------------------------------------------------------

def flip_keeping_mtime(path: Path, offset: int, value: int | None = None) -> None:
    info = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] = data[offset] ^ 0xFF if value is None else value
    path.write_bytes(bytes(data))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert path.stat().st_mtime_ns == info.st_mtime_ns and path.stat().st_size == info.st_size


def test_5_first_use_spot_checks_bytes_changed_under_the_same_size_and_mtime(trained, tmp_path, capsys, caplog):
    recipe, run = copy_run(trained, tmp_path)
    victim = sorted((run / "data" / "features").rglob("shard-*.safetensors"))[0]
    before = victim.read_bytes()
    flip_keeping_mtime(victim, len(before) - 5)
    corrupted = victim.read_bytes()
    code, out = run_cli(capsys, "train", recipe, "overwrite=true")
    assert code == 0, out
    assert "changed since it was verified" in caplog.text and "deleted, and rebuilt before training" in caplog.text
    from draftsmith.data import features
    meta = features.safe_open(str(victim), framework="pt").metadata()
    assert victim.read_bytes() != corrupted and features.streamed_checksum(victim)[0] == meta["sha256"]   # rebuilt


def test_5_a_non_finite_first_step_names_the_cache_when_it_was_not_hashed(trained, tmp_path, capsys):
    recipe, run = copy_run(trained, tmp_path)
    for shard in (run / "data" / "features").rglob("shard-*.safetensors"):
        size = shard.stat().st_size
        info = shard.stat()
        data = bytearray(shard.read_bytes())
        data[size // 2:] = b"\xff" * (size - size // 2)                  # NaN bf16 values over half of each shard
        shard.write_bytes(bytes(data))
        os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))
    code, line = run_cli(capsys, "train", recipe, "overwrite=true", "train.verify_cache=never", "train.log_every=1")
    assert code == 2 and "damaged feature cache" in line and "train.verify_cache=always" in line, line


# -- 6: launch shape -----------------------------------------------------------------------------------------

def test_6_resume_under_another_process_count_is_refused_unless_asked(trained, tmp_path, capsys):
    recipe, run = copy_run(trained, tmp_path)
    progress = run / "checkpoint" / "state" / "progress.json"
    saved = json.loads(progress.read_text())
    assert saved["world_size"] == 1 and saved["global_batch"] == 4
    progress.write_text(json.dumps({**saved, "world_size": 2, "global_batch": 8}))
    code, line = run_cli(capsys, "train", recipe, "resume=true", "train.max_steps=5")
    assert code == 2 and "saved by 2 processes (global batch 8)" in line and "has 1 (global batch 4)" in line
    assert "train.allow_reshard=true" in line
    code, out = run_cli(capsys, "train", recipe, "resume=true", "train.max_steps=5", "train.allow_reshard=true")
    assert code == 0, out
    assert json.loads(progress.read_text())["step"] == 5


# -- 9-12: bounded inputs ------------------------------------------------------------------------------------

def test_9_a_huge_prompt_line_is_refused_by_its_size(trained, tmp_path, capsys):
    run = trained.run
    big = tmp_path / "big.jsonl"
    big.write_text(json.dumps({"prompt": "word " * (2 << 20)}) + "\n")
    start = time.time()
    code, line = run_cli(capsys, "eval", run / "checkpoint", "--prompts", big, "--limit", "1", "--max-new-tokens", "4")
    assert code == 2 and "big.jsonl:1" in line and "more than 8 MiB" in line
    assert time.time() - start < 60


def test_11_a_limit_stops_the_reading_of_a_large_file(tmp_path):
    from draftsmith.data import sources

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello there"}) + "\n")
    with open(path, "r+b") as f:                      # then a gigabyte (sparse), never needed for one prompt
        f.truncate(1 << 30)
    tracemalloc.start()
    try:
        got = list(sources.conversations(str(path), limit=1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got) == 1 and peak < 64 << 20, peak


def test_10_a_huge_or_misplaced_chat_template_is_refused(trained, tmp_path, capsys):
    recipe = trained.recipe
    huge = tmp_path / "template.jinja"
    huge.write_text("{{ messages }}" + " " * (2 << 20))
    start = time.time()
    code, line = run_cli(capsys, "data", recipe, f"output_dir={tmp_path / 'out'}", f"target.chat_template={huge}")
    assert code == 2 and "a chat template is at most 1 MiB" in line and time.time() - start < 60
    code, line = run_cli(capsys, "data", recipe, f"output_dir={tmp_path / 'out'}", f"target.chat_template={tmp_path}")
    assert code == 2 and "is a directory" in line


def test_12_the_data_time_cap_holds_before_any_shard_is_written(tiny_target_dir, tmp_path, capsys):
    raw = tiny_recipe(tmp_path, tiny_target_dir)
    raw["data"].update(max_minutes=1e-5, max_new_tokens=200)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    code, line = run_cli(capsys, "data", recipe)
    assert code == 2 and "passed before any conversation finished" in line and "nothing was written" in line
    assert not list((tmp_path / "run" / "data" / "shards").glob("shard-*.jsonl"))


# -- 13-15: files other tools and people read ---------------------------------------------------------------

def serving_report(path: Path, spec, why="speculation won at every measured level", kind="medusa"):
    chosen = {"speculative_config": spec} if spec is not ... else {}
    if why is not None:
        chosen["why"] = why
    path.write_text(json.dumps({"kind": kind, "checkpoint": "/somewhere/ckpt", "serving_config": chosen}))
    return path


@pytest.mark.parametrize("spec, why, expected", [
    ({"method": "medusa", "num_speculative_tokens": -5}, "ok", "outside 1..2"),
    ({"method": "medusa", "num_speculative_tokens": 10 ** 9}, "ok", "outside 1..2"),
    ({"method": "medusa'; rm -rf ~ #", "num_speculative_tokens": 2}, "ok", "measured vLLM's method"),
    ({"method": "medusa", "num_speculative_tokens": "2'; rm -rf ~ #"}, "ok", "not a int"),
    ({"method": "medusa", "num_speculative_tokens": 2, "extra": "'; rm -rf ~ #"}, "ok", "does not write"),
    (..., "ok", "no speculative_config"),
    ({"method": "medusa", "num_speculative_tokens": 2}, None, "no 'why' sentence"),
])
def test_13_serving_config_values_are_checked(pushable, tmp_path, capsys, spec, why, expected):
    report = serving_report(tmp_path / "report.json", spec, why)
    code, line = run_cli(capsys, "export", pushable, "--to", "vllm", tmp_path / "out", "--serving-config", report)
    assert code == 2 and expected in line, line
    assert not (tmp_path / "out").exists()


def test_13_the_serving_command_is_shell_quoted(pushable, tmp_path, capsys):
    spec = {"method": "medusa", "num_speculative_tokens": 2}
    report = serving_report(tmp_path / "report.json", spec, why="it won; `rm -rf ~` 'quoted'")
    code, out = run_cli(capsys, "export", pushable, "--to", "vllm", tmp_path / "out", "--serving-config", report)
    assert code == 0, out
    readme = (tmp_path / "out" / "README.md").read_text()
    command = next(line for line in readme.splitlines() if line.startswith("vllm serve TARGET_DIR --speculative"))
    argv = shlex.split(command)
    assert argv[:3] == ["vllm", "serve", "TARGET_DIR"] and len(argv) == 5
    assert json.loads(argv[4]) == {**spec, "model": "THIS_DIR"}
    assert "`rm -rf ~`" not in readme


def test_14_overwrite_replaces_only_a_folder_whose_manifest_names_an_export(pushable, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    for junk in ("junk", "[1, 2]", json.dumps({"format": ["sglang"]}),
                 json.dumps({"format": "vllm", "dtype": "bfloat16", "target": {"name": "x"}})):
        (out / "draftsmith-export.json").write_text(junk)
        code, line = run_cli(capsys, "export", pushable, "--to", "vllm", out, "--overwrite")
        assert code == 2 and "manifest is damaged" in line, line
        assert (out / "mine.txt").read_text() == "keep me"


def test_16_import_names_a_damaged_manifest(pushable, tmp_path, capsys, tiny_target_dir):
    exported = tmp_path / "exp"
    assert main(["export", str(pushable), "--to", "vllm", str(exported), "--dtype", "float32"]) == 0
    manifest = json.loads((exported / "draftsmith-export.json").read_text())
    for junk in ({**manifest, "target": {"name": "x"}}, {**manifest, "format": ["sglang"]}):
        (exported / "draftsmith-export.json").write_text(json.dumps(junk))
        code, line = run_cli(capsys, "import", exported, "--from", "vllm", tmp_path / "imp", "--target",
                             tiny_target_dir)
        assert code == 2 and "damaged draftsmith export manifest" in line, line


def test_15_weights_get_the_mode_of_the_files_beside_them(trained, pushable, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        assert main(["export", str(pushable), "--to", "vllm", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777          # noqa: E731
    assert mode(tmp_path / "out" / "model.safetensors") == mode(tmp_path / "out" / "config.json") == 0o644
    checkpoint = trained.checkpoint
    assert mode(checkpoint / "model.safetensors") == mode(checkpoint / "config.json")


# -- 16-17: one line, and the command line ------------------------------------------------------------------

@pytest.mark.parametrize("content", ["[1, 2]", '{"total": 5}', '{"total": {"replies": "many"}}', "not json"])
def test_16_a_damaged_health_file_is_named(trained, tmp_path, capsys, content):
    recipe, run = copy_run(trained, tmp_path)
    (run / "data" / "health.json").write_text(content)
    code, line = run_cli(capsys, "train", recipe, "overwrite=true")
    assert code == 2 and "health.json is damaged" in line and "data.allow_degenerate=true" in line, line


def test_17_overrides_are_accepted_after_flags(trained, tmp_path, capsys):
    recipe, run = copy_run(trained, tmp_path)
    code, out = run_cli(capsys, "show", recipe, "train.lr=0.5")
    assert code == 0 and "0.5" in out
    code, out = run_cli(capsys, "train", recipe, "--dry-run", "train.lr=0.5", "overwrite=true")
    assert code == 0, out
    prompts = chats_file(tmp_path / "p.jsonl", 3)
    report = tmp_path / "eval.json"
    code, out = run_cli(capsys, "eval", run / "checkpoint", "--prompts", prompts, "--json", report, "limit=1",
                        "--baselines", "plain", "max_new_tokens=4", "exact_prompts=1")
    assert code == 0, out
    assert json.loads(report.read_text())["prompts"] == 1
    with pytest.raises(SystemExit):                   # export takes no overrides: argparse names the stray one
        main(["export", str(run / "checkpoint"), "--to", "vllm", str(tmp_path / "o"), "dtype=float32"])
    assert "unrecognized arguments: dtype=float32" in capsys.readouterr().err

