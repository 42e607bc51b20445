"""`draftsmith bench`: should speculation be switched on for this traffic? Measured, per category.

The traffic is a seeded sample of requests (eval/traffic.py). Every request runs with and without
the drafter, interleaved, `repeats` times (the order alternates between repeats, so a slow spell of
the machine lands on both modes), at each temperature and load level asked for. The engines:
draftsmith's verifier at batch 1 (here), vLLM's offline engine (eval/bench_vllm.py) and running
OpenAI-compatible servers (eval/bench_endpoint.py).

Per category and temperature the report gives, before and after: time to first token and total time
(p50, p90), output tokens/s per request and for the whole sample, cost per request, tau and
per-position acceptance, and for greedy runs whether the text was identical. The speedup is the
one of docs/metrics.md: plain seconds per generated token / speculative seconds per generated token,
over the group's runs (sampled replies differ in length between the modes); its interval comes from
a seeded bootstrap over the (request, repeat) pairs. The verdict: *switch on* when the whole interval is above 1, *switch off*
when it is below 1, else *no measurable gain*.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.data.health import of_outputs
from draftsmith.heads.decoding import metrics
from draftsmith.heads.decoding.settings import EvalSettings
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import checkpoint_target, load_drafter, read_config
from draftsmith.heads.drafter import target_path as checkpoint_target_path
from draftsmith.heads.infra.device import resolve_device
from draftsmith.heads.infra.files import keep_report, require_writable
from draftsmith.heads.runtime.target import resolve_dtype

from .bench_endpoint import run_endpoint
from .bench_report import markdown, write_reports
from .bench_settings import NGRAM, BenchError, BenchSettings, Run
from .bench_vllm import measured_serving_config, run_vllm
from .proposal import configure_proposal
from .intervals import INTERVAL, MIN_PAIRS, pooled_speedup, quantile, speedup_interval, verdict  # noqa: F401
from .traffic import Traffic, load_traffic

log = logging.getLogger(__name__)

def summarize_group(runs: list[Run], cost_per_hour: float | None, positions: int, seed: int) -> dict:
    """Every number of one (category, temperature) group; `runs` holds both modes."""
    by_mode = {m: [r for r in runs if r.mode == m] for m in ("plain", "speculative")}
    out: dict = {"requests": len({r.request for r in runs}), "runs_per_mode": len(by_mode["plain"])}
    for mode, rs in by_mode.items():
        seconds = [r.seconds for r in rs]
        tokens = [len(r.tokens) for r in rs]
        out[mode] = {
            "ttft_p50_s": quantile([r.first_token_seconds for r in rs], 0.5),
            "ttft_p90_s": quantile([r.first_token_seconds for r in rs], 0.9),
            "total_p50_s": quantile(seconds, 0.5),
            "total_p90_s": quantile(seconds, 0.9),
            "tokens_per_s_per_request": sum(t / s for t, s in zip(tokens, seconds)) / len(rs),
            "tokens_per_s_sample": sum(tokens) / sum(seconds),
            "mean_output_tokens": sum(tokens) / len(rs),
        }
        if cost_per_hour:
            out[mode]["cost_per_request"] = cost_per_hour / 3600 * sum(seconds) / len(rs)
    spec = {(r.request, r.repeat): r for r in by_mode["speculative"]}
    pairs, repeats = [], []
    for p in by_mode["plain"]:
        if (p.request, p.repeat) in spec:
            s = spec[(p.request, p.repeat)]
            pairs.append((p.seconds, len(p.tokens), s.seconds, len(s.tokens)))
            repeats.append(p.repeat)
    accepted = [a for r in by_mode["speculative"] for a in r.accepted]
    low, high = speedup_interval(pairs, seed)
    out.update({
        "speedup": pooled_speedup(pairs),
        "speedup_interval": [low, high],
        "speedup_by_repeat": [pooled_speedup([p for p, k in zip(pairs, repeats) if k == repeat])
                              for repeat in sorted(set(repeats))],
        "tau": metrics.tau(accepted),
        "per_position_acceptance": metrics.per_position_acceptance(accepted, positions),
        "acceptance_by_context": metrics.acceptance_by_context(
            [(r.prompt_tokens, r.accepted) for r in by_mode["speculative"]], positions),
        "verdict": verdict(low, high, len(pairs)),
    })
    if runs and runs[0].temperature <= 0:
        plain_tokens = {(r.request, r.repeat): r.tokens for r in by_mode["plain"]}
        same = [plain_tokens[k] == r.tokens for k, r in spec.items() if k in plain_tokens]
        out["identical_text"] = sum(same) / len(same) if same else None
    return out


def sweep(target, drafter, traffic: Traffic, settings: BenchSettings, progress=None) -> tuple[list[Run], bool]:
    """Every request, both modes, every temperature and repeat. Returns (runs, complete): Ctrl-C stops
    the sweep, keeping every request whose two modes both finished in the interrupted repeat."""
    runs: list[Run] = []
    try:
        for repeat in range(settings.repeats):
            for temperature in settings.temperatures:
                for index, request in enumerate(traffic.requests):
                    order = ("plain", "speculative") if (repeat + index) % 2 == 0 else ("speculative", "plain")
                    pair = []
                    for mode in order:
                        seed = settings.seed + 1000 * repeat + index
                        gen = torch.Generator(device=target.device).manual_seed(seed)
                        result = decode(target, request.prompt, request.max_tokens,
                                        drafter if mode == "speculative" else None, temperature, generator=gen)
                        pair.append(Run(request.id, request.category, temperature, repeat, mode, result.seconds,
                                        result.first_token_seconds, result.tokens, result.accepted,
                                        prompt_tokens=len(request.prompt)))
                        if progress is not None:
                            progress.update(1)
                    runs.extend(pair)
    except KeyboardInterrupt:
        return runs, False
    return runs, True


def summarize(runs: list[Run], settings: BenchSettings, positions: int, counters: dict | None = None) -> list[dict]:
    """One entry per (temperature, concurrency): {temperature, concurrency, groups: {category and 'all'}}.

    counters: {(temperature, concurrency): (tau, per-position acceptance)} from a serving engine, which
    counts acceptance per load level, not per request; they replace the 'all' group's figures."""
    results = []
    for temperature in settings.temperatures:
        for concurrency in settings.concurrency:
            level = [r for r in runs if r.temperature == temperature and r.concurrency == concurrency]
            groups = {}
            for category in sorted({r.category for r in level}):
                in_group = [r for r in level if r.category == category]
                if {"plain", "speculative"} <= {r.mode for r in in_group}:
                    groups[category] = summarize_group(in_group, settings.cost_per_hour, positions, settings.seed)
            if groups:
                groups["all"] = summarize_group(level, settings.cost_per_hour, positions, settings.seed)
                if counters is not None:
                    for name, group in groups.items():
                        group["tau"], group["per_position_acceptance"] = (
                            counters.get((temperature, concurrency), (None, [])) if name == "all" else (None, []))
            results.append({"temperature": temperature, "concurrency": concurrency, "groups": groups})
    return results


def recommendation(results: list[dict]) -> str:
    """One line per temperature: the verdict at each load level, and where speculation stops paying."""
    lines = []
    for temperature in dict.fromkeys(r["temperature"] for r in results):
        levels = [r for r in results if r["temperature"] == temperature and "all" in r["groups"]]
        if not levels:
            continue
        parts = []
        for level in levels:
            groups = level["groups"]
            on = [c for c, g in groups.items() if c != "all" and g["verdict"].startswith("switch on")]
            off = [c for c, g in groups.items() if c != "all" and g["verdict"].startswith("switch off")]
            parts.append(f"concurrency {level['concurrency']}: {groups['all']['verdict'].split(':')[0]} overall "
                         f"({groups['all']['speedup']:.2f}x)" + (f", on for {', '.join(on)}" if on else "")
                         + (f", off for {', '.join(off)}" if off else ""))
        stop = next((lv["concurrency"] for lv in levels
                     if not lv["groups"]["all"]["verdict"].startswith("switch on")), None)
        if len(levels) == 1:
            tail = ""
        elif stop is None:
            tail = "; it pays at every load level measured"
        elif stop == levels[0]["concurrency"]:
            tail = "; it pays at none of the load levels measured"
        else:
            tail = f"; speculation stops paying at concurrency {stop}"
        lines.append(f"temperature {temperature:g}: " + "; ".join(parts) + tail)
    return " | ".join(lines) if lines else "nothing measured"


def require_serving_k(config: dict, k: int) -> None:
    """A drafter whose block fixes the served K (DSpark) is refused at any other --num-speculative-tokens."""
    from draftsmith.heads.formats import formats_of

    served_as = formats_of(config["kind"]).get("vllm")
    fixed = served_as.serving_k(config) if served_as is not None and served_as.serving_k else None
    if fixed is not None and k != fixed:
        raise BenchError(f"--num-speculative-tokens {k} does not match this {config['kind']} drafter's block: it was "
                         f"trained to draft {fixed} tokens a block (block_size {config['drafter']['block_size']}), and a "
                         f"stack given another K drafts a different block; give --num-speculative-tokens {fixed}")


def bench(checkpoint: str, settings: BenchSettings, out_dir: str | Path, show_progress: bool = True) -> dict:
    """Load, sweep, summarise, write report.json / report.md / report.html (+ PNG plots) to out_dir."""


    if str(checkpoint) == NGRAM:
        if settings.engine != "vllm" or not settings.target:
            raise BenchError("'ngram' is vLLM's own prompt-lookup speculation, with nothing trained: bench it with "
                             "--engine vllm --target MODEL (the model to serve)")
        config = {"kind": NGRAM}
        if settings.against == NGRAM:
            raise BenchError("'ngram' against --against ngram would time vLLM's prompt lookup against itself: give a "
                             "trained checkpoint, or drop --against")
    else:
        config = read_config(checkpoint)     # a damaged or missing checkpoint is named before anything loads
        if settings.engine == "vllm":
            require_serving_k(config, settings.num_speculative_tokens)
    out_dir = Path(out_dir).expanduser()
    require_writable(out_dir.resolve(), "--out")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    target_path = checkpoint_target_path(config, settings.target)
    if settings.engine != "draftsmith" and (settings.adapter or config.get("target_adapter")):
        raise BenchError(f"the target has a LoRA adapter ({settings.adapter or config['target_adapter']}): "
                         f"--engine {settings.engine} would serve the bare base without it; bench this drafter with "
                         "--engine draftsmith")
    progress = _progress_bar if show_progress else None      # made once the number of requests is known
    if settings.engine == "vllm":
        measured = run_vllm(checkpoint, config, target_path, settings, out_dir, progress)
    elif settings.engine == "endpoint":
        measured = run_endpoint(checkpoint, config, target_path, settings, out_dir, progress)
    else:
        measured = run_draftsmith(checkpoint, target_path, settings, progress)
    runs, traffic = measured["runs"], measured["traffic"]
    positions = max((max(r.accepted) for r in runs if r.accepted), default=0) or 1
    results = summarize(runs, settings, positions, measured.get("acceptance"))
    for level in results:
        for mode in ("plain", "speculative"):
            rate = measured.get("batch_tokens_per_s", {}).get((level["temperature"], level["concurrency"], mode))
            if rate is not None and "all" in level["groups"]:
                level["groups"]["all"][mode]["tokens_per_s_batch"] = rate
    target_health = of_outputs([r.tokens for r in runs if r.mode == "plain" and r.repeat == 0 and r.concurrency ==
                                settings.concurrency[0]], settings.max_new_tokens)
    report = {
        "target_health": target_health,
        "checkpoint": str(checkpoint), "kind": config.get("kind"), "target": str(target_path), "device": measured["device"],
        "dtype": measured["dtype"], "proposal": measured["proposal"], "engine": measured["engine"],
        "baseline": measured.get("baseline", "plain"),
        "concurrency": list(settings.concurrency), "settings": dataclasses.asdict(settings),
        "complete": measured["complete"],
        "traffic": {"source": settings.traffic, "available": traffic.available,
                    "sampled": {c: sum(r.category == c for r in traffic.requests) for c in traffic.available},
                    "skipped_without_prompt": traffic.skipped_without_prompt},
        "results": results, "recommendation": (recommendation(results) if settings.against == "plain" else
                                               f"the drafter against {measured['baseline']} (switch on: the "
                                               f"drafter is faster): {recommendation(results)}"),
        "interval": f"{round((INTERVAL[1] - INTERVAL[0]) * 100)}% bootstrap over (request, repeat) pairs",
        **({"serving_config": measured_serving_config(measured["speculative_config"], results,
                                                      measured.get("baseline", "plain"))}
           if "speculative_config" in measured else {}),
        "seconds": time.time() - started,
        "runs": [dataclasses.asdict(r) for r in runs],
    }
    keep_report(lambda where: write_reports(report, where), out_dir, "the bench report", lambda: markdown(report))
    if not measured["complete"]:
        raise KeyboardInterrupt
    return report


def _progress_bar(total: int):
    return tqdm(total=total, desc="bench", unit="request")


def run_draftsmith(checkpoint: str, target_path: str, settings: BenchSettings, progress=None) -> dict:
    """draftsmith's verifier at batch 1: load the target and drafter here, warm up, sweep."""


    device = resolve_device(settings.device)
    target = checkpoint_target(read_config(checkpoint), resolve_dtype(settings.dtype, device), device, target_path,
                               settings.adapter)
    drafter = load_drafter(checkpoint, target).to(target.dtype)
    drafter = configure_proposal(drafter, target, EvalSettings(
        device=str(device), lookup=settings.lookup, proposal="chain" if settings.chain else "default",
        chain_length=settings.chain))
    proposal = drafter.describe_proposal()
    traffic = load_traffic(target.tokenizer, settings.traffic, settings.limit, settings.seed, settings.max_new_tokens,
                           target.context_length, settings.long_prompts)
    decode(target, traffic.requests[0].prompt, 8)                   # warm-up: both modes once, untimed
    decode(target, traffic.requests[0].prompt, 8, drafter)
    bar = progress(2 * len(traffic.requests) * settings.repeats * len(settings.temperatures)) if progress else None
    runs, complete = sweep(target, drafter, traffic, settings, bar)
    if bar is not None:
        bar.close()
    return {"runs": runs, "complete": complete, "traffic": traffic, "device": str(device), "dtype": target.precision,
            "proposal": proposal, "engine": "draftsmith (batch 1)"}
