"""`bench --predict` and `bench --break-even` (eval/predict.py): the model's arithmetic against cases computed
by hand, a cost table that flips the choice of K, the cache of measured costs (kept per machine, stack,
target, dtype and drafter; one measured elsewhere is measured again), and both verbs on a tiny target."""
import json
import math

import pytest
from draftsmith.eval import predict
from draftsmith.eval.predict import CostTable


def table(verify: dict, draft: dict, machine="m") -> CostTable:
    return CostTable(machine=machine, stack="draftsmith", target="t", dtype="float32", drafter="d", context=512,
                     verify_ms=verify, draft_ms=draft)


# T(1, K) = 10 + 2K ms, D(1, K) = 2K ms; at batch 16 verifying is dear: T(16, K) = 40 + 30K
CHEAP = {1: {0: 10.0, 1: 12.0, 2: 14.0, 3: 16.0}, 16: {0: 40.0, 1: 70.0, 2: 100.0, 3: 130.0}}
DRAFT = {1: {0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0}, 16: {0: 0.0, 1: 2.0, 2: 4.0, 3: 6.0}}
PROFILE = [0.8, 0.6, 0.3]           # unconditional: a_0, a_1, a_2


def test_expected_tokens_and_speedups_are_the_hand_computed_ones():
    assert predict.expected_tokens(PROFILE, 0) == 1.0
    assert predict.expected_tokens(PROFILE, 2) == pytest.approx(2.4)
    assert predict.unconditional_from([0.8, 0.75, 0.5]) == pytest.approx([0.8, 0.6, 0.3])
    with pytest.raises(predict.PredictError, match="3 positions cannot price a chain of 4"):
        predict.expected_tokens(PROFILE, 4)
    s = predict.speedups(PROFILE, table(CHEAP, DRAFT))
    assert s[1] == pytest.approx({0: 1.0, 1: 1.8 * 10 / 14, 2: 2.4 * 10 / 18, 3: 2.7 * 10 / 22})
    assert s[16] == pytest.approx({0: 1.0, 1: 1.8 * 40 / 72, 2: 2.4 * 40 / 104, 3: 2.7 * 40 / 136})
    # batch 1: K=2 (1.333 over 1.286 and 1.227); batch 16: nothing beats plain decoding, K=0
    assert predict.choose(s) == {1: 2, 16: 0}


def test_a_cost_table_where_verifying_is_cheap_flips_the_choice_of_k():
    flat = {16: {0: 40.0, 1: 41.0, 2: 42.0, 3: 43.0}}
    s = predict.speedups(PROFILE, table(flat, {16: DRAFT[16]}))
    assert s[16][3] == pytest.approx(2.7 * 40 / 49)
    assert predict.choose(s) == {16: 3}
    assert predict.choose(predict.speedups(PROFILE, table({16: CHEAP[16]}, {16: DRAFT[16]}))) == {16: 0}


def test_the_vllm_schedule_covers_every_batch_size_from_one():
    assert predict.vllm_schedule({1: 3, 2: 3, 4: 2, 8: 0, 16: 0, 32: 0}) == [[1, 2, 3], [3, 4, 2], [5, 32, 0]]
    assert predict.vllm_schedule({1: 2}) == [[1, 1, 2]]
    config = predict.vllm_config("eagle3", {1: 3, 4: 1})
    assert config == {"method": "eagle3", "num_speculative_tokens": 3,
                      "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 4, 1]]}
    assert predict.vllm_config("p_eagle", {1: 2, 4: 2})["parallel_drafting"] is True
    assert predict.vllm_config("eagle3", {1: 0, 4: 0}) == {}


def test_break_even_is_the_rate_that_makes_speculation_pay_exactly():
    dear = {32: {0: 40.0, 1: 100.0}}
    even = predict.break_even(table({**CHEAP, **dear}, {**DRAFT, 32: {0: 0.0, 1: 2.0}}))
    assert even[1][1] == pytest.approx(0.4, abs=1e-9)                                  # 1 + c = 14 / 10
    assert even[1][2] == pytest.approx((-1 + math.sqrt(1 + 4 * 0.8)) / 2, abs=1e-9)    # 1 + c + c^2 = 1.8
    c = even[16][3]                                                                    # (130 + 6) / 40 = 3.4
    assert 1 + c + c ** 2 + c ** 3 == pytest.approx(3.4, abs=1e-9)
    assert even[32][1] is None          # (100 + 2) / 40 = 2.55 steps' cost: 2 tokens at most cannot pay


def test_both_verbs_on_a_tiny_target(tiny_target, tiny_target_dir, tmp_path, monkeypatch, capsys, caplog):
    """--predict prices the checkpoint's own measured chain, clamps K to the drafter's depth and says so,
    keeps the costs, reuses them, measures again when the machine differs, and a cost table that makes
    verification cheap changes the K it chooses; --break-even prices a target with no drafter."""
    from conftest import eagle3_checkpoint
    from draftsmith.cli import main
    from draftsmith.heads.card import LAST_EVAL_FILE

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "ckpt"
    eagle3_checkpoint(tiny_target, checkpoint)
    assert main(["bench", str(checkpoint), "--predict", "--out", str(tmp_path / "p0")]) == 2   # no profile yet
    assert "no acceptance profile" in capsys.readouterr().err
    (checkpoint / LAST_EVAL_FILE).write_text(json.dumps({
        "per_position_acceptance": [0.7, 0.4, 0.1], "proposal": "chain of 3", "temperature": 0.0,
        "prompts": 5, "prompts_source": "mt-bench", "date": "2026-12-05"}))
    argv = ["bench", str(checkpoint), "--predict", "--batch-sizes", "1,2", "--max-k", "6", "--device", "cpu",
            "--dtype", "float32"]
    assert main(argv + ["--out", str(tmp_path / "p1")]) == 0
    first = json.loads((tmp_path / "p1" / "predict.json").read_text())
    assert "K above 3 left out" in " ".join(first["profile"]["notes"])
    assert set(first["speedup"]["1"]) == {"0", "1", "2", "3"}
    for b, row in first["speedup"].items():
        costs = first["costs"]
        for k, s in row.items():
            e = 1 + sum([0.7, 0.4, 0.1][:int(k)])
            assert s == pytest.approx(e * costs["verify_ms"][b]["0"] / (costs["verify_ms"][b][k]
                                                                       + costs["draft_ms"][b][k]))
    assert (tmp_path / "p1" / "predict.png").is_file() and "chosen K" in (tmp_path / "p1" / "predict.md").read_text()

    # a second prediction reads the kept costs: nothing is measured
    monkeypatch.setattr(predict, "measure_verify", lambda *a, **k: pytest.fail("measured again"))
    assert main(argv + ["--out", str(tmp_path / "p2")]) == 0
    assert json.loads((tmp_path / "p2" / "predict.json").read_text())["costs"] == first["costs"]

    # the kept table rewritten so that verifying more tokens costs nothing: the choice becomes the deepest K
    (kept,) = (tmp_path / "cache" / "costs").glob("draftsmith-*.json")
    raw = json.loads(kept.read_text())
    raw["verify_ms"] = {b: {k: 10.0 for k in row} for b, row in raw["verify_ms"].items()}
    raw["draft_ms"] = {b: {k: 0.0 for k in row} for b, row in raw["draft_ms"].items()}
    kept.write_text(json.dumps(raw))
    assert main(argv + ["--out", str(tmp_path / "p3")]) == 0
    flipped = json.loads((tmp_path / "p3" / "predict.json").read_text())
    assert flipped["chosen_k"] == {"1": 3, "2": 3}
    assert flipped["speedup"]["1"]["3"] == pytest.approx(2.2)
    assert flipped["speculative_config"]["num_speculative_tokens"] == 3

    # kept from another machine: measured again, said in one line
    raw["machine"] = "another machine"
    kept.write_text(json.dumps(raw))
    measured = []
    monkeypatch.setattr(predict, "measure_verify", lambda target, batches, ks, context, **k:
                        measured.append(1) or {b: {q: 10.0 + q for q in ks} for b in batches})
    assert main(argv + ["--out", str(tmp_path / "p4")]) == 0
    assert measured and "measured under other conditions (machine 'another machine'" in caplog.text

    # another context is another condition: measured again, after that many cached tokens
    contexts = []
    monkeypatch.setattr(predict, "measure_verify", lambda target, batches, ks, context, **k:
                        contexts.append(context) or {b: {q: 10.0 + q for q in ks} for b in batches})
    assert main(argv + ["--cost-context", "64", "--out", str(tmp_path / "p5")]) == 0
    assert contexts == [64] and json.loads((tmp_path / "p5" / "predict.json").read_text())["costs"]["context"] == 64
    capsys.readouterr()
    assert main(argv + ["--cost-context", "0", "--out", str(tmp_path / "p6")]) == 2
    assert "--cost-context 0" in capsys.readouterr().err

    assert main(["bench", str(tiny_target_dir), "--break-even", "--batch-sizes", "1,4", "--max-k", "3",
                 "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "be")]) == 0
    even = json.loads((tmp_path / "be" / "break-even.json").read_text())["break_even"]
    assert main(["bench", str(tiny_target_dir), "--break-even", "--cost-context", "0", "--out", str(tmp_path / "be0")]) == 2
    assert "--cost-context 0" in capsys.readouterr().err
    assert set(even) == {"1", "4"} and set(even["1"]) == {"1", "2", "3"}
    assert all(v is None or 0 < v <= 1 for row in even.values() for v in row.values())


def test_vllm_prices_a_medusa_drafter_at_its_head_count_only(tiny_target, tmp_path, monkeypatch, capsys):
    """vLLM's Medusa drafts one token per head every step, whatever num_speculative_tokens says, so
    `--predict --engine vllm` prices K = the head count (and plain decoding) only, and says why; the K it
    writes into vLLM's speculative_config is one vLLM serves."""
    from conftest import medusa_checkpoint
    from draftsmith.cli import main
    from draftsmith.eval import predict_vllm
    from draftsmith.heads.card import LAST_EVAL_FILE

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "medusa"
    medusa_checkpoint(tiny_target, checkpoint, num_heads=3)
    (checkpoint / LAST_EVAL_FILE).write_text(json.dumps({
        "per_position_acceptance": [0.9, 0.8, 0.7], "proposal": "chain of 3", "temperature": 0.0,
        "prompts": 5, "prompts_source": "mt-bench", "date": "2026-12-06"}))
    priced = []

    def whole_steps(checkpoint, config, target_path, batches, ks, *args, **kwargs):
        priced.append(tuple(ks))
        return CostTable(machine="m", stack="vllm 0.32.0", target="t", dtype="float32", drafter="medusa",
                         context=512, verify_ms={b: {k: 10.0 + k for k in ks} for b in batches},
                         draft_ms={b: {k: 0.0 for k in ks} for b in batches})
    monkeypatch.setattr(predict_vllm, "vllm_cost_table", whole_steps)
    assert main(["bench", str(checkpoint), "--predict", "--engine", "vllm", "--batch-sizes", "1,4", "--max-k", "8",
                 "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "p")]) == 0
    assert priced == [(0, 3)]
    report = json.loads((tmp_path / "p" / "predict.json").read_text())
    assert "K = 3 only: vLLM drafts all 3 positions of a medusa drafter" in " ".join(report["profile"]["notes"])
    assert set(report["speedup"]["1"]) == {"0", "3"} and report["chosen_k"] == {"1": 3, "4": 3}
    assert report["speculative_config"]["num_speculative_tokens"] == 3
    assert report["speedup"]["1"]["3"] == pytest.approx((1 + 0.9 + 0.8 + 0.7) * 10 / 13)


def test_a_checkpoint_of_another_target_is_refused(tiny_target, tmp_path, capsys, monkeypatch):
    from conftest import build_tiny_target, eagle3_checkpoint
    from draftsmith.cli import main

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    eagle3_checkpoint(tiny_target, tmp_path / "ckpt")
    other = build_tiny_target(tmp_path / "other", "llama", seed=5)
    assert main(["bench", str(tmp_path / "ckpt"), "--predict", "--target", str(other), "--device", "cpu",
                 "--out", str(tmp_path / "p")]) == 2
    assert "target" in capsys.readouterr().err


def test_the_predict_check_script_runs_as_its_usage_line_says(tiny_target, tmp_path, monkeypatch, capsys):
    """scripts/predict_check.py on a tiny EAGLE-3 checkpoint: bench's chain of each K beside the prediction,
    the prediction from bench's own tau computed from the same costs, the decoding ratio from bench's runs."""
    import sys
    from pathlib import Path

    from conftest import chats_file, eagle3_checkpoint
    from draftsmith.heads.card import LAST_EVAL_FILE
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from predict_check import main

    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "run" / "checkpoint"
    eagle3_checkpoint(tiny_target, checkpoint)
    (checkpoint / LAST_EVAL_FILE).write_text(json.dumps({
        "per_position_acceptance": [0.7, 0.4, 0.1], "proposal": "chain of 3", "temperature": 0.0}))
    prompts = chats_file(tmp_path / "p.jsonl", 2)
    assert main([str(tmp_path / "out"), str(checkpoint), "--ks", "1,2", "--prompts", str(prompts), "--limit", "1",
                 "--max-new-tokens", "8", "--repeats", "1", "--dtype", "float32", "--cost-context", "64"]) == 0
    rows = json.loads((tmp_path / "out" / "predict_check.json").read_text())
    predicted = json.loads((tmp_path / "out" / "0-run" / "predict-draftsmith" / "predict.json").read_text())
    assert predicted["costs"]["context"] == 64
    assert [r["k"] for r in rows] == [1, 2]
    for r in rows:
        bench = json.loads((tmp_path / "out" / "0-run" / f"bench-draftsmith-k{r['k']}" / "report.json").read_text())
        assert bench["proposal"] == f"chain of {r['k']}"
        assert (r["engine"], r["batch"]) == ("draftsmith", 1)
        step = r["step_ms"]
        assert r["predicted_from_bench_acceptance"] == pytest.approx(
            r["bench_tau"] * step["step_0"] / (step["step_k"] + step["draft"]))
        assert r["profile_tau"] == pytest.approx(1 + sum([0.7, 0.4][:r["k"]]))
        assert r["measured_decoding"] > 0 and r["error"] == pytest.approx(r["predicted"] / r["measured_decoding"] - 1)
    assert "| eagle3 | draftsmith | 1 | 2 |" in capsys.readouterr().out


def test_vllm_step_times_count_only_steps_with_the_whole_batch_decoding():
    from draftsmith.eval.predict_vllm import decode_step_ms
    steps = [[0.0001, 2, 0], [0.8, 2, 0], [0.5, 2, 1], [0.030, 2, 2], [0.040, 2, 2], [0.035, 2, 2], [0.020, 1, 1]]
    assert decode_step_ms(steps, 2) == pytest.approx(35.0)         # the prefills and the tail left out
    assert decode_step_ms(steps, 1) == pytest.approx(20.0)
    assert decode_step_ms(steps, 4) is None


def test_bench_chain_is_draftsmith_engines_own():
    from draftsmith.eval.bench_settings import BenchError, BenchSettings
    assert BenchSettings(chain=2).chain == 2
    with pytest.raises(BenchError, match="vLLM's is --num-speculative-tokens"):
        BenchSettings(chain=2, engine="vllm")
    with pytest.raises(BenchError, match="K >= 1"):
        BenchSettings(chain=0)
