"""The verdict every evaluation ends with: switch speculative decoding on (with this configuration), or keep
it off, with the interval the measurement supports (docs/metrics.md, "Speed").

The same rule as `draftsmith bench` (eval/intervals.py): the pooled speedup over the timed prompts, each a pair
timed back to back; a seeded 90% bootstrap interval over the pairs; *switch on* when the whole interval lies
above 1, *switch off* below 1, *no measurable gain* otherwise or with fewer than 4 pairs.  Eval adds one
condition: the output must have been greedy exact.  The measurement decides, not the prediction that chose
the proposal (eval/decision.py); where they part, the verdict says so.  When off, it gives the break-even:
the tokens per step this machine's cost curve needs, and what the measured acceptance would give where
verifying a few tokens costs what one does (a memory-bound GPU at batch 1: a prediction, labelled so).
"""
from __future__ import annotations

from .intervals import INTERVAL, speedup_interval
from .intervals import verdict as interval_verdict
from .predict import speedup

LEVEL = INTERVAL[1] - INTERVAL[0]


def pairs_of(per_prompt: list[dict]) -> list[tuple[float, int, float, int]]:
    """(plain s, plain tokens, speculative s, speculative tokens) of each timed prompt."""
    return [(r["seconds"]["plain"], r["mode_tokens"]["plain"], r["seconds"]["speculative"],
             r["mode_tokens"]["speculative"]) for r in per_prompt]


def verdict(report, decision: dict | None, seed: int = 0) -> dict:
    """The decision for this machine and this drafter (module docstring), in words and fields."""
    pairs = pairs_of(report.per_prompt)
    low, high = speedup_interval(pairs, seed)
    rule = interval_verdict(low, high, len(pairs))
    measured = report.speedup_vs_plain
    span = (f"{measured:.2f}x plain decoding ({LEVEL:.0%} interval {low:.2f}-{high:.2f}x over {len(pairs)} "
            "prompts)")
    predicted_on = decision is None or decision["on"]
    exact = report.greedy_exact or report.temperature > 0
    out = {"speedup": measured, "interval": [low, high], "proposal": report.proposal, "rule": rule}
    if exact and rule.startswith("switch on"):
        disagree = "" if predicted_on else (" (the decision rule had predicted no gain: the measurement, not the "
                                            "prediction, decides)")
        out.update(decision="on", text=f"ON: switch speculative decoding on here with {report.proposal}: {span}"
                                       f"{disagree}.")
        return out
    if not exact:
        reason = "its greedy output was NOT exact: fix that before any speed counts"
    elif rule.startswith("switch off"):
        reason = "it is slower than plain decoding on this machine"
    elif not predicted_on:
        reason = ("the decision rule predicted no proposal beats plain decoding on this machine, and the "
                  f"measurement shows no gain ({rule})")
    else:
        reason = f"{rule} (more prompts, eval limit=N, may show one)"
    out.update(decision="off", text=f"OFF: keep plain decoding here; {reason}. Measured with {report.proposal}: "
                                    f"{span}.")
    if decision and decision.get("forced") and not decision["on"]:
        predicted = decision["candidates"][-1]["predicted_speedup"]
        out["text"] += (f" The proposal was run as asked; the decision rule predicts it loses here ({predicted:.2f}x "
                        "plain decoding): without --chain, --tree or --lookup, eval chooses one by this machine's costs.")
    out["break_even"] = break_even(report, decision)
    if out["break_even"]:
        out["text"] += " " + out["break_even"]["text"]
    return out


def break_even(report, decision: dict | None) -> dict | None:
    """What would make the measured proposal pay: the tokens per step this machine's costs need, and the
    prediction where a verification of a few tokens costs one forward (a memory-bound GPU at batch 1)."""
    if not decision:
        return None
    chosen = next((c for c in decision["candidates"] if c["proposal"] == decision["chosen"]), None)
    if chosen is None:
        return None
    curve = {int(n): ms for n, ms in decision["forward_ms"].items()}
    n = min((size for size in curve if size >= chosen["verified_tokens"]), default=max(curve))
    verify = chosen.get("verify_ms") or curve[n]      # T(n) averaged over the calibration's steps
    needed = (verify + chosen["draft_ms"]) / curve[1]
    flat = speedup(report.tau, curve[1], curve[1], chosen["draft_ms"])
    mean = chosen["verified_tokens"]
    return {"tokens_per_step_needed": needed, "tokens_per_step_measured": report.tau,
            "predicted_where_verification_is_flat": flat,
            "text": (f"Break-even: this machine's costs need {needed:.2f} tokens per step for {chosen['proposal']} "
                     f"(a verification of {mean:.1f} tokens on average costs {verify / curve[1]:.2f}x a one-token "
                     f"forward, a proposal {chosen['draft_ms'] / curve[1]:.2f}x); it measured {report.tau:.2f}. "
                     f"Where a forward over {n} tokens costs what one does (a memory-bound GPU at batch 1), the same "
                     f"acceptance would give {flat:.2f}x (a prediction, with this machine's proposal cost).")}
