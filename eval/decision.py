"""Which proposal to decode with on this machine, plain decoding among the choices (docs/metrics.md, "The
decision rule").

Every candidate is priced with the one speedup model draftsmith has (eval/predict.py: `speedup`):

    S = tokens per step x T(1) / (T(n) + D)

from two measurements made here: the machine's cost curve T(n), a target forward over n new tokens (measured
interleaved, made nondecreasing), and, for each candidate, a short calibration decode on the run's own prompts
that gives its tokens per step, the tokens it put in each verification, and D, what one proposal costs.  The
verification's cost is T(n) averaged over the steps the calibration made, not T at their mean n: a context
lookup proposes a varying number of tokens (none where the context has no match), and on a CPU T(n) is flat
for small n and steep after, so the mean of T is what the steps cost.
The candidates: chains of 1 to the drafter's depth (longer ones while they commit more a step), the
drafter's own tuned tree (and, for static trees, the trees of 2 and 3 nodes beside it), each
with the context lookup off and at `eval.lookup`; then, with the shape of the
best candidate that had the lookup, the lookup at each halving of `eval.lookup` down to 1 (fewer tokens keep a
verification in the flat part of the curve); and plain decoding (S = 1).  The best predicted S wins; when none
beats plain decoding, the decision is "off".
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from draftsmith.heads.decoding.settings import EvalSettings
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.runtime.target import Target

from .predict import speedup, unconditional_from
from .proposal import block_cost, configure_proposal, measure_proposal, nondecreasing

log = logging.getLogger(__name__)

CALIBRATION_PROMPTS = 2
CALIBRATION_TOKENS = 32          # per prompt and candidate
MIN_STEPS = 8                    # fewer verification steps measure no acceptance
SMALL_TREES = (2, 3)              # static trees tried beside the tuned size: the first position's top 2 (and a
                                 # second level), which keep a verification in a CPU curve's flat part; tried
                                 # whatever the tuner chose (its 5-round curve chose 1 in one run, 3 in another)
CURVE_REPEATS = 15               # interleaved rounds of T(n): on a shared 2-core VM, 5 rounds put T(2)/T(1)
                                 # anywhere in 0.95-1.25 (one run priced every proposal below 1 so); 15: 1.03-1.11


@dataclass
class Candidate:
    """One proposal the rule prices: the eval settings that make it, and what calibration measured."""
    settings: dict                       # proposal, chain_length, tree_size, lookup (EvalSettings fields)
    description: str = ""
    tokens_per_step: float = 1.0         # tokens each verification step commits (tau)
    verified_tokens: float = 1.0         # tokens each verification step feeds the target (root included), mean
    draft_ms: float = 0.0                # one proposal
    predicted_speedup: float = 1.0       # S, against plain decoding on this machine
    verified_sizes: dict[int, int] = field(default_factory=dict)   # n -> calibration steps that verified n tokens
    verify_ms: float = 0.0               # T(n) averaged over those steps (price)

    @property
    def plain(self) -> bool:
        return not self.settings


@dataclass
class Decision:
    """The candidates priced, the one chosen, and the cost curve they were priced with."""
    candidates: list[Candidate]
    chosen: Candidate                    # the best speculative candidate (decoded and timed, even when off)
    on: bool                             # whether it beats plain decoding by the prediction
    forward_ms: dict[int, float]         # T(n), nondecreasing
    calibration: str                     # which prompts and how many tokens
    seconds: float = 0.0                 # what deciding cost
    notes: list[str] = field(default_factory=list)
    forced: bool = False                 # the user's own proposal, priced only (price_forced)

    def to_dict(self) -> dict:
        return {"on": self.on, "forced": self.forced, "chosen": self.chosen.description, "calibration": self.calibration,
                "seconds": round(self.seconds, 1), "forward_ms": {n: round(ms, 2) for n, ms in self.forward_ms.items()},
                "candidates": [{"proposal": c.description, "tokens_per_step": round(c.tokens_per_step, 3),
                                "verified_tokens": round(c.verified_tokens, 2), "verify_ms": round(c.verify_ms, 2),
                                "draft_ms": round(c.draft_ms, 2),
                                "predicted_speedup": round(c.predicted_speedup, 3)} for c in self.candidates],
                "notes": self.notes}


def candidate_settings(drafter, target: Target, options: EvalSettings) -> list[dict]:
    """The speculative candidates for this drafter and target: chains of 1..depth and the drafter's own
    (tuned) shape, each with the lookup off and at options.lookup (when it is on)."""
    drafter.set_proposal(chain=0)                        # 0: the drafter's own chain length
    depth = max(1, int(getattr(drafter.tree, "depth", None) or getattr(drafter.tree, "max_depth", None) or 1))
    depth = min(depth, getattr(drafter, "max_proposal_depth", None) or depth)     # MTP: the depths it trained
    probe = with_settings(options, {"proposal": "default", "lookup": 0, "tree_size": options.tree_size})
    configure_proposal(drafter, target, probe)           # its own shape, tuned here once (written into probe)
    lookups = [0] if target.recurrent or not options.lookup else [0, options.lookup]
    shapes = [{"proposal": "chain", "chain_length": k, "tree_size": None, "tree_depth_topk_total": None}
              for k in range(1, depth + 1)]
    if not target.recurrent and (drafter.static_tree or drafter.dynamic_tree):
        shapes.append({"proposal": "default", "chain_length": None, "tree_size": probe.tree_size,
                       "tree_depth_topk_total": probe.tree_depth_topk_total})
    if not target.recurrent and drafter.static_tree and probe.tree_size:
        shapes += [{"proposal": "tree", "chain_length": None, "tree_size": size, "tree_depth_topk_total": None}
                   for size in SMALL_TREES if size != probe.tree_size]
    return [{**shape, "lookup": lookup} for shape in shapes for lookup in lookups]


def plain_candidate() -> Candidate:
    """Plain decoding as a candidate: one token a step, nothing proposed, S = 1."""
    return Candidate({}, "plain decoding", 1.0, 1.0, 0.0, 1.0, {1: 1})


class _Recorder:
    """A proposer that counts the tokens of each proposal it hands the verifier (the drafter's and the
    lookup's together), and passes everything else through."""

    def __init__(self, proposer):
        self.proposer, self.sizes = proposer, []

    def __getattr__(self, name):
        if name == "proposer":
            raise AttributeError(name)
        return getattr(self.proposer, name)

    def propose(self, context):
        tree = self.proposer.propose(context)
        self.sizes.append(int(tree.size))
        return tree


def calibrate(proposer, target: Target, options: EvalSettings, prompts: list, tokens: int, settings: dict,
              heldout: list[float] | None, notes: list[str]) -> Candidate:
    """One candidate's tokens per step, tokens per verification and proposal cost, from a short decode of
    `prompts`.  Too few steps to measure (prompts that stop at once): a chain is priced from the held-out
    agreement instead, said in `notes`; anything else is priced as committing one token a step."""
    recorder = _Recorder(proposer)
    accepted, sizes = [], []
    for index, (_, prompt) in enumerate(prompts):
        recorder.sizes = []
        generator = torch.Generator(device=target.device).manual_seed(options.seed + index)
        run = decode(target, prompt, tokens, recorder, options.temperature, options.top_p, options.rule,
                     generator=generator)
        accepted += run.accepted
        sizes += recorder.sizes
    per_step = sum(a + 1 for a in accepted) / max(1, len(accepted))
    verified = 1 + sum(sizes) / max(1, len(sizes))
    description = proposer.describe_proposal()
    if len(accepted) < MIN_STEPS:
        chain = settings.get("chain_length") if settings.get("proposal") == "chain" else None
        if chain and heldout and not settings.get("lookup"):
            per_step = 1 + sum(unconditional_from(heldout)[:chain])
            notes.append(f"{description}: the calibration prompts gave {len(accepted)} verification steps, too few "
                         f"to measure acceptance (at least {MIN_STEPS}); priced from the held-out agreement of "
                         "training instead")
        else:
            per_step = 1.0
            notes.append(f"{description}: the calibration prompts gave {len(accepted)} verification steps, too few "
                         f"to measure acceptance (at least {MIN_STEPS}), and no held-out rate prices it: counted as "
                         "one token a step")
        verified = max(verified, 1 + (settings.get("chain_length") or 1))
        histogram = {math.ceil(verified): 1}
    else:
        histogram = dict(Counter(1 + size for size in sizes))
    draft = measure_proposal(target, proposer, prompts[0][1])
    return Candidate(settings, description, per_step, verified, draft * 1000, verified_sizes=histogram)


def price(candidates: list[Candidate], target: Target, curve: dict[int, float] | None = None) -> dict[int, float]:
    """Each candidate's predicted speedup from this machine's cost curve: its verification costs T(n) averaged
    over its calibration steps.  Returns the curve (seconds), measured for the sizes `curve` lacks (all of
    them, made nondecreasing together, when a size is new)."""
    sizes = {1} | {n for c in candidates for n in c.verified_sizes}
    if curve is None or not sizes <= set(curve):
        curve = nondecreasing(block_cost(target, sorted(sizes | set(curve or {})), repeats=CURVE_REPEATS))
    for c in candidates:
        steps = sum(c.verified_sizes.values())
        verify = sum(curve[n] * count for n, count in c.verified_sizes.items()) / steps
        c.verify_ms = verify * 1000
        c.predicted_speedup = speedup(c.tokens_per_step, curve[1], verify, c.draft_ms / 1000)
    return curve


def decide(drafter, target: Target, options: EvalSettings, prompts: list[tuple[str, list[int]]],
           calibration_tokens: int = CALIBRATION_TOKENS, heldout: list[float] | None = None
           ) -> tuple[Decision, object]:
    """Price every candidate (module docstring) on `prompts` (at most CALIBRATION_PROMPTS are decoded).
    The chosen candidate's settings are written into `options` (so the fp32 exactness check decodes it too);
    returns the decision and the proposer to decode with (the drafter set to it, with the lookup if any).
    heldout: the checkpoint's held-out agreement per position, the fallback where calibration is too short."""
    started = time.perf_counter()
    used, notes = prompts[:CALIBRATION_PROMPTS], []
    measured, longest = [], {}                   # longest: by lookup, the last chain measured
    for settings in candidate_settings(drafter, target, options):
        chain, lookup = settings.get("chain_length"), settings["lookup"]
        shorter = longest.get(lookup)
        if chain and shorter is not None and shorter.settings["chain_length"] < chain - 1:
            continue                                     # a shorter chain already committed no more (below)
        proposer = configure_proposal(drafter, target, with_settings(options, settings))
        if any(c.description == proposer.describe_proposal() for c in measured):
            continue                                     # the tuned tree is one of the chains
        candidate = calibrate(proposer, target, options, used, calibration_tokens, settings, heldout, notes)
        measured.append(candidate)
        if chain and (shorter is None or candidate.tokens_per_step > shorter.tokens_per_step):
            longest[lookup] = candidate                  # longer chains are tried while they commit more a step
    curve = price(measured, target)
    with_lookup = [c for c in measured if c.settings["lookup"]]
    if with_lookup:                                      # fewer lookup tokens, with the best such shape
        shape = max(with_lookup, key=lambda c: c.predicted_speedup).settings
        for lookup in halvings(shape["lookup"]):
            settings = {**shape, "lookup": lookup}
            proposer = configure_proposal(drafter, target, with_settings(options, settings))
            measured.append(calibrate(proposer, target, options, used, calibration_tokens, settings, heldout, notes))
        curve = price(measured, target, curve)
    plain = plain_candidate()
    best = max(measured, key=lambda c: c.predicted_speedup)
    on = best.predicted_speedup > 1.0
    for key, value in best.settings.items():
        setattr(options, key, value)
    proposer = configure_proposal(drafter, target, options)
    decision = Decision([plain, *measured], best, on, {n: s * 1000 for n, s in curve.items()},
                        f"{len(used)} of the run's prompts x {calibration_tokens} tokens per candidate",
                        time.perf_counter() - started, notes)
    if not on:
        decision.notes.append("no proposal is predicted to beat plain decoding on this machine: the best one is "
                              "still decoded and timed, so the report measures what it would give")
    log.info("proposal: %s (predicted %.2fx plain; %s)", best.description if on else "off (plain decoding)",
             best.predicted_speedup, ", ".join(f"{c.description} {c.predicted_speedup:.2f}x" for c in measured))
    for note in notes:
        log.warning("%s", note)
    return decision, proposer


def price_forced(proposer, target: Target, options: EvalSettings, prompts: list[tuple[str, list[int]]],
                 calibration_tokens: int = CALIBRATION_TOKENS, heldout: list[float] | None = None) -> Decision:
    """The rule's prediction for a proposal the user forced (--chain, --tree, --lookup): it is run as asked,
    and the verdict says when the rule predicts it loses."""
    started = time.perf_counter()
    used, notes = prompts[:CALIBRATION_PROMPTS], []
    settings = {"proposal": options.proposal, "chain_length": options.chain_length, "lookup": options.lookup}
    forced = calibrate(proposer, target, options, used, calibration_tokens, settings, heldout, notes)
    curve = price([forced], target)
    decision = Decision([plain_candidate(), forced], forced,
                        forced.predicted_speedup > 1.0, {n: s * 1000 for n, s in curve.items()},
                        f"{len(used)} of the run's prompts x {calibration_tokens} tokens (the proposal as asked)",
                        time.perf_counter() - started, notes)
    decision.forced = True
    return decision


def halvings(lookup: int) -> list[int]:
    """The lookup sizes below `lookup` the rule also tries: each half of the one before, down to 1."""
    sizes = []
    while lookup > 1:
        lookup //= 2
        sizes.append(lookup)
    return sizes


def with_settings(options: EvalSettings, settings: dict) -> EvalSettings:
    """A copy of `options` with a candidate's settings (tree_depth_topk_total is not an init field)."""
    trial = dataclasses.replace(options, **{k: v for k, v in settings.items() if k != "tree_depth_topk_total"})
    trial.tree_depth_topk_total = settings.get("tree_depth_topk_total")
    return trial
