"""The speedup of a set of timed pairs and the verdict it supports: one definition for `bench` (per category
and load level) and `eval` (eval/verdict.py).  docs/metrics.md, "Speed"."""
from __future__ import annotations

import random

BOOTSTRAP_SAMPLES = 1000
INTERVAL = (0.05, 0.95)          # the bootstrap interval's quantiles: a 90% interval


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile (q in [0, 1]) of a non-empty list."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def pooled_speedup(pairs: list[tuple[float, int, float, int]]) -> float:
    """(plain seconds per token) / (speculative seconds per token) over (plain s, tokens, spec s, tokens)."""
    plain = sum(p[0] for p in pairs) / max(1, sum(p[1] for p in pairs))
    spec = sum(p[2] for p in pairs) / max(1, sum(p[3] for p in pairs))
    return plain / spec


def speedup_interval(pairs: list[tuple[float, int, float, int]], seed: int) -> tuple[float, float]:
    """A seeded bootstrap interval of the pooled speedup, resampling (request, repeat) pairs."""
    rng = random.Random(seed)
    ratios = [pooled_speedup([pairs[rng.randrange(len(pairs))] for _ in pairs]) for _ in range(BOOTSTRAP_SAMPLES)]
    return quantile(ratios, INTERVAL[0]), quantile(ratios, INTERVAL[1])


MIN_PAIRS = 4                    # fewer (request, repeat) pairs than this give no verdict


def verdict(low: float, high: float, pairs: int = MIN_PAIRS) -> str:
    """switch on / switch off / no measurable gain, from the speedup's interval."""
    if pairs < MIN_PAIRS:
        return f"no measurable gain: {pairs} runs per mode are too few to tell (at least {MIN_PAIRS})"
    if low > 1.0:
        return f"switch on: {low:.2f}x to {high:.2f}x faster"
    if high < 1.0:
        return f"switch off: {low:.2f}x to {high:.2f}x (slower)"
    return f"no measurable gain: {low:.2f}x to {high:.2f}x"
