"""`draftsmith eval`: acceptance, speed and exactness of a drafter, measured side by side.

For each prompt, in one process and interleaved (so a noisy machine hits all
of them alike): plain decoding through draftsmith's engine, speculative
decoding, and the transformers baselines asked for (`generate`, and its
prompt-lookup decoding).  Same prompts, dtype, threads and max tokens.

Exactness is judged in fp32 (in bf16 a forward over several tokens
rounds differently from a forward over one, so a bf16 speculative run may
flip a near-tie that plain bf16 decoding resolves the other way): speculative
greedy must equal plain greedy token for token in fp32.  The bf16 agreement
of the timed runs is reported beside it.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import asdict, dataclass, field

import torch

from draftsmith.data import health
from draftsmith.heads.decoding import metrics
from draftsmith.heads.decoding.settings import EvalSettings
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import checkpoint_target, load_drafter, read_config
from draftsmith.heads.drafter import target_path as checkpoint_target_path
from draftsmith.heads.infra.device import resolve_device, synchronize
from draftsmith.heads.registry import trained_class
from draftsmith.heads.runtime.target import Target, resolve_dtype

from . import engine_check
from .drift import drift as target_drift
from .engine_check import EngineCheck
from .prompts import load_prompts, read_prompts
from .decision import CALIBRATION_PROMPTS, decide, price_forced
from .proposal import configure_proposal, step_costs
from .verdict import verdict

log = logging.getLogger(__name__)

PROMPT_LOOKUP_TOKENS = 10   # transformers' documented example value




@dataclass
class PromptResult:
    id: str
    prompt_tokens: int
    tokens: int
    accepted: list[int]
    seconds: dict                      # mode -> wall seconds
    first_token_seconds: dict          # mode -> seconds
    mode_tokens: dict                  # mode -> tokens generated in that mode
    bf16_identical: bool | None = None
    common_prefix: float = 1.0         # fraction of the plain output the speculative output reproduces before diverging

    @property
    def tau(self) -> float:
        return metrics.tau(self.accepted)


@dataclass
class EvalReport:
    checkpoint: str
    kind: str
    target: str
    device: str
    warmup: str
    sizing: str
    target_forward_ms: float           # one-token target forward (batch 1, 200 cached tokens), measured here
    draft_step_ms: float | None        # one drafter step (one drafted level; a parallel drafter's whole proposal), measured here
    prompts_source: str
    dtype: str
    proposal: str
    temperature: float
    max_new_tokens: int
    prompts: int
    tau: float
    per_position_acceptance: list[float]
    conditional_acceptance: list[float]
    tokens_per_second: dict
    speedup_vs_plain: float
    speedup_vs_generate: float | None
    speedup_vs_prompt_lookup: float | None
    greedy_exact: bool
    exact_checked_prompts: int
    first_mismatch: str | None
    bf16_token_agreement: float | None
    mean_first_token_seconds: dict
    mean_seconds_per_request: dict
    cost_per_request: dict | None
    accepted_by_source: dict | None = None   # with a context lookup: accepted draft tokens the drafter proposed
                                             # (alone or with the lookup) and the lookup alone
    exact_text_tau: dict | None = None       # tau on the fp32-checked prompts: in fp32 (plain decoding's own text)
                                             # and in the timed dtype, whose text may part from it at a near-tie
    engine_matches_transformers: bool | None = None   # the engine's plain greedy == transformers' eager generate
    engine_check: dict | None = None         # its details (eval/engine_check.py): prompts, tokens, near-ties, mismatch
    drift: dict | None = None                # Medusa-2: the adapted target against the original (eval/drift.py)
    target_health: dict | None = None        # data/health.py figures of the target's own plain output here
    acceptance_by_context: list | None = None  # tau and a_j by the context length at each step (metrics.py)
    per_prompt: list[dict] = field(default_factory=list)
    decision: dict | None = None             # the proposal chosen on this machine, plain among the choices (decision.py)
    verdict: dict | None = None              # on or off here, with the interval the timed prompts support (verdict.py)

    def to_dict(self) -> dict:
        return asdict(self)


def time_generate(target: Target, prompt: list[int], max_new_tokens: int, lookup: bool) -> tuple[float, list[int]]:
    ids = torch.tensor([prompt], device=target.device)
    extra = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS} if lookup else {}
    synchronize(target.device)
    t = time.perf_counter()
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=target.eos_token_ids,
                                pad_token_id=target.eos_token_ids[0], **extra)
    synchronize(target.device)
    return time.perf_counter() - t, out[0, len(prompt):].tolist()


def run_modes(target, drafter, prompt, options, generator_seed: int):
    """One prompt, every mode, interleaved.  Returns a Timed record (seconds, tokens, first-token seconds per mode)."""
    seconds, first, counts = {}, {}, {}
    gen = torch.Generator(device=target.device).manual_seed(generator_seed)
    plain = decode(target, prompt, options.max_new_tokens, None, options.temperature, options.top_p, generator=gen)
    seconds["plain"], first["plain"], counts["plain"] = plain.seconds, plain.first_token_seconds, len(plain.tokens)
    gen = torch.Generator(device=target.device).manual_seed(generator_seed + 1)
    spec = decode(target, prompt, options.max_new_tokens, drafter, options.temperature, options.top_p,
                  options.rule, generator=gen)
    seconds["speculative"], first["speculative"] = spec.seconds, spec.first_token_seconds
    counts["speculative"] = len(spec.tokens)
    if options.temperature <= 0:
        for mode, lookup in (("generate", False), ("prompt-lookup", True)):
            if mode in options.baselines:
                seconds[mode], produced = time_generate(target, prompt, options.max_new_tokens, lookup)
                counts[mode] = _until_stop(produced, target.eos_token_ids)
    return Timed(seconds, first, counts, plain.tokens, spec.tokens, spec.accepted)


@dataclass
class Timed:
    seconds: dict
    first_token_seconds: dict
    tokens: dict                      # mode -> tokens that mode generated
    plain_tokens: list[int]
    speculative_tokens: list[int]
    accepted: list[int]


def _until_stop(tokens: list[int], stops: list[int]) -> int:
    """Tokens generate produced, its stop token included, padding after it not."""
    for i, token in enumerate(tokens):
        if token in stops:
            return i + 1
    return len(tokens)


@dataclass
class ExactCheck:
    exact: bool
    first_mismatch: str | None
    tau: float | None = None      # tau of the fp32 speculative runs over the checked prompts: plain decoding's own text
    engine: EngineCheck | None = None


def check_exactness(checkpoint: str, target_path: str, prompts, options: EvalSettings, count: int) -> ExactCheck:
    """fp32: speculative greedy equals plain greedy token for token, on the first `count` prompts."""
    target32 = checkpoint_target(read_config(checkpoint), "float32", resolve_device(options.device), target_path,
                                 options.adapter, device_map=options.device_map)
    drafter32 = configure_proposal(load_drafter(checkpoint, target32, options.require_checksum).float(), target32,
                                   options)
    accepted, plains = [], []
    for prompt_id, prompt in prompts[:count]:
        plain = decode(target32, prompt, options.max_new_tokens)
        spec = decode(target32, prompt, options.max_new_tokens, drafter32)
        plains.append(plain.tokens)
        if plain.tokens != spec.tokens:
            return ExactCheck(False, prompt_id, None, engine_check.compare(target32, prompts[:len(plains)],
                                                                           options.max_new_tokens, plains))
        accepted += spec.accepted
    engine = engine_check.compare(target32, prompts[:count], options.max_new_tokens, plains)
    return ExactCheck(True, None, metrics.tau(accepted) if accepted else None, engine)


def evaluate(checkpoint: str, options: EvalSettings, progress: bool = True) -> EvalReport:
    options = dataclasses.replace(options)        # the tuners and the time budget adjust a copy
    config = read_config(checkpoint)
    target_path = checkpoint_target_path(config, options.target)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    conversations = read_prompts(options.prompts, options.limit)         # a bad prompt file: before the target
    target = checkpoint_target(config, dtype, device, target_path, options.adapter, device_map=options.device_map)
    drafter = load_drafter(checkpoint, target, options.require_checksum)
    drafter = drafter.to(target.dtype)          # fp32 beside a CPU float16 (packed) target
    choosing = options.proposal == "default" and options.choose
    base = drafter
    if choosing:
        drafter.set_proposal(chain=1)            # for the warm-up; the decision below sets the proposal
    else:
        drafter = configure_proposal(drafter, target, options)
    prompts = load_prompts(target, options.prompts, options.limit, options.max_new_tokens, options.long_prompts,
                           conversations)
    # warm-up: every mode once, untimed (first calls allocate, and on a GPU load kernels)
    run_modes(target, drafter, prompts[0][1][:32], dataclasses.replace(options, max_new_tokens=8), 0)
    decision, drafter = settle_proposal(base if choosing else drafter, target, options, prompts, config, choosing)
    description = drafter.describe_proposal()
    costs = step_costs(target, drafter, prompts[0][1])
    prompts, sizing = fit_budget(prompts, options, costs["target_forward_ms"] / 1000, dtype)
    if options.lookup:
        drafter.clear_counts()                   # count the timed prompts only
    results, started, plain_outputs = [], time.perf_counter(), []
    for index, (prompt_id, prompt) in enumerate(prompts):
        if over_budget(options, results, time.perf_counter() - started, dtype):
            sizing += f"; stopped after {len(results)} prompts: they took longer than the measured forward implied"
            prompts = prompts[:len(results)]
            break
        timed = run_modes(target, drafter, prompt, options, options.seed + 2 * index)
        plain, spec = timed.plain_tokens, timed.speculative_tokens
        plain_outputs.append(plain)
        identical = plain == spec if options.temperature <= 0 else None
        common = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
        results.append(PromptResult(prompt_id, len(prompt), len(spec), timed.accepted, timed.seconds,
                                    timed.first_token_seconds, timed.tokens, identical, common / max(1, len(plain))))
        if progress:
            line = "  ".join(f"{m} {timed.tokens[m]} tok {s:.2f}s" for m, s in timed.seconds.items())
            print(f"[{index + 1}/{len(prompts)}] {prompt_id}: tau {results[-1].tau:.2f}  {line}", flush=True)
    exact_count = len(prompts) if dtype == torch.float32 else min(options.exact_prompts, len(prompts))
    engine_count = min(options.exact_prompts, len(prompts))       # checked against transformers' generate
    if dtype == torch.float32 and options.temperature <= 0:
        check = ExactCheck(all(r.bf16_identical for r in results),
                           next((r.id for r in results if not r.bf16_identical), None), None,
                           engine_check.compare(target, prompts[:engine_count], options.max_new_tokens,
                                                plain_outputs[:engine_count]))
    else:
        check = check_exactness(checkpoint, target_path, prompts, options, exact_count)
    engine = check.engine
    exact = check.exact and engine.matches      # never an exact result on top of a wrong engine
    mismatch = check.first_mismatch or (None if engine.matches else f"engine vs transformers: {engine.first_mismatch}")
    report = summarize(checkpoint, config, target_path, options, description, dtype, results, exact,
                       exact_count, mismatch)
    report.engine_matches_transformers = engine.matches if engine.prompts else None    # eval.exact_prompts=0
    report.engine_check = asdict(engine)
    if check.tau is not None and options.temperature <= 0:       # both greedy: the same prompts, two precisions
        report.exact_text_tau = {"float32": check.tau,
                                 target.precision: metrics.tau([a for r in results[:exact_count] for a in r.accepted])}
    report.sizing, report.target_forward_ms, report.draft_step_ms = (sizing, costs["target_forward_ms"],
                                                                     costs["draft_step_ms"])
    report.dtype = target.precision
    report.decision = decision.to_dict() if decision is not None else None
    report.verdict = verdict(report, report.decision)
    report.target_health = health.of_outputs(plain_outputs, options.max_new_tokens, target.eos_token_ids,
                                             target.tokenizer)
    if options.lookup:
        report.accepted_by_source = dict(drafter.accepted)
    if trained_class(config).trains_target_adapter and config.get("target_adapter"):   # not the original's
        original = checkpoint_target(config, dtype, device, options.target, adapter="none")
        report.drift = target_drift(target, original, prompts[:max(exact_count, 1)], options.max_new_tokens)
    return report


def settle_proposal(drafter, target, options: EvalSettings, prompts: list, config: dict, choosing: bool):
    """The decision (eval/decision.py): chosen among the candidates, or the proposal as asked, priced; both
    calibrated on the last prompts (the budget times the first ones), their seconds taken from the budget.
    Returns the decision and the proposer to time."""
    heldout = (config.get("heldout") or {}).get("heldout/agreement")
    if choosing:
        decision, drafter = decide(drafter, target, options, prompts[-CALIBRATION_PROMPTS:], heldout=heldout)
    else:
        decision = price_forced(drafter, target, options, prompts[-CALIBRATION_PROMPTS:], heldout=heldout)
    if options.max_minutes:
        options.max_minutes = max(options.max_minutes / 2, options.max_minutes - decision.seconds / 60)
    return decision, drafter


def over_budget(options: EvalSettings, results: list, elapsed: float, dtype) -> bool:
    """Whether one more prompt (at the mean measured so far) and the fp32 exactness check would overrun
    options.max_minutes: a noisy forward measurement must not stretch the run.  At least 3 prompts run."""
    if not options.max_minutes or len(results) < 3:
        return False
    per_prompt = elapsed / len(results)
    plain = sum(r.seconds["plain"] for r in results) / len(results)
    checked = min(options.exact_prompts, len(results) + 1)      # fp32: generate; else plain, speculative, generate
    exact = checked * plain * (1 if dtype == torch.float32 else 3 * 1.5)
    return elapsed + per_prompt + exact > options.max_minutes * 60


def fit_budget(prompts: list, options: EvalSettings, forward_seconds: float, dtype) -> tuple[list, str]:
    """Cut prompts (then tokens) so the timed runs fit options.max_minutes, from the measured forward cost.

    Estimated per prompt: max_new_tokens one-token forwards for plain decoding and for each transformers
    baseline (generate runs about as fast), and as many again for speculative decoding (drafts and
    verification together cost at most about that when they pay); the fp32 exactness check decodes
    exact_prompts three times in fp32 (plain, speculative, transformers' generate; each taken as twice the
    cost of a bf16 forward), or once (generate) when the timed runs are fp32 already."""
    if not options.max_minutes:
        return prompts, f"{len(prompts)} prompts x {options.max_new_tokens} tokens (no time budget)"
    budget = options.max_minutes * 60
    modes = 2 + sum(1 for b in options.baselines if b != "plain" and options.temperature <= 0)
    checked = min(options.exact_prompts, len(prompts))
    exact_runs = checked * (1 if dtype == torch.float32 else 3 * 2)
    per_prompt = modes * options.max_new_tokens * forward_seconds
    fits = int((budget - exact_runs * options.max_new_tokens * forward_seconds) // per_prompt)
    chosen = max(3, min(len(prompts), fits))
    if chosen * per_prompt > budget:       # even 3 prompts do not fit: shorten the replies instead
        options.max_new_tokens = max(32, int(budget / ((3 * modes + exact_runs) * forward_seconds)))
    sizing = (f"{chosen} prompts x {options.max_new_tokens} tokens, sized to {options.max_minutes:g} min from a "
              f"measured {forward_seconds * 1000:.0f} ms target forward (asked: {len(prompts)} prompts)")
    log.info("eval: %s", sizing)
    return prompts[:chosen], sizing


def summarize(checkpoint, config, target_path, options, description, dtype, results, exact, exact_count,
              mismatch) -> EvalReport:
    accepted = [a for r in results for a in r.accepted]
    depth = max(accepted, default=0)
    per_position = metrics.per_position_acceptance(accepted, max(depth, 1))
    modes = results[0].seconds.keys()
    totals = {m: sum(r.seconds[m] for r in results) for m in modes}
    tokens = {m: sum(r.mode_tokens[m] for r in results) for m in modes}
    rate = {m: tokens[m] / totals[m] for m in modes}

    def ratio(mode):
        return rate["speculative"] / rate[mode] if mode in rate else None
    cost = None
    if options.cost_per_hour:
        cost = {m: totals[m] / len(results) * options.cost_per_hour / 3600 for m in modes}
    bf16 = None
    if options.temperature <= 0 and dtype != torch.float32:
        bf16 = sum(r.common_prefix for r in results) / len(results)
    return EvalReport(
        checkpoint=str(checkpoint), kind=config["kind"], target=target_path,
        device=str(resolve_device(options.device)), warmup="every mode run once (8 tokens) before timing",
        sizing="", target_forward_ms=0.0, draft_step_ms=None,
        prompts_source=options.prompts,
        dtype=str(dtype).replace("torch.", ""), proposal=description, temperature=options.temperature,
        max_new_tokens=options.max_new_tokens, prompts=len(results), tau=metrics.tau(accepted),
        per_position_acceptance=per_position, conditional_acceptance=metrics.conditional_acceptance(per_position),
        acceptance_by_context=metrics.acceptance_by_context([(r.prompt_tokens, r.accepted) for r in results],
                                                            max(depth, 1)),
        tokens_per_second=rate, speedup_vs_plain=ratio("plain"), speedup_vs_generate=ratio("generate"),
        speedup_vs_prompt_lookup=ratio("prompt-lookup"), greedy_exact=exact, exact_checked_prompts=exact_count,
        first_mismatch=mismatch, bf16_token_agreement=bf16,
        mean_first_token_seconds={m: sum(r.first_token_seconds[m] for r in results) / len(results)
                                  for m in results[0].first_token_seconds},
        mean_seconds_per_request={m: totals[m] / len(results) for m in modes}, cost_per_request=cost,
        per_prompt=[{**asdict(r), "tau": r.tau} for r in results])
