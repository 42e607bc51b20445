"""Data health: whether the replies a target wrote are text or junk (docs/metrics.md, "Data health").

A target that writes `\\n\\n\\n...` or `,,,,` (a base model given a chat prompt, a broken template, a
wrong stop token) yields data a drafter learns to predict perfectly: held-out agreement and tau look
excellent and mean nothing.  So every data run measures, per shard and in total, over the reply
tokens (loss_mask 1, each contiguous run one reply):

- `stopped_share`: replies that end on one of the target's stop tokens, of those not cut inside
  reasoning; the rest were cut at data.max_new_tokens (or data.max_seq_len). Judged only where the
  target wrote the replies (data.mode=regenerate): a prefilled reply is the source's text;
- `cut_in_reasoning_share`: replies cut while still inside a reasoning block (a `<think>` or a harmony
  analysis channel left open): valid on-policy text of a reasoning target, counted apart, never judged;
- `loop_share`: reply tokens inside a repetition loop: a stretch that repeats a unit of 1-16 tokens at
  least three times in a row and is at least 8 tokens longer than its unit;
- `distinct_share`: distinct tokens over tokens, per reply, averaged over replies (`distinct_per_reply`
  is the mean count);
- `top_token_share`: the most frequent reply token's share of all reply tokens (stop tokens left out).

`verdict` compares them with limits (shipped defaults, `data.health` in a recipe) and gives the
problems past the warning limits and past the stopping ones.  The same figures are computed by
`eval` and `bench` for the target's own plain output on the prompts they time.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from draftsmith.heads.infra.files import write_atomic

from .chat import Reasoning, reasoning_of

log = logging.getLogger(__name__)

MAX_PERIOD = 16
MIN_EXTRA = 8         # a loop is at least this many tokens longer than its unit

LIMITS = {
    # figure: (warn when past, stop when past, direction): "above" flags large values, "below" small ones
    "loop_share": (0.25, 0.6, "above"),
    "top_token_share": (0.25, 0.6, "above"),
    "distinct_share": (0.2, 0.05, "below"),
    "stopped_share": (0.1, None, "below"),
}
MIN_REPLIES = 32      # fewer replies than this: figures are reported, never judged

REASONING_CONTEXT = 16   # prompt tokens read before a reply (a template may open the reasoning block itself)


def loop_tokens(tokens) -> int:
    """How many of `tokens` lie inside a repetition loop (see the module docstring)."""
    t = np.asarray(tokens)
    n = len(t)
    covered = np.zeros(n, dtype=bool)
    for period in range(1, min(MAX_PERIOD, n // 3) + 1):
        same = np.concatenate([[False], t[period:] == t[:-period], [False]])   # same[j + 1]: t[j + p] == t[j]
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for start, end in zip(edges[::2], edges[1::2]):                        # runs same[start + 1 .. end]
            if end - start >= max(2 * period, MIN_EXTRA):
                covered[start:end + period] = True
    return int(covered.sum())


def reply_spans(loss_mask) -> list[tuple[int, int]]:
    """[start, end) of each contiguous run of 1s: one reply each."""
    spans, start = [], None
    for i, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


@dataclass
class Health:
    """Running totals over replies; `figures()` gives the shares."""
    reasoning: Reasoning | None = None
    replies: int = 0
    tokens: int = 0
    stopped: int = 0
    cut_in_reasoning: int = 0
    looped: int = 0
    distinct_share_sum: float = 0.0
    distinct_sum: int = 0
    counts: Counter = field(default_factory=Counter)

    def add_reply(self, tokens: list[int], stop_ids, stopped: bool | None = None, context=()) -> None:
        """One reply; `stopped` (default: it ends on a stop token) says whether it ended by itself;
        `context`: the prompt tokens just before it (where a template opens a reasoning block)."""
        stops = set(stop_ids)
        stopped = (bool(tokens) and tokens[-1] in stops) if stopped is None else stopped
        body = [t for t in tokens if t not in stops]
        self.replies += 1
        self.stopped += stopped
        if not stopped and self.reasoning is not None and self.reasoning.inside(list(context) + list(tokens)):
            self.cut_in_reasoning += 1
        if not body:
            return
        self.tokens += len(body)
        self.looped += loop_tokens(body)
        distinct = len(set(body))
        self.distinct_sum += distinct
        self.distinct_share_sum += distinct / len(body)
        self.counts.update(body)

    def add_record(self, record: dict, stop_ids) -> None:
        ids = record["input_ids"]
        for start, end in reply_spans(record["loss_mask"]):
            self.add_reply(ids[start:end], stop_ids, context=ids[max(0, start - REASONING_CONTEXT):start])

    def merge(self, other: "Health") -> None:
        for name in ("replies", "tokens", "stopped", "cut_in_reasoning", "looped", "distinct_share_sum",
                     "distinct_sum"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.counts.update(other.counts)

    def figures(self, tokenizer=None) -> dict:
        top, top_count = (self.counts.most_common(1)[0] if self.counts else (None, 0))
        replies = max(1, self.replies)
        judged = self.replies - self.cut_in_reasoning       # a reply cut inside reasoning says nothing of stops
        out = {"replies": self.replies, "reply_tokens": self.tokens,
               "stopped_share": self.stopped / judged if judged else None,
               "cut_in_reasoning_share": self.cut_in_reasoning / replies,
               "loop_share": self.looped / max(1, self.tokens),
               "distinct_share": self.distinct_share_sum / replies,
               "distinct_per_reply": self.distinct_sum / replies,
               "top_token_share": top_count / max(1, self.tokens), "top_token": top}
        if tokenizer is not None and top is not None:
            out["top_token_text"] = tokenizer.decode([top])
        return out


def limits_from(overrides: dict | None) -> dict:
    """The shipped limits, with a recipe's `data.health` overrides ({figure}_warn / {figure}_stop)."""
    limits = {name: [warn, stop, direction] for name, (warn, stop, direction) in LIMITS.items()}
    for key, value in (overrides or {}).items():
        name, _, kind = key.rpartition("_")
        if name not in limits or kind not in ("warn", "stop"):
            valid = [f"{n}_{k}" for n in LIMITS for k in ("warn", "stop")]
            raise ValueError(f"data.health: unknown limit '{key}'; valid: {valid}")
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value <= 1):
            raise ValueError(f"data.health.{key} must be a share in [0, 1] or null (never), got {value!r}")
        limits[name][0 if kind == "warn" else 1] = value
    return limits


@dataclass
class Verdict:
    warnings: list[str]
    stops: list[str]

    @property
    def healthy(self) -> bool:
        return not self.warnings and not self.stops


def verdict(figures: dict, limits: dict, min_replies: int = MIN_REPLIES, skip=()) -> Verdict:
    """The figures past their warning and stopping limits, as readable phrases (none under `min_replies`)."""
    warnings, stops = [], []
    if figures["replies"] < min_replies:
        return Verdict([], [])
    for name, (warn, stop, direction) in limits.items():
        if name in skip:
            continue
        value = figures[name]
        if value is None:                       # nothing to judge it on (stopped_share: every reply cut in reasoning)
            continue

        def past(limit):
            return limit is not None and (value > limit if direction == "above" else value < limit)
        phrase = f"{name} {value:.2f} ({'above' if direction == 'above' else 'below'} {{}})"
        if past(stop):
            stops.append(phrase.format(stop))
        elif past(warn):
            warnings.append(phrase.format(warn))
    return Verdict(warnings, stops)


def ends(figures: dict) -> str:
    """How the replies ended, in words."""
    stopped = figures["stopped_share"]
    cut = figures.get("cut_in_reasoning_share") or 0
    return ("every one cut inside reasoning" if stopped is None else f"{stopped:.0%} end on a stop token") + (
        f" ({cut:.0%} cut inside reasoning, not counted)" if cut and stopped is not None else "")


def describe(figures: dict) -> str:
    top = figures.get("top_token_text", figures.get("top_token"))
    return (f"{figures['replies']} replies, {figures['reply_tokens']} tokens: {ends(figures)}, "
            f"{figures['loop_share']:.1%} of tokens in repetition loops, "
            f"{figures['distinct_share']:.2f} distinct tokens per token ({figures['distinct_per_reply']:.0f} per "
            f"reply), most frequent token {top!r} at {figures['top_token_share']:.1%}")


FIXES = ("the target may be a base model or lack its chat template: give target.chat_template (a Jinja file), "
         "or use data.mode=prefill, which labels the source's own text with the target's distribution; a target "
         "that only runs long may need a lower data.max_new_tokens")
PREFILL_FIXES = ("in data.mode=prefill the replies are the source's own text: check data.source (and "
                 "data.messages_field) holds real conversations, and the template renders them (target.chat_template)")


def fixes(mode: str) -> str:
    return PREFILL_FIXES if mode == "prefill" else FIXES


def unjudged(mode: str) -> tuple:
    """The figures that say nothing in a data mode: whether replies stopped, unless the target wrote them all."""
    return () if mode == "regenerate" else ("stopped_share",)


MIN_EVAL_REPLIES = 5


def of_outputs(outputs, max_new_tokens: int, stop_ids=(), tokenizer=None) -> dict:
    """The health of the target's own plain output on the prompts eval and bench time (a reply ended by
    itself when it is shorter than max_new_tokens or ends on a stop token): the figures, the limits they
    pass, and whether acceptance measured on these prompts is representative (not when degenerate).
    Cut replies are not judged here: an evaluation caps its replies on purpose."""
    health = Health()
    stops = set(stop_ids)
    for tokens in outputs:
        tokens = list(tokens)
        health.add_reply(tokens, stops, stopped=len(tokens) < max_new_tokens or bool(tokens and tokens[-1] in stops))
    figures = health.figures(tokenizer)
    found = verdict(figures, limits_from(None), MIN_EVAL_REPLIES, skip=("stopped_share",))
    figures.update(warnings=found.warnings, stops=found.stops, representative=not found.stops)
    return figures


def eval_line(figures: dict) -> str:
    """One report line on the target's own output, with the warning when acceptance there means little."""
    line = f"the target's own plain output: {describe(figures)}"
    if figures["stops"]:
        line += (f". **Acceptance here is not representative: the target's output is degenerate "
                 f"({'; '.join(figures['stops'])}); {FIXES}**")
    elif figures["warnings"]:
        line += f" (past a warning limit: {'; '.join(figures['warnings'])})"
    return line


class DegenerateData(ValueError):
    """Data past the data-health stopping limits (data.allow_degenerate=true keeps it)."""


LIVE_REPLIES = 128     # a run judges its data as it goes once it has this many replies


def _stop_message(figures: dict, found: Verdict, where: str, mode: str = "regenerate") -> str:
    return (f"the target's data looks degenerate ({where}): {'; '.join(found.stops)}. {describe(figures)}. "
            f"Likely fix: {fixes(mode)}. A drafter trained on it would report high acceptance that means nothing. "
            "Everything made so far is kept; to train on it anyway, set data.allow_degenerate=true")


def _warn_message(figures: dict, found: Verdict, where: str, mode: str) -> str:
    return (f"data health ({where}): {'; '.join(found.warnings + found.stops)}. {describe(figures)}. "
            f"If this is not what the data should be: {fixes(mode)}")


class HealthWatch:
    """Judges a run's data while it is made: once LIVE_REPLIES replies are written, a warning (once) past
    the warning limits, and an error past the stopping ones (unless data.allow_degenerate), so a target
    writing junk is caught after its first shards, not after hours."""

    def __init__(self, settings, target):
        self.settings, self.stop_ids, self.tokenizer = settings, target.eos_token_ids, target.tokenizer
        self.limits = limits_from(settings.health)
        self.health = Health(reasoning_of(target.tokenizer))
        self.warned = False

    def add(self, records: list[dict]) -> None:
        for record in records:
            self.health.add_record(record, self.stop_ids)

    def check(self) -> None:
        if self.warned or self.health.replies < LIVE_REPLIES:
            return
        figures = self.health.figures(self.tokenizer)
        found = verdict(figures, self.limits, skip=unjudged(self.settings.mode))
        where, mode = f"the first {figures['replies']} replies of this run", self.settings.mode
        if found.stops and not self.settings.allow_degenerate:
            raise DegenerateData(_stop_message(figures, found, where, mode))
        if not found.healthy:
            log.warning(_warn_message(figures, found, where, mode))
            self.warned = True


def judge(out_dir, settings, total: Health, per_shard: dict, tokenizer) -> dict:
    """Write `health.json` (the figures in total and per shard, the limits, the verdict); warn past the
    warning limits and raise DegenerateData past the stopping ones unless data.allow_degenerate."""


    limits, skip = limits_from(settings.health), unjudged(settings.mode)
    figures = total.figures(tokenizer)
    found = verdict(figures, limits, skip=skip)
    flagged = {name: verdict(f, limits, skip=skip) for name, f in per_shard.items()}
    flagged = {name: v.warnings + v.stops for name, v in flagged.items() if not v.healthy}
    write_atomic(Path(out_dir) / "health.json", json.dumps(
        {"total": figures, "shards": per_shard, "limits": {k: v[:2] for k, v in limits.items()},
         "warnings": found.warnings, "stops": found.stops, "flagged_shards": flagged,
         "mode": settings.mode, "not_judged": list(skip), "allow_degenerate": settings.allow_degenerate},
        indent=1, default=str))
    log.info("data health: %s", describe(figures))
    if flagged:
        log.info("data health: %d of %d shards past a limit (health.json), e.g. %s", len(flagged), len(per_shard),
                 "; ".join(f"{k}: {', '.join(v)}" for k, v in list(flagged.items())[:3]))
    if found.stops and not settings.allow_degenerate:
        raise DegenerateData(_stop_message(figures, found, f"all {figures['replies']} replies", settings.mode))
    if not found.healthy:
        log.warning(_warn_message(figures, found, f"all {figures['replies']} replies", settings.mode))
    return figures


def require_healthy(data_dir, settings) -> None:
    """Refuse to train on data whose health.json says it is past the stopping limits (data.allow_degenerate
    overrides); data made before health.json existed is not judged."""
    path = Path(data_dir) / "health.json"
    if settings.allow_degenerate or not path.is_file():
        return
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        total = saved["total"]
        numbers = [total[name] for name in (*LIMITS, "replies")
                   if not (name == "stopped_share" and total[name] is None)]      # every reply cut in reasoning
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise TypeError("a figure is not a number")
    except (OSError, ValueError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise DegenerateData(f"{path} is damaged ({type(err).__name__}: {str(err)[:80]}): it should hold the data's "
                             "health figures; delete it (the next `draftsmith data` run judges the data again), or "
                             "set data.allow_degenerate=true to train without the check") from None
    found = verdict(total, limits_from(settings.health), skip=saved.get("not_judged", ()))
    if found.stops:
        raise DegenerateData(_stop_message(saved["total"], found, f"{path}", saved.get("mode", "regenerate")))
