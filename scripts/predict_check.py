"""Predicted against measured speedup, at batch 1 in draftsmith's engine: is `bench --predict` right?

    python scripts/predict_check.py OUT CHECKPOINT [CHECKPOINT ...] [--ks 1,2,4] [--prompts mt-bench]
        [--limit 2] [--max-new-tokens 96] [--repeats 2] [--dtype auto]

For each checkpoint:
1. `bench CHECKPOINT --predict` at batch 1 (eval/predict.py): S(1, K) from its acceptance profile and
   the step costs measured here (kept per machine: a second run measures nothing);
2. `bench CHECKPOINT --chain K` for each K: plain and speculative decoding of the same requests,
   interleaved request by request, `--repeats` times (eval/bench.py).
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


def decode_rate_ratio(runs: list[dict]) -> float | None:
    """Speculative over plain decoding rate (tokens after the first, per second after the first token),
    pooled over the (request, repeat) pairs both modes finished."""
    by = {(r["request"], r["repeat"], r["mode"]): r for r in runs}
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


def check(checkpoint: str, out: Path, ks: list[int], args) -> list[dict]:
    from draftsmith.eval.bench import bench
    from draftsmith.eval.bench_settings import BenchSettings
    from draftsmith.eval.predict import predict_report

    predicted = predict_report(checkpoint, out / "predict", args.dtype, "auto", None, (1,), tuple(range(max(ks) + 1)))
    costs = predicted["costs"]
    verify, draft = costs["verify_ms"][1], costs["draft_ms"][1]
    rows = []
    for k in ks:
        if k not in predicted["speedup"][1]:
            print(f"{checkpoint}: K={k} not priced ({'; '.join(predicted['profile']['notes'])})", file=sys.stderr)
            continue
        settings = BenchSettings(traffic=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens,
                                 repeats=args.repeats, dtype=args.dtype, chain=k)
        report = bench(checkpoint, settings, out / f"bench-k{k}", show_progress=False)
        overall = report["results"][0]["groups"]["all"]
        step_ms = verify[k] + draft[k]
        from_bench = overall["tau"] * verify[0] / step_ms if overall["tau"] else None
        measured = decode_rate_ratio(report["runs"])
        rows.append({"checkpoint": checkpoint, "kind": predicted["kind"], "k": k,
                     "profile_source": predicted["profile"]["source"],
                     "predicted": predicted["speedup"][1][k], "predicted_from_bench_acceptance": from_bench,
                     "measured_decoding": measured, "measured_whole_request": overall["speedup"],
                     "measured_interval": overall["speedup_interval"], "bench_tau": overall["tau"],
                     "profile_tau": 1 + sum(predicted["profile"]["unconditional"][:k]),
                     "step_ms": {"verify_k": verify[k], "verify_0": verify[0], "draft": draft[k]},
                     "error": predicted["speedup"][1][k] / measured - 1 if measured else None,
                     "cost_model_error": from_bench / measured - 1 if measured and from_bench else None})
    return rows


def table(rows: list[dict]) -> str:
    def pct(x):
        return "" if x is None else f"{x:+.0%}"

    lines = ["| drafter | K | E(K) profile / bench tau | predicted | predicted from bench's tau | measured (decoding) "
             "| measured (whole request, 90% interval) | error | of it, the cost model |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r["measured_interval"]
        lines.append(f"| {r['kind']} | {r['k']} | {r['profile_tau']:.2f} / {r['bench_tau']:.2f} | {r['predicted']:.2f}x "
                     f"| {r['predicted_from_bench_acceptance']:.2f}x | {r['measured_decoding']:.2f}x | "
                     f"{r['measured_whole_request']:.2f}x [{low:.2f}, {high:.2f}] | {pct(r['error'])} | "
                     f"{pct(r['cost_model_error'])} |")
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
    args = parser.parse_args(argv)
    ks = sorted({int(k) for k in args.ks.split(",")})
    out = Path(args.out)
    rows = []
    for i, checkpoint in enumerate(args.checkpoints):
        rows += check(checkpoint, out / f"{i}-{Path(checkpoint).parent.name or 'checkpoint'}", ks, args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predict_check.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    for source in sorted({r["profile_source"] for r in rows}):
        print(f"profile: {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
