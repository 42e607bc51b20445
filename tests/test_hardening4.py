"""Hardening, fourth round (issue 57): push uploads only what it writes itself.

Each case runs the real CLI (`draftsmith push`, in process, against a recording stand-in for the Hub) and
asserts on the bytes that would have been uploaded.
"""
import json
import os
import random
import string
import time

import pytest
import torch
import yaml
from conftest import fake_hub, medusa_checkpoint, tiny_recipe
from test_hardening2 import run_cli
from draftsmith.train.settings import load_recipe, recipe_from_dict, save_recipe


@pytest.fixture
def hub(monkeypatch):
    return fake_hub(monkeypatch)


@pytest.fixture
def pushable(tiny_target, tiny_target_dir, tmp_path):
    """A checkpoint as training leaves it: weights, config, the recipe draftsmith saved, a last evaluation."""
    checkpoint = tmp_path / "ckpt"
    medusa_checkpoint(tiny_target, checkpoint, num_heads=2, lm_head="own")
    raw = tiny_recipe(tmp_path, tiny_target_dir)
    raw["drafter"] = {"num_heads": 2, "lm_head": "own"}
    save_recipe(recipe_from_dict(raw), checkpoint / "recipe.yaml")
    (checkpoint / "last_eval.json").write_text(json.dumps({
        "tau": 1.5, "per_position_acceptance": [0.4, 0.1], "speedup_vs_plain": 1.2, "greedy_exact": True,
        "exact_checked_prompts": 4, "prompts": 4, "prompts_source": "mt-bench", "max_new_tokens": 64,
        "temperature": 0.0, "proposal": "chain of 2", "dtype": "float32", "device": "cpu", "date": "2026-12-07"}))
    return checkpoint


def uploaded_text(hub) -> str:
    return b"\n".join(hub["files"].values()).decode("utf-8", errors="replace")


def with_recipe_override(checkpoint, *overrides) -> None:
    """The checkpoint's recipe.yaml as `draftsmith train RECIPE OVERRIDES` writes it (save_recipe)."""
    save_recipe(load_recipe(checkpoint / "recipe.yaml", list(overrides)), checkpoint / "recipe.yaml")


def edit_json(path, **extra) -> None:
    data = json.loads(path.read_text())
    data.update(extra)
    path.write_text(json.dumps(data))


def fragments(secret: str) -> list[str]:
    """The secret and every word of it of 4 characters or more: no part of it may be uploaded."""
    return [secret] + [w for w in secret.replace(",", " ").replace("#", " ").split() if len(w) >= 4]


def assert_gone(hub, out: str, *secrets: str) -> None:
    text = uploaded_text(hub)
    for secret in secrets:
        for part in fragments(secret):
            assert part not in text, (part, secret)
            assert part not in out, (part, "printed")


def test_1_a_secret_under_a_nested_key_is_removed_in_yaml_and_json(pushable, hub, capsys):
    """`wandb:\\n  api_key: ...` in YAML and compact `{"hub": {"token": ...}}` in JSON went up unchanged."""
    with_recipe_override(pushable, "target.chat_template_kwargs={wandb: {api_key: abc123secret}, level: 2}")
    edit_json(pushable / "last_eval.json", hub={"token": "tok_nested_zz9"})
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    assert_gone(hub, out, "abc123secret", "tok_nested_zz9")
    assert "recipe.yaml: the value of 'target.chat_template_kwargs.wandb.api_key'" in out
    assert "last_eval.json: the value of 'hub.token'" in out
    kept = yaml.safe_load(hub["files"]["recipe.yaml"])
    assert kept["target"]["chat_template_kwargs"]["level"] == 2


def test_1_a_secret_draftsmith_itself_wrote_with_spaces_is_removed_whole(pushable, hub, capsys):
    """`train R "target.chat_template_kwargs={api_key: 'sk_live_first_part second_part'}"` then push uploaded
    `api_key: sk_live_first_part second_part`."""
    with_recipe_override(pushable, "target.chat_template_kwargs={api_key: 'sk_live_first_part second_part'}")
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    assert_gone(hub, out, "sk_live_first_part second_part")


@pytest.mark.parametrize("value", ["quokka horsebattery staplegun", "wombat7, dingo7 # numbat7", "zorkone zorktwo\nzorkthree\n",
                                   "foldedqq longqq\nsecretqq textqq", 918273645, ["listqq", "ofsecretsqq"]])
def test_1_a_secret_value_of_any_form_goes_whole(pushable, hub, capsys, value):
    """Spaces, a comma, a `#`, a YAML block (`|`) or folded (`>-`) scalar, a number, a list: the whole value."""
    with_recipe_override(pushable, "target.chat_template_kwargs={}")
    recipe = yaml.safe_load((pushable / "recipe.yaml").read_text())
    recipe["target"]["chat_template_kwargs"] = {"password": value, "hf_token": value}
    style = "|" if isinstance(value, str) and "\n" in value and value.endswith("\n") else (
        ">" if isinstance(value, str) and "\n" in value else None)
    (pushable / "recipe.yaml").write_text(yaml.safe_dump(recipe, default_style=None, sort_keys=False)
                                          if style is None else _with_block(recipe, value, style))
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    words = value if isinstance(value, list) else [str(value)]
    assert_gone(hub, out, *words)


def _with_block(recipe: dict, value: str, style: str) -> str:
    """The recipe with the two secrets written as YAML block (`|`) or folded (`>-`) scalars."""
    recipe = dict(recipe, target=dict(recipe["target"], chat_template_kwargs={}))
    text = yaml.safe_dump(recipe, sort_keys=False).replace("  chat_template_kwargs: {}\n", "  chat_template_kwargs:\n")
    indicator = "|" if style == "|" else ">-"
    body = "".join(f"      {line}\n" for line in value.rstrip("\n").split("\n"))
    block = f"    password: {indicator}\n{body}    hf_token: {indicator}\n{body}"
    head, tail = text.split("  chat_template_kwargs:\n")
    return head + "  chat_template_kwargs:\n" + block + tail


def test_1_free_text_secrets_and_local_paths_inside_strings(pushable, hub, capsys):
    """`"password: x"` inside a JSON string, `file:///home/bob/...`, `host:/home/alice/...` and a JSON-escaped
    `\\/home\\/...` path in free text."""
    edit_json(pushable / "last_eval.json", note="password: hunter22 was used", log="file:///home/bob/acme/log.txt",
              mount="nas1:/home/alice/acme/data")
    text = (pushable / "last_eval.json").read_text()
    (pushable / "last_eval.json").write_text(text[:-1] + ', "escaped": "at \\/home\\/carol\\/acme\\/x.json"}')
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    text = uploaded_text(hub)
    assert_gone(hub, out, "hunter22")
    for private in ("/home/bob", "/home/alice", "/home/carol", "home/bob", "acme/"):
        assert private not in text, private
    assert json.loads(hub["files"]["last_eval.json"])["tau"] == 1.5


SHAPES = {
    "github": "ghp_" + "A1b2C3d4E5" * 4, "github_pat": "github_pat_" + "11ABCDEFG0" * 4,
    "slack": "xoxb-1234567890-abcdefghij", "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJlX2hlcmU",
    "postgres": "postgres://dbuser:Pa55w0rdXYZ@db.internal:5432/x",
    "pem": "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA7tH1sMaterial\n-----END RSA PRIVATE KEY-----",
}


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_1_secret_shapes_in_free_text(pushable, hub, capsys, kind):
    """GitHub, Slack, a JWT, credentials in a URL and a PEM private key, in a string no key names a secret."""
    edit_json(pushable / "last_eval.json", note=f"see {SHAPES[kind]} here")
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    secret = {"postgres": "Pa55w0rdXYZ", "pem": "MIIEowIBAAKCAQEA7tH1sMaterial"}.get(kind, SHAPES[kind])
    assert secret not in uploaded_text(hub) and "redacted last_eval.json" in out


def test_1_a_hard_link_named_recipe_yaml_is_refused(pushable, hub, capsys, tmp_path):
    """A hard link to ~/.kube/config named recipe.yaml was uploaded: a file with more than one link is not
    taken for the checkpoint's own (and a file that is not a recipe is not a recipe)."""
    kube = tmp_path / "home" / ".kube" / "config"
    kube.parent.mkdir(parents=True)
    kube.write_text("apiVersion: v1\nusers:\n- name: admin\n  user:\n    token: kube-secret-0000\n")
    (pushable / "recipe.yaml").unlink()
    os.link(kube, pushable / "recipe.yaml")
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code != 0 and "'recipe.yaml' in the checkpoint has 2 hard links" in line and "files" not in hub
    (pushable / "recipe.yaml").unlink()
    (pushable / "recipe.yaml").write_text(kube.read_text())                 # a copy: one link, but no recipe
    code, line = run_cli(capsys, "push", pushable, "me/x")
    assert code != 0 and "is not a draftsmith recipe" in line and "files" not in hub


def test_1_a_long_file_is_scanned_in_linear_time(pushable, hub, capsys):
    """A last_eval.json with 40,000 trailing blank lines took 89 s to push."""
    text = (pushable / "last_eval.json").read_text()
    (pushable / "last_eval.json").write_text(text + "\n" * 40_000)
    started = time.perf_counter()
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    assert time.perf_counter() - started < 20           # was 89 s on a 2-core AMD EPYC


def nested_secrets(rng: random.Random, depth: int = 0) -> tuple[dict, list[str]]:
    """A random mapping with secrets at random depths, under secret-naming keys, in every value form."""
    keys = ["api_key", "hf_token", "password", "client_secret", "access_token", "private_key", "db_passwd",
            "AWS_SECRET_ACCESS_KEY", "wandb-api-key"]
    out, secrets = {}, []
    for i in range(rng.randint(2, 4)):
        if depth < 3 and rng.random() < 0.5:
            inner, found = nested_secrets(rng, depth + 1)
            out[f"group_{depth}_{i}"] = inner if rng.random() < 0.7 else [inner, "plain"]
            secrets += found
            continue
        word = lambda: "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(10))  # noqa: E731
        value = rng.choice([word(), f"{word()} {word()}", f"{word()}, {word()} # {word()}", f"{word()}\n{word()}\n",
                            [word(), word()]])
        out[rng.choice(keys)] = value
        secrets += value if isinstance(value, list) else [value.strip()]
        out[f"setting_{i}"] = rng.randint(0, 9)
    return out, secrets


@pytest.mark.parametrize("seed", range(6))
def test_1_generated_nested_secrets_never_leave_in_any_part(pushable, hub, capsys, seed):
    """Nested secrets in the recipe (YAML, through the typed settings) and in config.json and last_eval.json
    (JSON): no secret value, and no word of one, is anywhere in the upload or in what push prints."""
    rng = random.Random(seed)
    in_recipe, secrets = nested_secrets(rng)
    in_config, more = nested_secrets(rng)
    in_eval, even_more = nested_secrets(rng)
    recipe = yaml.safe_load((pushable / "recipe.yaml").read_text())
    recipe["target"]["chat_template_kwargs"] = in_recipe
    (pushable / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=bool(seed % 2)))
    config = json.loads((pushable / "config.json").read_text())
    config["notes"] = in_config
    (pushable / "config.json").write_text(json.dumps(config, separators=(",", ":")))   # compact JSON
    edit_json(pushable / "last_eval.json", extra=in_eval)
    code, out = run_cli(capsys, "push", pushable, "me/x")
    assert code == 0, out
    assert_gone(hub, out, *secrets, *more, *even_more)
    assert json.loads(hub["files"]["config.json"])["kind"] == "medusa"


# -- 2: a shard found corrupt is never trained on -------------------------------------------------------------

@pytest.fixture(scope="module")
def trained4(tmp_path_factory, tiny_target_dir):
    """A run with data, its feature cache and a trained Medusa checkpoint (3 steps)."""
    from conftest import tiny_recipe as recipe_of
    from draftsmith.cli import main
    tmp = tmp_path_factory.mktemp("trained4")
    raw = recipe_of(tmp, tiny_target_dir, max_steps=3, eval_prompts=0)
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", str(tmp / "recipe.yaml")]) == 0
    return tmp


def corrupt_keeping_size_and_mtime(path, offset: int) -> None:
    info = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


@pytest.mark.parametrize("where", ["header", "record offsets", "middle", "three quarters", "last byte"])
def test_2_a_shard_corrupted_anywhere_is_never_trained_on(trained4, tmp_path, capsys, monkeypatch, where):
    """Under the default train.verify_cache=first-use, a stamped shard corrupted under the same size and mtime,
    with pieces small enough that the 4-piece spot check almost surely misses it: the corrupted bytes never
    reach a batch.  It is deleted when found (at the check, or when training first reads the piece) and built
    again; a run that found it only while training stops naming it, and the same command rebuilds it.  Before:
    a flagged shard passed the fallback's second spot check and trained (issue 57: loss 1.698 against 1.756)."""
    import shutil

    from draftsmith.data import features
    from draftsmith.train.batches import FeatureSource

    monkeypatch.setattr(features, "PIECE", 256)                  # a tiny shard of hundreds of pieces
    run = tmp_path / "run"
    shutil.copytree(trained4 / "run", run)
    raw = yaml.safe_load((trained4 / "recipe.yaml").read_text())
    raw["output_dir"] = str(run)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    shards = sorted((run / "data" / "features").rglob("shard-*.safetensors"))
    for shard in shards:                                         # stamped at this piece size, as a first run does
        meta = features.safe_open(str(shard), framework="pt").metadata()
        assert features.check_shard(shard, json.loads(meta["layers"]), meta["target"], "always") is None
    victim = shards[0]
    meta = features.safe_open(str(victim), framework="pt").metadata()
    layers, target_hash = json.loads(meta["layers"]), meta["target"]
    size = victim.stat().st_size
    header = 8 + int.from_bytes(victim.read_bytes()[:8], "little")
    offset = {"header": 10, "record offsets": header + 4, "middle": size // 2, "three quarters": 3 * size // 4,
              "last byte": size - 1}[where]
    corrupt_keeping_size_and_mtime(victim, offset)
    corrupted = victim.read_bytes()
    good = features.ShardReader(trained4 / "run" / victim.relative_to(run), layers, target_hash, "never")
    (tmp_path / "corrupted.safetensors").write_bytes(corrupted)
    try:
        bad = features.ShardReader(tmp_path / "corrupted.safetensors", layers, target_hash, "never")
    except features.CacheError:
        bad = None                                        # the header itself is what was corrupted
    served = []
    original = FeatureSource.batch

    def spy(self, rows, longest):
        """No record a batch holds is a record the corruption changed, as the corrupted file holds it."""
        out = original(self, rows, longest)
        for i, r in enumerate(rows):
            served.append((r["shard"], r["row"]))
            if r["shard"] != victim.stem or bad is None:
                continue
            try:
                hurt = bad.record(r["row"])[: len(r["input_ids"])]
            except Exception:  # noqa: BLE001 - corrupted offsets: that record cannot even be sliced
                continue
            if hurt.shape[0] == 0 or torch.equal(hurt, good.record(r["row"])[: len(r["input_ids"])]):
                continue                                  # a record the corruption did not touch (or emptied)
            for layer in self.wanted:
                assert not torch.equal(out[layer][i, : hurt.shape[0]], hurt[:, self.layers.index(layer)]), r
        return out

    monkeypatch.setattr(FeatureSource, "batch", spy)
    from draftsmith.cli import main
    code = main(["train", str(tmp_path / "recipe.yaml"), "overwrite=true"])
    err = capsys.readouterr().err
    if code == 0:                        # found at the check: deleted and rebuilt before training
        assert victim.read_bytes() != corrupted
    else:                                # found when training first read it: refused, deleted, named
        assert "changed since it was verified" in err and "deleted" in err and not victim.exists(), err
        assert main(["train", str(tmp_path / "recipe.yaml"), "overwrite=true"]) == 0      # the same command
        assert victim.read_bytes() != corrupted
    meta = features.safe_open(str(victim), framework="pt").metadata()
    assert features.streamed_checksum(victim)[0] == meta["sha256"]
    assert served, "training read no batch"


# -- 3: files draftsmith keeps are validated when read back --------------------------------------------------

def kept_cost_table(tmp_path, content: str):
    from draftsmith.eval.costs import kept_table
    path = tmp_path / "costs.json"
    path.write_text(content)
    conditions = {"machine": "m", "stack": "draftsmith", "target": "t", "dtype": "float32", "drafter": "d",
                  "context": 512}
    return path, (lambda: kept_table(path, conditions, (1,), (0, 1)))


GOOD = {"machine": "m", "stack": "draftsmith", "target": "t", "dtype": "float32", "drafter": "d", "context": 512,
        "verify_ms": {"1": {"0": 10.0, "1": 12.0}}, "draft_ms": {"1": {"0": 0.0, "1": 1.0}}, "version": 1}


@pytest.mark.parametrize("case, content", [
    ("negative costs", json.dumps({**GOOD, "verify_ms": {"1": {"0": -10.0, "1": -12.0}}})),
    ("all-zero costs", json.dumps({**GOOD, "verify_ms": {"1": {"0": 0.0, "1": 0.0}}})),
    ("a list", json.dumps([GOOD])),
    ("a missing field", json.dumps({k: v for k, v in GOOD.items() if k != "draft_ms"})),
    ("garbage", "\x00\x01 not json at all"),
    ("infinite cost", json.dumps({**GOOD, "verify_ms": {"1": {"0": 10.0, "1": float("inf")}}})),
])
def test_3_a_bad_kept_cost_table_is_measured_again_with_its_file_named(tmp_path, caplog, case, content):
    """Negative costs made bench --predict say 2.01x and write K = 2 where a fresh table said 0.76x; a list,
    a missing field or zeros raised AttributeError, TypeError or ZeroDivisionError; garbage named no file."""
    path, read = kept_cost_table(tmp_path, content)
    assert read() is None, case
    assert f"cost table {path} cannot be used" in caplog.text and "measured again" in caplog.text
    path.write_text(json.dumps(GOOD))
    assert read() is not None                                    # a good one is used as kept


def test_3_cost_context_is_bounded_by_the_targets_positions_and_memory(tiny_target, monkeypatch):
    """--cost-context 5000 on a target of 2048 positions was timed past its context; 1,000,000 ran out of memory."""
    from draftsmith.eval import predict
    with pytest.raises(predict.PredictError, match=r"--cost-context 5000: .* past the 2048 positions"):
        predict.bound_context(5000, tiny_target, (1, 4), (0, 1, 2))
    monkeypatch.setattr(tiny_target.config, "max_position_embeddings", 10 ** 9)
    with pytest.raises(predict.PredictError, match=r"--cost-context 1000000: the KV cache .* more than half"):
        predict.bound_context(1_000_000, tiny_target, (1, 4096), (0, 1, 2))
    predict.bound_context(512, tiny_target, (1, 4), (0, 1, 2))                   # the default passes


# -- 4: one bounded reading path for every source -------------------------------------------------------------

def test_4_a_huge_json_record_is_refused_by_its_size(tmp_path):
    """A 200 MB record in a .json file aborted natively at 5.3 GB of memory; .jsonl had the 8 MiB bound."""
    from draftsmith.data.sources import DataError, conversations
    path = tmp_path / "p.json"
    path.write_text('[{"prompt": "' + "word " * (2 << 20) + '"}]')           # 10 MiB in one record
    with pytest.raises(DataError, match=r"p.json: record 0 is more than 8 MiB"):
        list(conversations(str(path)))


def test_4_a_fifo_named_json_is_refused_without_reading(tmp_path):
    """A FIFO named p.json hung `eval` until killed."""
    from draftsmith.data.sources import DataError, conversations
    os.mkfifo(tmp_path / "p.json")
    with pytest.raises(DataError, match="is not a regular file"):
        list(conversations(str(tmp_path / "p.json")))


def test_4_non_utf8_json_and_a_gz_that_is_not_gzip_name_the_file_and_the_fix(tmp_path):
    from draftsmith.data.sources import DataError, conversations
    (tmp_path / "latin.json").write_bytes('[{"prompt": "café"}]'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.json: not UTF-8 \(.* near byte 16\); re-encode"):
        list(conversations(str(tmp_path / "latin.json")))
    (tmp_path / "plain.gz").write_text('{"prompt": "hello"}\n')
    with pytest.raises(DataError, match=r"plain.gz' is named .gz but is not gzip-compressed"):
        list(conversations(str(tmp_path / "plain.gz")))


def test_4_a_bad_prompt_file_is_reported_before_the_target_loads(pushable, tmp_path, capsys, monkeypatch):
    """Bad prompt files were reported only after the target had loaded and the tree had been tuned."""
    from draftsmith.heads.runtime.target import Target
    loads = []
    original = Target.load.__func__
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: loads.append(a) or original(cls, *a, **k)))
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    code, line = run_cli(capsys, "eval", pushable, "--prompts", tmp_path / "bad.jsonl", "--limit", "1")
    assert code != 0 and "not UTF-8" in line and not loads, line


# -- 5: the rest ---------------------------------------------------------------------------------------------

def test_5_data_thinking_takes_on_and_off_unquoted(tmp_path):
    """The documented data.thinking=on needed quotes: YAML reads a bare on as true."""
    from draftsmith.train.settings import apply_overrides
    for word, meant in (("on", "on"), ("off", "off"), ("both", "both")):
        raw = apply_overrides({"method": "medusa"}, [f"data.thinking={word}"])
        assert recipe_from_dict(raw).data.thinking == meant


def test_5_sigterm_during_bench_keeps_what_was_measured(tmp_path, capsys, monkeypatch):
    """SIGTERM during `bench` left no report, where SIGINT kept a partial one."""
    import signal

    from draftsmith.eval import bench as bench_module
    out = tmp_path / "bench"

    def measuring_then_killed(checkpoint, settings, directory):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "report.md").write_text("# partial (incomplete)\n")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)                                   # the handler interrupts the sleep
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(bench_module, "bench", measuring_then_killed)
    code, line = run_cli(capsys, "bench", "ngram", "--out", out)
    assert code != 0 and "what was measured is in" in line and (out / "report.md").is_file(), line
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL                 # put back
