"""`draftsmith bench`: speculation on and off, per category of the user's traffic, with a verdict.

Like cli.py, each verb imports what it runs inside its function (see cli.py)."""
from __future__ import annotations

import signal
import time
from pathlib import Path


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the verb itself says about what was kept."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _terminated(signum, frame):
    """SIGTERM during bench: handled as Ctrl-C, so what was measured is kept in a report marked incomplete."""
    raise KeyboardInterrupt


def cmd_bench(args) -> dict:
    """Speculation on and off, per category of the traffic, with a verdict and a report."""
    from draftsmith.eval.bench import BenchError, BenchSettings, bench
    from draftsmith.eval.bench_report import markdown

    if args.predict or args.break_even:
        return cmd_predict(args)
    try:
        concurrency = tuple(int(c) for part in args.concurrency for c in part.split(",") if c.strip())
    except ValueError:
        raise BenchError(f"--concurrency takes whole numbers, e.g. 1,4,16; got {' '.join(args.concurrency)}") from None
    engine = args.engine or ("endpoint" if args.endpoint or args.baseline_endpoint else "draftsmith")
    settings = BenchSettings(traffic=",".join(args.prompts), limit=args.limit, max_new_tokens=args.max_new_tokens,
                             temperatures=tuple(args.temperature), repeats=args.repeats,
                             cost_per_hour=args.cost_per_hour, seed=args.seed, dtype=args.dtype,
                             device=args.device, target=args.target, adapter=args.adapter, engine=engine, concurrency=concurrency,
                             vllm_python=args.vllm_python, num_speculative_tokens=args.num_speculative_tokens,
                             chain=args.chain,
                             endpoint=args.endpoint, baseline_endpoint=args.baseline_endpoint, lookup=args.lookup,
                             against=args.against, long_prompts=args.long_prompts)
    out = Path(args.out)
    from draftsmith.heads.infra.outputs import guard_output
    if args.checkpoint != "ngram":
        guard_output(out, "bench", "bench report", sources=[args.checkpoint], overwrite=True, foreign_ok=True)
    started = time.time()
    previous = signal.signal(signal.SIGTERM, _terminated)      # a kill (a scheduler's, a timeout's) as Ctrl-C
    try:
        report = bench(args.checkpoint, settings, out)
    except KeyboardInterrupt:
        written = (out / "report.md").is_file() and (out / "report.md").stat().st_mtime >= started
        raise Interrupted(f"interrupted: what was measured is in {out / 'report.md'} (marked incomplete)" if written
                          else "interrupted before anything was measured: no report was written") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(markdown(report))
    print(f"wrote {out / 'report.md'}, {out / 'report.html'} and {out / 'report.json'}")
    return report


def cmd_predict(args) -> dict:
    """`bench CKPT --predict` and `bench TARGET --break-even`: from measured step costs, no traffic served."""
    from draftsmith.eval import predict
    from draftsmith.eval.bench import BenchError

    if args.predict and args.break_even:
        raise BenchError("--predict takes a checkpoint and --break-even a target: give one of them")
    try:
        batches = tuple(sorted({int(part) for part in args.batch_sizes.split(",") if part.strip()}))
    except ValueError:
        raise BenchError(f"--batch-sizes takes whole numbers, e.g. 1,4,16; got {args.batch_sizes}") from None
    if not batches or min(batches) < 1:
        raise BenchError(f"--batch-sizes takes whole numbers of 1 or more, e.g. 1,4,16; got {args.batch_sizes}")
    if args.max_k < 1:
        raise BenchError(f"--max-k is the largest K priced, 1 or more; got {args.max_k}")
    ks = tuple(range(args.max_k + 1))
    out = Path(args.out)
    if args.predict:
        report = predict.predict_report(args.checkpoint, out, args.dtype, args.device, args.target, batches, ks,
                                        args.refresh_costs, args.engine or "draftsmith", args.vllm_python,
                                        args.cost_context)
        name = "predict"
    else:
        if (args.engine or "draftsmith") != "draftsmith":
            raise BenchError("--break-even prices steps in draftsmith's engine only (vLLM needs a drafter to export: "
                             "train one for a few steps and use --predict --engine vllm)")
        report = predict.break_even_report(args.checkpoint, out, args.kind, args.dtype, args.device, batches, ks,
                                           args.refresh_costs, args.cost_context)
        name = "break-even"
    print(predict.markdown(report))
    print(f"wrote {out / (name + '.md')}, {out / (name + '.json')} and {out / (name + '.png')}")
    return report


def add_bench_parser(sub) -> None:
    """`draftsmith bench`'s flags."""
    p = sub.add_parser("bench", help="speculation on or off? measured per category of your traffic, with a verdict",
                       description="Every request runs with and without the drafter, interleaved, --repeats times; "
                                   "the report (md, html with plots, json) gives TTFT, total time, tokens/s, cost, "
                                   "acceptance and a verdict per category.")
    p.add_argument("checkpoint", help="a trained checkpoint, or 'ngram' (with --engine vllm --target MODEL): "
                   "vLLM's prompt-lookup speculation, which needs no training; with --break-even: a target")
    p.add_argument("--predict", action="store_true", help="predict the speedup at each batch size and K from the "
                   "checkpoint's acceptance profile and step costs measured here (no traffic served); choose K per "
                   "batch size and write vLLM's speculative_config (docs/bench.md, \"Prediction\")")
    p.add_argument("--break-even", action="store_true", help="for a target, no drafter yet: the acceptance a drafter "
                   "(--kind) would need at each batch size and K for speculation to pay")
    p.add_argument("--kind", default="eagle3", help="--break-even: the drafter kind whose step cost is measured "
                   "(untrained, recipe defaults; default eagle3)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="--predict/--break-even: batch sizes priced")
    p.add_argument("--max-k", type=int, default=8, help="--predict/--break-even: the largest K priced (clamped to "
                   "the drafter's depth, and said)")
    p.add_argument("--cost-context", type=int, default=None, help="--predict/--break-even: the cached tokens each "
                   "step is timed after; the length your requests hold while they decode (default: a typical chat's, "
                   "docs/bench.md)")
    p.add_argument("--refresh-costs", action="store_true", help="measure the step costs again even where this "
                   "machine's are kept")
    p.add_argument("--prompts", nargs="+", default=["mt-bench"], help="mt-bench (default), humaneval, or "
                   "FILE.jsonl (chats or prompts; optional 'category' and 'max_tokens' per line); several make one "
                   "sample, e.g. --prompts mt-bench humaneval")
    p.add_argument("--limit", type=int, default=5, help="requests per category, sampled with --seed (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request unless a line says")
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="one or more (default 0: greedy)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cost-per-hour", type=float, default=None, help="machine price per hour, for cost per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--target", default=None, help="target path (default: the one the checkpoint names)")
    p.add_argument("--adapter", default=None, help="LoRA adapter on the target (default: the checkpoint's; none: bare)")
    p.add_argument("--out", default="bench", help="report directory (default ./bench)")
    p.add_argument("--engine", default=None, help="draftsmith (default: its verifier, batch 1), vllm (your serving "
                   "stack: the checkpoint is exported and served with and without the drafter), or endpoint "
                   "(running servers; implied by --endpoint); with --predict: whose step costs price the prediction, "
                   "draftsmith (default) or vllm (whole steps timed in vLLM)")
    p.add_argument("--endpoint", default=None, help="a running OpenAI-compatible server (e.g. vllm serve) with the "
                   "drafter, measured by streaming; needs --baseline-endpoint")
    p.add_argument("--baseline-endpoint", default=None, help="the same target served without the drafter")
    p.add_argument("--concurrency", nargs="+", default=["1"], help="requests in flight, e.g. 1,4,16 (vllm engine)")
    p.add_argument("--vllm-python", default=None, help="the vLLM environment's python (default: "
                   "$DRAFTSMITH_VLLM_PYTHON, else ./.venv-vllm/bin/python)")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="draft tokens per step (vllm engine)")
    p.add_argument("--chain", type=int, default=None, metavar="K", help="draftsmith engine: propose a chain of K "
                   "drafts (default: the drafter's own proposal, a tuned tree where it has one)")
    p.add_argument("--lookup", type=int, default=0, metavar="K", help="draftsmith engine: also propose K tokens "
                   "copied from the context, merged into the drafter's tree (default 0: off)")
    p.add_argument("--long-prompts", default="truncate", choices=["truncate", "refuse"], help="a request that, "
                   "with its new tokens, does not fit the target's context: keep its last tokens, with a warning "
                   "(default), or stop with an error")
    p.add_argument("--against", default="plain", choices=["plain", "ngram"], help="vllm engine: what the drafter is "
                   "timed against, interleaved: plain decoding (default) or vLLM's ngram speculation (the free "
                   "drafter, with --num-speculative-tokens and prompt_lookup_max 3)")
