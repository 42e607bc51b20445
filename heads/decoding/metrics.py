"""The one definition of each metric (docs/metrics.md), used by training logs, evaluation and reports.

- tau (acceptance length): tokens emitted per target forward while decoding
  = accepted draft tokens + 1, the mean over all verification steps of a run.
- per-position acceptance a_j: the fraction of verification steps in which
  draft position j (0-based depth j+1) was accepted; unconditional.  The
  conditional rate a_j / a_{j-1} is reported beside it.
- simulated tau (training): 1 + a0 + a0*a1 + ..., from the teacher-forced
  top-1 agreement of each draft position.
- speedup: baseline wall time / speculative wall time, same prompts.
- acceptance by context length: tau and a_j over the verification steps whose context (the prompt
  and every token emitted before the step) falls in a bucket (0-1k, 1k-2k, 2k-4k, 4k-8k, 8k+).
"""
from __future__ import annotations

from collections.abc import Sequence


def tau(accepted_per_step: Sequence[int]) -> float:
    """Mean tokens emitted per target forward: accepted drafts + 1 (the target's own token)."""
    if not accepted_per_step:
        return 0.0
    return sum(a + 1 for a in accepted_per_step) / len(accepted_per_step)


def per_position_acceptance(accepted_per_step: Sequence[int], positions: int) -> list[float]:
    """a_j = fraction of steps in which at least j+1 drafts were accepted, j = 0..positions-1."""
    steps = len(accepted_per_step)
    if steps == 0:
        return [0.0] * positions
    return [sum(a > j for a in accepted_per_step) / steps for j in range(positions)]


def conditional_acceptance(unconditional: Sequence[float]) -> list[float]:
    """a_j / a_{j-1}: how often position j is accepted when position j-1 was (a_0 as is)."""
    rates = []
    for j, a in enumerate(unconditional):
        before = 1.0 if j == 0 else unconditional[j - 1]
        rates.append(a / before if before > 0 else 0.0)
    return rates


def simulated_tau(top1_agreement: Sequence[float]) -> float:
    """1 + a0 + a0*a1 + ... from teacher-forced per-position top-1 agreement."""
    total, running = 1.0, 1.0
    for a in top1_agreement:
        running *= a
        total += running
    return total



CONTEXT_EDGES = (0, 1024, 2048, 4096, 8192)


def _bucket_name(low: int, high: int | None) -> str:
    k = lambda n: f"{n // 1024}k" if n else "0"  # noqa: E731
    return f"{k(low)}-{k(high)}" if high is not None else f"{k(low)}+"


def acceptance_by_context(runs: Sequence[tuple[int, Sequence[int]]], positions: int,
                          edges: Sequence[int] = CONTEXT_EDGES) -> list[dict]:
    """Tau and per-position acceptance by the context length at each verification step.

    runs: (prompt tokens, accepted drafts per step) of each decoded prompt; a step's context is the prompt
    plus the tokens emitted before it.  One entry per bucket that holds steps, in order:
    {"context": "1k-2k", "steps", "tau", "per_position_acceptance"}."""
    buckets: dict[int, list[int]] = {}
    for prompt_tokens, accepted in runs:
        context = prompt_tokens
        for a in accepted:
            index = sum(context >= edge for edge in edges) - 1
            buckets.setdefault(index, []).append(a)
            context += a + 1
    out = []
    for index in sorted(buckets):
        high = edges[index + 1] if index + 1 < len(edges) else None
        steps = buckets[index]
        out.append({"context": _bucket_name(edges[index], high), "steps": len(steps), "tau": tau(steps),
                    "per_position_acceptance": per_position_acceptance(steps, positions)})
    return out
