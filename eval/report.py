"""Reports: the markdown table on screen and the JSON on disk."""
from __future__ import annotations

import json
from pathlib import Path

from draftsmith.data.health import eval_line
from draftsmith.heads.infra.files import write_atomic

from .benchmark import EvalReport

MODE_NAMES = {"plain": "plain decoding (draftsmith engine)", "speculative": "speculative (draftsmith)",
              "generate": "transformers generate", "prompt-lookup": "transformers prompt-lookup"}


def markdown(report: EvalReport) -> str:
    lines = [
        f"### {report.kind} drafter on {report.target}: {report.prompts} {report.prompts_source} prompts, "
        f"{report.max_new_tokens} new tokens, {report.dtype}, "
        f"{'greedy' if report.temperature <= 0 else f'temperature {report.temperature}'}, {report.proposal}, "
        f"on {report.device} (warm-up: {report.warmup})",
        "",
        "| decoding | tokens/s | s/request | time to first token | speedup of speculative |",
        "|---|---:|---:|---:|---:|",
    ]
    spec_rate = report.tokens_per_second["speculative"]
    for mode, rate in report.tokens_per_second.items():
        ttft = report.mean_first_token_seconds.get(mode)
        speed = "" if mode == "speculative" else f"{spec_rate / rate:.2f}x"
        lines.append(f"| {MODE_NAMES.get(mode, mode)} | {rate:.1f} | {report.mean_seconds_per_request[mode]:.2f} | "
                     f"{'' if ttft is None else f'{ttft * 1000:.0f} ms'} | {speed} |")
    lines += [
        "",
        f"- tau (tokens per target forward): **{report.tau:.2f}**",
        f"- cost per step on this machine: target forward (1 token) {report.target_forward_ms:.1f} ms"
        + (f", drafter step {report.draft_step_ms:.1f} ms ({report.draft_step_ms / report.target_forward_ms:.0%} "
           "of a target forward)" if report.draft_step_ms is not None else ""),
        f"- sized: {report.sizing}",
        "- per-position acceptance: " + " ".join(f"{a:.2f}" for a in report.per_position_acceptance)
        + "  (conditional: " + " ".join(f"{a:.2f}" for a in report.conditional_acceptance) + ")",
        "- by context length: " + by_context_line(report.acceptance_by_context or []),
        f"- greedy exact (fp32, {report.exact_checked_prompts} prompts): **{report.greedy_exact}**"
        + (f" (first mismatch: {report.first_mismatch})" if report.first_mismatch else ""),
    ]
    if report.engine_check:
        e = report.engine_check
        lines.append(f"- engine matches transformers (plain greedy vs eager `generate`, fp32, {e['prompts']} prompts, "
                     f"{e['tokens']} tokens): **{report.engine_matches_transformers}**"
                     + (f" ({e['near_ties']} parted at a near-tie)" if e["near_ties"] else "")
                     + (f" (first difference: {e['first_mismatch']})" if e["first_mismatch"] else ""))
    if report.target_health:
        lines.append(f"- {eval_line(report.target_health)}")
    if report.exact_text_tau:
        lines.append(f"- tau on the {report.exact_checked_prompts} checked prompts: "
                     + ", ".join(f"{tau:.2f} in {name}" for name, tau in report.exact_text_tau.items())
                     + " (fp32 decodes plain decoding's own text)")
    if report.accepted_by_source:
        by = report.accepted_by_source
        total = max(1, sum(by.values()))
        lines.append(f"- accepted draft tokens: {by['drafter']} from the drafter ({by['drafter'] / total:.0%}), "
                     f"{by['lookup']} only the context lookup proposed ({by['lookup'] / total:.0%})")
    if report.bf16_token_agreement is not None:
        lines.append(f"- token agreement with plain decoding in the same precision: {report.bf16_token_agreement:.3f}")
    if report.drift:
        d = report.drift
        lines.append(f"- drift from the original model (Medusa-2 trained the backbone; {d['prompts']} prompts, greedy): "
                     f"token agreement {d['token_agreement']:.3f}, mean KL {d['mean_kl']:.4f} nats/token, "
                     f"identical replies {d['identical_replies']:.0%}")
    if report.cost_per_request:
        lines.append("- cost per request: " + ", ".join(f"{MODE_NAMES.get(m, m)} {c:.6f}"
                                                          for m, c in report.cost_per_request.items()))
    if report.decision:
        d = report.decision
        head = "proposal as asked, priced" if d.get("forced") else "proposal chosen on this machine"
        lines.append(f"- {head} ({d['calibration']}, {d['seconds']:.0f} s), predicted speedup: "
                     + ", ".join(f"{c['proposal']} {c['predicted_speedup']:.2f}x" for c in d["candidates"]))
        lines += [f"  - {note}" for note in d.get("notes", [])]
    if report.verdict:
        lines += ["", f"**Verdict: {report.verdict['text']}**"]
    return "\n".join(lines)


def write_json(report: EvalReport, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(report.to_dict(), indent=2))


def by_context_line(buckets: list[dict]) -> str:
    """Tau per context-length bucket, with its steps (docs/metrics.md)."""
    return ", ".join(f"{b['context']} tau {b['tau']:.2f} ({b['steps']} steps)" for b in buckets) or "no steps"
