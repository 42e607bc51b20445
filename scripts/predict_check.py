"""Predicted against measured speedup, in draftsmith's engine and in vLLM: is `bench --predict` right?

    python scripts/predict_check.py OUT CHECKPOINT [CHECKPOINT ...] [--ks 1,2,4] [--prompts mt-bench]
        [--limit 2] [--max-new-tokens 96] [--repeats 2] [--dtype auto] [--engines draftsmith,vllm]
        [--batch-sizes 1,4] [--cost-context N] [--vllm-python PY]

For each checkpoint and each engine of --engines, one after the other in one run:
1. `bench CHECKPOINT --predict --engine E`: S(b, K) from its acceptance profile and the step costs
   measured in that engine (eval/predict.py; in vLLM whole steps, eval/predict_vllm.py), at batch 1 in
   draftsmith's engine and at each of --batch-sizes in vLLM (kept per machine: a second run measures
   nothing);
2. for each K: `bench CHECKPOINT --chain K` in draftsmith's engine, `bench CHECKPOINT --engine vllm
   --num-speculative-tokens K --concurrency B` in vLLM: plain and speculative serving of the same
   requests, interleaved, `--repeats` times (eval/bench.py).
Then, per K, three figures and where they part:
- predicted: the profile's E(K) over the costs;
- predicted from bench's own acceptance: bench's tau over the same costs. The gap between the two is
  acceptance drift (the profile's prompts against bench's);
- measured: the ratio of decoding rates, time to first token left out (the model prices decoding
  steps; a prefill is the same in both modes), and beside it the whole-request ratio bench reports.
  The gap between "predicted from bench's acceptance" and "measured" is the cost model's own error
  (step cost at the real contexts, the engine's work between forwards).
Writes OUT/predict_check.json and prints the table.  A benchmark, not a test: time it with nothing
else running."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def decode_rate_ratio(runs: list[dict], concurrency: int | None = None) -> float | None:
    """Speculative over plain decoding rate (tokens after the first, per second after the first token),
    pooled over the (request, repeat) pairs both modes finished (at one concurrency, where given)."""
    by = {(r["request"], r["repeat"], r["mode"]): r for r in runs
          if concurrency is None or r.get("concurrency", 1) == concurrency}
    plain_tokens = plain_seconds = spec_tokens = spec_seconds = 0.0
    for (request, repeat, mode), run in by.items():
        other = by.get((request, repeat, "speculative"))
        if mode != "plain" or other is None:
            continue
        plain_tokens += len(run["tokens"]) - 1
        plain_seconds += run["seconds"] - run["first_token_seconds"]
        spec_tokens += len(other["tokens"]) - 1
        spec_seconds += other["seconds"] - other["first_token_seconds"]
    if not plain_seconds or not spec_seconds or not plain_tokens:
        return None
    return (spec_tokens / spec_seconds) / (plain_tokens / plain_seconds)


def row(predicted: dict, engine: str, b: int, k: int, level: dict, runs: list[dict]) -> dict:
    """Predicted against measured at one (engine, b, K)."""
    costs = predicted["costs"]
    verify, draft = costs["verify_ms"][b], costs["draft_ms"][b]
    overall = level["groups"]["all"]
    step_ms = verify[k] + draft[k]
    from_bench = overall["tau"] * verify[0] / step_ms if overall["tau"] else None
    measured = decode_rate_ratio(runs, b if engine == "vllm" else None)
    batch = [overall[mode].get("tokens_per_s_batch") for mode in ("plain", "speculative")]
    return {"checkpoint": predicted["checkpoint"], "kind": predicted["kind"], "engine": engine, "batch": b, "k": k,
            "profile_source": predicted["profile"]["source"],
            "predicted": predicted["speedup"][b][k], "predicted_from_bench_acceptance": from_bench,
            "measured_decoding": measured, "measured_whole_request": overall["speedup"],
            "measured_interval": overall["speedup_interval"],
            "measured_batch_throughput": batch[1] / batch[0] if all(batch) else None,
            "bench_tau": overall["tau"], "profile_tau": 1 + sum(predicted["profile"]["unconditional"][:k]),
            "step_ms": {"step_k": verify[k], "step_0": verify[0], "draft": draft[k]},
            "error": predicted["speedup"][b][k] / measured - 1 if measured else None,
            "cost_model_error": from_bench / measured - 1 if measured and from_bench else None}


def check(checkpoint: str, out: Path, ks: list[int], args) -> list[dict]:
    """Both stacks for one checkpoint: draftsmith's engine at batch 1, vLLM at each of --batch-sizes."""
    from draftsmith.eval.bench import bench
    from draftsmith.eval.bench_settings import BenchSettings
    from draftsmith.eval.predict import predict_report

    rows = []
    for engine in args.engines:
        batches = (1,) if engine == "draftsmith" else tuple(args.batch_sizes)
        predicted = predict_report(checkpoint, out / f"predict-{engine}", args.dtype, "auto", None, batches,
                                   tuple(range(max(ks) + 1)), engine=engine, vllm_python=args.vllm_python,
                                   context=args.cost_context)
        for k in ks:
            if k not in predicted["speedup"][min(batches)]:
                print(f"{checkpoint}: K={k} not priced ({'; '.join(predicted['profile']['notes'])})", file=sys.stderr)
                continue
            settings = BenchSettings(traffic=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens,
                                     repeats=args.repeats, dtype=args.dtype, engine=engine, concurrency=batches,
                                     vllm_python=args.vllm_python, num_speculative_tokens=k,
                                     chain=k if engine == "draftsmith" else None)
            report = bench(checkpoint, settings, out / f"bench-{engine}-k{k}", show_progress=False)
            for level in report["results"]:
                if "all" in level["groups"]:
                    rows.append(row(predicted, engine, level["concurrency"], k, level, report["runs"]))
    return rows


def table(rows: list[dict]) -> str:
    def pct(x):
        return "" if x is None else f"{x:+.0%}"

    def times(x):
        return "" if x is None else f"{x:.2f}x"

    lines = ["| drafter | stack | batch | K | E(K) profile / bench tau | predicted | predicted from bench's tau "
             "| measured (decoding) | measured (whole request, 90% interval) | measured (batch tokens/s) | error "
             "| of it, the cost model |",
             "|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        low, high = r["measured_interval"]
        tau = "" if r["bench_tau"] is None else f"{r['bench_tau']:.2f}"
        lines.append(f"| {r['kind']} | {r['engine']} | {r['batch']} | {r['k']} | {r['profile_tau']:.2f} / {tau} "
                     f"| {times(r['predicted'])} | {times(r['predicted_from_bench_acceptance'])} "
                     f"| {times(r['measured_decoding'])} | {r['measured_whole_request']:.2f}x [{low:.2f}, {high:.2f}] "
                     f"| {times(r['measured_batch_throughput'])} | {pct(r['error'])} | {pct(r['cost_model_error'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--engines", default="draftsmith", help="draftsmith, vllm, or draftsmith,vllm (one run)")
    parser.add_argument("--batch-sizes", default="1,4", help="vllm: the concurrency levels checked")
    parser.add_argument("--cost-context", type=int, default=None, help="the cached tokens each step is timed after "
                        "(default: bench --predict's)")
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    ks = sorted({int(k) for k in args.ks.split(",")})
    out = Path(args.out)
    rows = []
    out.mkdir(parents=True, exist_ok=True)
    for i, checkpoint in enumerate(args.checkpoints):
        rows += check(checkpoint, out / f"{i}-{Path(checkpoint).parent.name or 'checkpoint'}", ks, args)
        (out / "predict_check.json").write_text(json.dumps(rows, indent=1))       # kept drafter by drafter
    print(table(rows))
    for source in sorted({r["profile_source"] for r in rows}):
        print(f"profile: {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
