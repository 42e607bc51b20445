"""`draftsmith bench`: the report on a tiny model through the real CLI, the verdict on synthetic timings
whose answer is known, bad input, and Ctrl-C keeping what was measured."""
import json

import pytest
from draftsmith.cli import main
from draftsmith.eval.bench import Run, pooled_speedup, summarize_group, verdict


def traffic_file(path):
    lines = [{"id": f"code-{i}", "category": "code", "prompt": f"def f{i}(x): return the"} for i in range(3)]
    lines += [{"id": f"chat-{i}", "category": "chat", "messages": [{"role": "user", "content": f"the day {i}"}]}
              for i in range(2)]
    lines += [{"id": "short", "prompt": "of the water", "max_tokens": 3},     # no category: uncategorized
              {"id": "nothing", "text": "a line without a prompt"}]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


def test_bench_reports_every_category_with_plots_and_a_verdict(checkpoint, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["bench", str(checkpoint), "--prompts", str(traffic_file(tmp_path / "traffic.jsonl")), "--limit", "2",
            "--repeats", "2", "--max-new-tokens", "8", "--cost-per-hour", "3.6", "--dtype", "float32",
            "--device", "cpu", "--out", str(out), "--lookup", "2"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is True
    assert "context lookup of 2" in report["proposal"]
    assert report["traffic"]["available"] == {"chat": 2, "code": 3, "uncategorized": 1}
    assert report["traffic"]["sampled"] == {"chat": 2, "code": 2, "uncategorized": 1}
    assert report["traffic"]["skipped_without_prompt"] == 1
    groups = report["results"][0]["groups"]
    assert set(groups) == {"chat", "code", "uncategorized", "all"}
    for name, group in groups.items():
        assert group["runs_per_mode"] == group["requests"] * 2, name
        assert group["verdict"].split(":")[0] in ("switch on", "switch off", "no measurable gain")
        low, high = group["speedup_interval"]
        assert low <= group["speedup"] <= high or low == high
        assert group["identical_text"] == 1.0          # fp32 greedy: the same text with and without the drafter
        assert group["plain"]["cost_per_request"] == pytest.approx(
            3.6 / 3600 * sum(r["seconds"] for r in report["runs"] if r["mode"] == "plain" and
                             (name == "all" or r["category"] == name)) / group["runs_per_mode"])
    # a request's own max_tokens holds
    assert all(len(r["tokens"]) <= 3 for r in report["runs"] if r["request"] == "short")
    assert max(len(r["tokens"]) for r in report["runs"]) <= 8
    for name in ("speedup.png", "latency.png", "acceptance.png", "acceptance-by-context.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "Recommendation" in page
    steps = [a for r in report["runs"] if r["mode"] == "speculative" for a in r["accepted"]]
    assert [b["context"] for b in groups["all"]["acceptance_by_context"]] == ["0-1k"]     # short prompts
    assert groups["all"]["acceptance_by_context"][0]["steps"] == len(steps)
    md = (out / "report.md").read_text()
    assert "| code |" in md and "![speedup.png](speedup.png)" in md
    assert "Recommendation" in capsys.readouterr().out


def _runs(category, plain, spec, temperature=0.0):
    """Runs whose plain and speculative seconds are given per (request, repeat)."""
    runs = []
    for i, (p, s) in enumerate(zip(plain, spec)):
        request, repeat = f"r{i % 4}", i // 4
        runs.append(Run(request, category, temperature, repeat, "plain", p, p / 10, [1] * 10))
        runs.append(Run(request, category, temperature, repeat, "speculative", s, s / 10, [1] * 10, [1, 0, 2]))
    return runs


@pytest.mark.parametrize("plain, spec, expected", [
    ([1.0, 1.1, 0.9, 1.0] * 2, [0.5, 0.55, 0.45, 0.52] * 2, "switch on"),
    ([1.0, 1.1, 0.9, 1.0] * 2, [2.0, 2.1, 1.9, 2.2] * 2, "switch off"),
    ([1.0, 1.0, 1.0, 1.0] * 2, [0.7, 1.3, 0.7, 1.3, 1.3, 0.7, 1.3, 0.7], "no measurable gain"),
])
def test_the_verdict_follows_the_speedup_interval(plain, spec, expected):
    group = summarize_group(_runs("c", plain, spec), cost_per_hour=None, positions=3, seed=0)
    assert group["verdict"].startswith(expected), group
    assert group["speedup"] == pytest.approx(sum(plain) / sum(spec))
    assert group["tau"] == pytest.approx(2.0)            # accepted [1, 0, 2] per run: (2 + 1 + 3) / 3
    assert group["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3, 0.0])
    # sampled replies differ in length: the speedup is per generated token, as docs/metrics.md defines it
    assert pooled_speedup([(1.0, 10, 1.0, 20), (2.0, 10, 1.0, 10)]) == pytest.approx((3.0 / 20) / (2.0 / 30))
    assert verdict(1.01, 1.2).startswith("switch on") and verdict(0.8, 0.99).startswith("switch off")
    assert verdict(0.99, 1.01).startswith("no measurable gain")
    assert verdict(1.5, 2.0, pairs=3).startswith("no measurable gain: 3 runs per mode are too few")


@pytest.mark.parametrize("flags, message", [
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--limit", "0"], "--limit must be >= 1"),
    (["--cost-per-hour", "-1"], "--cost-per-hour must be > 0"),
    (["--temperature", "-0.5"], "--temperature values must be >= 0"),
    (["--engine", "vllm", "--concurrency", "1,0"], "--concurrency values must be >= 1"),
    (["--concurrency", "1,x"], "--concurrency takes whole numbers"),
    (["--concurrency", "4"], "the draftsmith engine serves one request at a time"),
    (["--engine", "sglang"], "--engine must be one of draftsmith, vllm"),
    (["--engine", "vllm", "--lookup", "2"], "--lookup must be >= 0 and is draftsmith's own"),
    (["--against", "ngram"], "--against ngram is vLLM's own speculation: it needs --engine vllm"),
    (["--engine", "vllm", "--vllm-python", "/nonexistent/python"], "--vllm-python '/nonexistent/python' is not a file"),
])
def test_bad_bench_settings_are_one_clear_line(checkpoint, tmp_path, capsys, flags, message):
    assert main(["bench", str(checkpoint), "--out", str(tmp_path / "r")] + flags) == 2
    assert message in capsys.readouterr().err


def test_bad_traffic_is_named(checkpoint, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "the day", "max_tokens": 0}))
    assert main(["bench", str(checkpoint), "--prompts", str(bad), "--device", "cpu", "--out", str(tmp_path / "r")]) == 2
    assert f"{bad}:1: max_tokens must be a whole number >= 1, got 0" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": "no prompt"}))
    assert main(["bench", str(checkpoint), "--prompts", str(empty), "--device", "cpu", "--out", str(tmp_path / "r")]) == 2
    assert "no requests in" in capsys.readouterr().err


def test_ctrl_c_writes_what_was_measured_marked_incomplete(checkpoint, tmp_path, monkeypatch, capsys):
    from draftsmith.eval import bench
    calls = {"n": 0}
    original = bench.decode

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2 + 5:           # the 2 warm-up runs, then 2 full pairs and half of a third
            raise KeyboardInterrupt
        return original(*args, **kwargs)
    monkeypatch.setattr(bench, "decode", interrupted)          # the verifier as the bench calls it
    out = tmp_path / "report"
    argv = ["bench", str(checkpoint), "--prompts", str(traffic_file(tmp_path / "t.jsonl")), "--repeats", "1",
            "--max-new-tokens", "4", "--dtype", "float32", "--device", "cpu", "--out", str(out)]
    assert main(argv) == 130
    report = json.loads((out / "report.json").read_text())
    assert report["complete"] is False and len(report["runs"]) == 4      # the half pair is not kept
    assert (out / "report.md").read_text().count("INCOMPLETE") == 1
    assert "marked incomplete" in capsys.readouterr().err


def test_several_sources_make_one_sample(tiny_target, tmp_path):
    from draftsmith.eval.traffic import TrafficError, load_traffic
    mine = traffic_file(tmp_path / "mine.jsonl")
    traffic = load_traffic(tiny_target.tokenizer, f"mt-bench, humaneval,{mine}", limit=2, seed=0, max_tokens=16)
    sampled = {c: sum(r.category == c for r in traffic.requests) for c in traffic.available}
    assert traffic.available["code"] == 164 + 3            # HumanEval's 164 problems and the file's 3 lines
    assert len([c for c in traffic.available if c not in ("code", "chat", "uncategorized")]) == 8   # MT-bench's
    assert all(n == min(2, traffic.available[c]) for c, n in sampled.items())
    assert traffic.skipped_without_prompt == 1
    with pytest.raises(TrafficError, match="request ids repeat across"):
        load_traffic(tiny_target.tokenizer, f"{mine},{mine}", limit=2, seed=0, max_tokens=16)


def test_a_served_target_other_than_the_checkpoints_is_refused_naming_both(checkpoint, tmp_path, capsys):
    import sys

    from conftest import build_tiny_target
    other = build_tiny_target(tmp_path / "other-target", seed=11)
    argv = ["bench", str(checkpoint), "--engine", "vllm", "--vllm-python", sys.executable, "--target", str(other),
            "--out", str(tmp_path / "r")]
    assert main(argv) == 2             # refused before any vLLM is needed
    err = capsys.readouterr().err
    assert "was made for target" in err and "other-target" in err and "weights_sha256" in err


def test_ngram_needs_the_vllm_engine_and_a_target(tmp_path, capsys):
    for flags in ([], ["--engine", "vllm"], ["--target", "smollm2-135m"]):
        assert main(["bench", "ngram", "--out", str(tmp_path / "r")] + flags) == 2
        assert "'ngram' is vLLM's own prompt-lookup speculation" in capsys.readouterr().err


def test_the_measured_serving_config_switches_speculation_off_where_it_lost():
    from draftsmith.eval.bench_vllm import measured_serving_config

    def level(concurrency, speedup, temperature=0.0):
        return {"temperature": temperature, "concurrency": concurrency, "groups": {"all": {"speedup": speedup}}}

    base = {"method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}
    mixed = measured_serving_config(base, [level(1, 1.3), level(4, 1.05), level(16, 0.8), level(1, 0.5, 0.7)],
                                    "plain")
    config = mixed["speculative_config"]
    assert config["method"] == "eagle3" and config["parallel_drafting"] is True
    assert config["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 4, 3], [5, 16, 0]]
    assert "batch 16: 0.80x" in mixed["why"] and "temperature 0.0" in mixed["why"]
    assert "num_speculative_tokens_per_batch_size" not in measured_serving_config(
        base, [level(1, 1.2), level(8, 1.1)], "plain")["speculative_config"]
    lost = measured_serving_config(base, [level(1, 0.9)], "vLLM ngram")
    assert lost["speculative_config"] == {} and "serve without it" in lost["why"] and "ngram" in lost["why"]


def test_the_export_readme_carries_the_measured_serving_config(tiny_target, tmp_path):
    """`export --serving-config report.json`: the README holds bench's speculative_config; a report of another
    kind, or none, is refused before anything is written."""
    import json

    from draftsmith.eval.bench_vllm import measured_serving_config
    from draftsmith.export import export
    from draftsmith.heads.drafter import save_drafter
    from draftsmith.heads.formats import ExportError
    from draftsmith.heads.p_eagle import PEagle, PEagleConfig

    save_drafter(PEagle(PEagleConfig(draft_vocab_size=40, layer_ids=[0, 1, 2]), tiny_target), tmp_path / "ckpt")
    levels = [{"temperature": 0.0, "concurrency": c, "groups": {"all": {"speedup": s}}} for c, s in ((1, 1.2), (8, 0.9))]
    chosen = measured_serving_config({"method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": True},
                                     levels, "plain")
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"kind": "p_eagle", "checkpoint": str(tmp_path / "ckpt"), "serving_config": chosen}))
    out = export(tmp_path / "ckpt", "vllm", tmp_path / "vllm", dtype="float32", serving_report=report)
    readme = (out / "README.md").read_text()
    assert "## Serving config measured by draftsmith bench" in readme
    assert '"num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 8, 0]]' in readme and '"model": "THIS_DIR"' in readme
    report.write_text(json.dumps({"kind": "eagle3", "serving_config": chosen}))
    with pytest.raises(ExportError, match="measured a eagle3 drafter, not this p_eagle checkpoint"):
        export(tmp_path / "ckpt", "vllm", tmp_path / "other", dtype="float32", serving_report=report)
    report.write_text(json.dumps({"kind": "p_eagle"}))
    with pytest.raises(ExportError, match="holds no measured serving_config"):
        export(tmp_path / "ckpt", "vllm", tmp_path / "other", dtype="float32", serving_report=report)
    assert not (tmp_path / "other").exists()


def test_acceptance_by_context_length_counts_each_step_where_its_context_is():
    """A step's context is the prompt plus every token emitted before it (hand-computed buckets)."""
    from draftsmith.heads.decoding.metrics import acceptance_by_context
    runs = [(1020, [2, 1, 3]),      # contexts 1020, 1023 (0-1k), 1025 (1k-2k)
            (2047, [1, 0]),         # 2047 (1k-2k), 2049 (2k-4k)
            (9000, [0])]            # 8k+
    buckets = acceptance_by_context(runs, 3)
    assert [(b["context"], b["steps"], b["tau"]) for b in buckets] == [
        ("0-1k", 2, 2.5), ("1k-2k", 2, 3.0), ("2k-4k", 1, 1.0), ("8k+", 1, 1.0)]
    assert buckets[0]["per_position_acceptance"] == [1.0, 0.5, 0.0]
    assert buckets[1]["per_position_acceptance"] == [1.0, 0.5, 0.5]


def test_the_serving_sweep_records_each_requests_prompt_length():
    """vLLM's sweep keeps the prompt's length beside each run, as draftsmith's engine does: the traffic's
    own context (docs/bench.md, `--cost-context`) is read from it."""
    from draftsmith.eval.bench_settings import BenchSettings
    from draftsmith.eval.bench_vllm import sweep_levels
    from draftsmith.eval.traffic import Request, Traffic

    traffic = Traffic([Request("a", "writing", [1] * 7, 4), Request("b", "coding", [1] * 30, 4)], {})

    def serve(mode, requests, concurrency, temperature, seed):
        return {"runs": [{"id": r["id"], "seconds": 1.0, "first_token_seconds": 0.1, "tokens": [5, 6]}
                         for r in requests], "wall": 1.0, "metrics": {}}

    swept = sweep_levels(serve, traffic, BenchSettings(engine="vllm", concurrency=(1, 2), repeats=1))
    assert len(swept["runs"]) == 8
    assert {(r.request, r.prompt_tokens) for r in swept["runs"]} == {("a", 7), ("b", 30)}
