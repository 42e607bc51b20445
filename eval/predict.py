"""The speedup predicted before serving (docs/bench.md, "Prediction"): from a drafter's acceptance profile
and the measured cost of a speculative step, the speedup at each batch size b and draft length K, the K
to serve at each batch size, and, with no drafter yet, the acceptance a drafter would need to pay.

    E(K) = 1 + a_0 + ... + a_{K-1}       tokens a chain of K drafts emits per step (a_j: the share of
                                          steps whose first j+1 drafts are all accepted, docs/metrics.md)
    S(b, K) = E(K) * T(b, 0) / (T(b, K) + D(b, K))

T(b, K): one target forward over b rows of 1+K new tokens after `context` cached ones; D(b, K): the
drafter proposing K tokens for b rows.  K = 0 is plain decoding (S = 1).  Both are measured on this
machine and kept per machine, stack, target, dtype and drafter (`cost_table`): a second prediction costs
nothing, and a table measured elsewhere is measured again, said in one line."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftsmith.heads.infra.device import synchronize

from .costs import CONTEXT, CostTable, cost_path, keep_table, kept_table, machine_name
from .proposal import measure_proposal, nondecreasing


BATCHES = (1, 2, 4, 8, 16, 32)
KS = tuple(range(9))


class PredictError(ValueError):
    """A prediction that cannot be made as asked (no acceptance profile, another target's)."""


# -- the model ---------------------------------------------------------------------------------------------

def expected_tokens(unconditional: list[float], k: int) -> float:
    """E(K): tokens per step of a chain of k drafts, from unconditional per-position acceptance."""
    if k > len(unconditional):
        raise PredictError(f"an acceptance profile of {len(unconditional)} positions cannot price a chain of {k}")
    return 1.0 + sum(unconditional[:k])


def unconditional_from(conditional: list[float]) -> list[float]:
    """a_j = c_0 * ... * c_j: conditional rates (held-out agreement, c_j given the first j accepted) made
    unconditional."""
    out, running = [], 1.0
    for c in conditional:
        running *= c
        out.append(running)
    return out


def speedup(tokens_per_step: float, plain: float, verify: float, draft: float) -> float:
    """S: the speedup over plain decoding of a proposal that commits `tokens_per_step` per verification, when
    a plain step costs `plain`, a verification `verify` and a proposal `draft` (any one unit).  The one model
    behind bench --predict and eval's choice of proposal (eval/decision.py)."""
    return tokens_per_step * plain / (verify + draft)


def speedups(profile: list[float], costs: CostTable) -> dict[int, dict[int, float]]:
    """S(b, K) for every measured b and every K the profile covers (K = 0 included: 1.0)."""
    out = {}
    for b, row in costs.verify_ms.items():
        draft = costs.draft_ms[b]
        out[b] = {k: speedup(expected_tokens(profile, k), row[0], row[k], draft[k])
                  for k in sorted(row) if k <= len(profile) and k in draft}
    return out


def choose(table: dict[int, dict[int, float]]) -> dict[int, int]:
    """The K with the highest predicted speedup at each batch size; 0 (no speculation) unless one beats 1."""
    return {b: max(row, key=lambda k: (row[k], -k)) if max(row.values()) > 1.0 else 0 for b, row in table.items()}


def vllm_schedule(choices: dict[int, int]) -> list[list[int]]:
    """vLLM's speculative_config.num_speculative_tokens_per_batch_size: inclusive batch ranges [start, end, K]
    from 1 up, each measured batch size's K holding up to the next measured size (the last to its own)."""
    sizes = sorted(choices)
    ranges: list[list[int]] = []
    for i, b in enumerate(sizes):
        start = 1 if i == 0 else sizes[i - 1] + 1
        end = b if i + 1 < len(sizes) else b
        if ranges and ranges[-1][2] == choices[b]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, choices[b]])
    return ranges


def break_even(costs: CostTable) -> dict[int, dict[int, float | None]]:
    """The conditional acceptance rate c (the same at every position) a drafter needs for S(b, K) = 1:
    the smallest c with (1 - c^(K+1)) / (1 - c) >= (T(b, K) + D(b, K)) / T(b, 0); None where even c = 1
    (every draft accepted) does not pay."""
    out: dict[int, dict[int, float | None]] = {}
    for b, row in costs.verify_ms.items():
        out[b] = {}
        for k in sorted(row):
            if k == 0 or k not in costs.draft_ms[b]:
                continue
            need = (row[k] + costs.draft_ms[b][k]) / row[0]
            if k + 1 < need:
                out[b][k] = None
                continue
            low, high = 0.0, 1.0
            for _ in range(50):
                mid = (low + high) / 2
                low, high = (mid, high) if sum(mid ** i for i in range(k + 1)) < need else (low, mid)
            out[b][k] = high
    return out


# -- the acceptance profile ---------------------------------------------------------------------------------

@dataclass
class Profile:
    unconditional: list[float]          # a_j by position
    source: str                         # where it was read
    depth: int                          # the most drafts the drafter proposes
    notes: list[str] = field(default_factory=list)


def profile_of(checkpoint: Path, depth: int) -> Profile:
    """The checkpoint's acceptance profile: its last evaluation's per-position acceptance where that was a
    greedy chain (measured decoding), else its held-out teacher-forced agreement (simulated, from training).
    Which target it belongs to is checked where its drafter loads (load_drafter: the identity check)."""
    from draftsmith.heads.card import read_last_eval
    from draftsmith.heads.drafter import read_config
    checkpoint = Path(checkpoint)
    config = read_config(checkpoint)
    report = read_last_eval(checkpoint, {"per_position_acceptance": list, "proposal": str})
    if report is not None:
        rates, proposal = report.get("per_position_acceptance") or [], str(report.get("proposal", ""))
        if rates and "chain" in proposal and "tree" not in proposal and report.get("temperature", 0) == 0:
            return Profile(list(rates), f"measured: the last eval ({report.get('date', '?')}, {proposal}, "
                           f"{report.get('prompts', '?')} prompts of {report.get('prompts_source', '?')})", depth)
    agreement = (config.get("heldout") or {}).get("heldout/agreement")
    if agreement:
        return Profile(unconditional_from(list(agreement)), "simulated: held-out teacher-forced agreement from "
                       "training (an eval with --chain gives a measured one)", depth)
    raise PredictError(f"{checkpoint} has no acceptance profile: neither a greedy chain evaluation (draftsmith "
                       f"eval {checkpoint} --chain) nor held-out agreement from training; evaluate it first")


# -- measuring the costs --------------------------------------------------------------------------------------

def cost_table(target, drafter, batches=BATCHES, ks=KS, context: int = CONTEXT, refresh: bool = False,
               drafter_name: str = "") -> CostTable:
    """The draftsmith engine's cost table for this target and drafter: read from the cache when it was
    measured under the same conditions, else measured now (and the reason said) and kept."""
    conditions = {"machine": machine_name(target.device), "stack": "draftsmith",
                  "target": target.identity.weights_sha256, "dtype": str(target.dtype).replace("torch.", ""),
                  "drafter": drafter_name, "context": context}
    path = cost_path("draftsmith", conditions)
    if (kept := kept_table(path, conditions, batches, ks, refresh)) is not None:
        return kept
    verify = measure_verify(target, batches, ks, context)
    return keep_table(CostTable(**conditions, verify_ms=verify,
                                draft_ms=measure_draft(target, drafter, batches, ks, context, verify)), path)


@torch.no_grad()
def measure_verify(target, batches, ks, context: int, repeats: int = 5) -> dict[int, dict[int, float]]:
    """T(b, K) in ms: the median of `repeats` target forwards over b rows of 1+K tokens after `context`
    cached tokens, every K measured once per repeat (interleaved: a slow spell lands on all of them),
    made nondecreasing in K (eval/proposal.py: a forward over more tokens is not cheaper)."""
    out = {}
    for b in batches:
        cache = target.new_cache(b, context + max(ks) + 2)
        ids = torch.randint(0, target.vocab_size, (b, context), device=target.device)
        target.forward_block(cache, ids, torch.arange(context, device=target.device).expand(b, -1), logits="none")
        times: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(repeats):
            for k in ks:
                block = torch.randint(0, target.vocab_size, (b, k + 1), device=target.device)
                positions = torch.arange(context, context + k + 1, device=target.device).expand(b, -1)
                synchronize(target.device)
                start = time.perf_counter()
                target.forward_block(cache, block, positions, logits="all")
                synchronize(target.device)
                times[k].append((time.perf_counter() - start) * 1000)
                cache.truncate(context)
        out[b] = nondecreasing({k: sorted(t)[len(t) // 2] for k, t in times.items()})
    return out


@torch.no_grad()
def measure_draft(target, drafter, batches, ks, context: int, verify: dict) -> dict[int, dict[int, float]]:
    """D(b, K) in ms.  D(1, K): the measured proposal of a chain of K after one committed token (a K past
    the drafter's depth: not measured, never chosen).  draftsmith's drafters propose for one sequence, so for
    b > 1 the model takes the drafter's forward to scale with the rows as the target's one-token forward
    does: D(b, K) = D(1, K) * T(b, 0) / T(1, 0) (both are decoder layers over b rows of one token)."""
    prompt = torch.randint(0, target.vocab_size, (context,)).tolist()
    one = {0: 0.0}
    for k in ks:
        if k == 0 or k > drafter.draft_positions:
            continue
        drafter.set_proposal(chain=k)
        one[k] = measure_proposal(target, drafter, prompt) * 1000
    one = nondecreasing(one)          # drafting more is not cheaper: where it measured so, noise did it
    first = min(verify)
    return {b: {k: v * verify[b][0] / verify[first][0] for k, v in one.items()} for b in batches}


# -- the verbs: bench --predict and bench --break-even ----------------------------------------------------

def vllm_config(kind: str, choices: dict[int, int]) -> dict:
    """vLLM's speculative_config for the chosen K per batch size: the largest K as num_speculative_tokens and
    the schedule where K changes; {} where no batch size gains (serve without speculation)."""
    from draftsmith.heads.formats import formats_of
    top = max(choices.values(), default=0)
    if top == 0:
        return {}
    served_as = formats_of(kind).get("vllm")
    config = {"method": served_as.method if served_as is not None and served_as.method else kind,
              "num_speculative_tokens": top}
    if served_as is not None and served_as.parallel_drafting:
        config["parallel_drafting"] = True
    if len(set(choices.values())) > 1:
        config["num_speculative_tokens_per_batch_size"] = vllm_schedule(choices)
    return config


def cost_context(context: int | None) -> int:
    """The cached tokens a step is timed after: `--cost-context`, else CONTEXT."""
    if context is None:
        return CONTEXT
    if context < 1:
        raise PredictError(f"--cost-context {context}: the cached tokens a step is timed after must be at least 1")
    return context


def bound_context(context: int, target, batches, ks) -> None:
    """A --cost-context the target and the machine can time: within the target's positions (with the tokens
    each timing adds after it), and a KV cache of the largest batch under half the device's memory."""
    from draftsmith.heads.infra.device import total_memory

    from .predict_vllm import NEW_TOKENS
    reach = context + NEW_TOKENS + max(ks, default=0) + 16
    if target.context_length is not None and reach > target.context_length:
        raise PredictError(f"--cost-context {context}: a step timed there reaches position {reach}, past the "
                           f"{target.context_length} positions of target '{target.name}' (max_position_embeddings); "
                           f"give at most {max(1, target.context_length - reach + context)}")
    config = target.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * target.num_layers * heads * head_dim * torch.finfo(target.dtype).bits // 8 * max(batches) * reach
    total = total_memory(target.device)
    if kv > total // 2:
        raise PredictError(f"--cost-context {context}: the KV cache of {max(batches)} sequences of {reach} tokens "
                           f"takes {kv / 2 ** 30:.1f} GiB, more than half of the {total / 2 ** 30:.1f} GiB "
                           f"{target.device} has; give a shorter context or smaller --batch-sizes")


def predict_report(checkpoint: str, out: Path, dtype: str = "auto", device: str = "auto", target_path=None,
                   batches=BATCHES, ks=KS, refresh: bool = False, engine: str = "draftsmith",
                   vllm_python: str | None = None, context: int | None = None) -> dict:
    """`bench CKPT --predict`: S(b, K) for the checkpoint's drafter on this machine, the K chosen per batch
    size and vLLM's speculative_config for it (predict.json, predict.md, predict.png in `out`).  engine:
    whose step costs price it, draftsmith's engine or vLLM's (eval/predict_vllm.py: whole steps); context:
    the cached tokens each step is timed after (the traffic's typical length while it decodes; None: CONTEXT)."""
    if engine not in ("draftsmith", "vllm"):
        raise PredictError(f"--predict prices steps in draftsmith's engine or in vllm; got --engine {engine}")
    context = cost_context(context)
    from draftsmith.heads.drafter import checkpoint_target, load_drafter, read_config
    from draftsmith.heads.infra.device import resolve_device
    from draftsmith.heads.runtime.target import resolve_dtype

    config = read_config(Path(checkpoint))
    resolved = resolve_device(device)
    target = checkpoint_target(config, resolve_dtype(dtype, resolved), resolved, target_path)
    bound_context(context, target, batches, ks)
    drafter = load_drafter(Path(checkpoint), target)       # a checkpoint of another target is refused here
    drafter = drafter.to(target.dtype)
    profile = profile_of(Path(checkpoint), drafter.draft_positions)
    deepest = min(drafter.draft_positions, len(profile.unconditional))
    if max(ks) > deepest:
        why = (f"its drafter proposes at most {drafter.draft_positions}" if deepest == drafter.draft_positions
               else f"the acceptance profile covers {deepest} positions")
        profile.notes.append(f"K above {deepest} left out: {why}")
        ks = tuple(k for k in ks if k <= deepest)
    if engine == "vllm":
        from draftsmith.heads.formats import formats_of
        served_as = formats_of(config["kind"]).get("vllm")
        if served_as is not None and (served_as.whole_depth or served_as.serving_k) and set(ks) - {0, deepest}:
            profile.notes.append(f"K = {deepest} only: vLLM drafts all {deepest} positions of a {config['kind']} "
                                 "drafter each step, whatever K it is given" if served_as.whole_depth else
                                 f"K = {deepest} only: a {config['kind']} drafter is served at the K of its block")
            ks = tuple(sorted({k for k in ks if k == 0} | {deepest}))
    weights = hashlib.sha256((Path(checkpoint) / "model.safetensors").read_bytes()).hexdigest()[:16] \
        if (Path(checkpoint) / "model.safetensors").is_file() else "?"
    if engine == "vllm":
        from .predict_vllm import vllm_cost_table
        costs = vllm_cost_table(str(checkpoint), config, target_path, batches, ks, dtype, vllm_python, refresh,
                                context=context, out_dir=Path(out) / "vllm-costs")
    else:
        costs = cost_table(target, drafter, batches, ks, context=context, refresh=refresh,
                           drafter_name=f"{config['kind']} {weights}")
    table = speedups(profile.unconditional, costs)
    choices = choose(table)
    report = {"checkpoint": str(checkpoint), "kind": config["kind"], "profile": asdict(profile),
              "costs": asdict(costs), "speedup": table, "chosen_k": choices,
              "speculative_config": vllm_config(config["kind"], choices)}
    write_report(report, Path(out), "predict")
    return report


def break_even_report(target_path: str, out: Path, kind: str = "eagle3", dtype: str = "auto", device: str = "auto",
                      batches=BATCHES, ks=KS, refresh: bool = False, context: int | None = None) -> dict:
    """`bench TARGET --break-even`: the conditional acceptance a drafter of `kind` (the recipe defaults,
    untrained: its cost does not depend on its weights) would need at each batch size and K to pay."""
    from draftsmith.heads.infra.device import resolve_device
    from draftsmith.heads.registry import registry
    from draftsmith.heads.runtime.target import Target, resolve_dtype

    context = cost_context(context)
    resolved = resolve_device(device)
    target = Target.load(target_path, resolve_dtype(dtype, resolved), resolved)
    bound_context(context, target, batches, ks)
    kinds = registry()
    if kind not in kinds:
        raise PredictError(f"--kind {kind} is not a drafter kind; the kinds: {', '.join(sorted(kinds))}")
    settings = kinds[kind].config_class()                  # the recipe defaults of that kind
    if (getattr(settings, "draft_vocab_size", None) or 0) > target.vocab_size:   # a small vocabulary: all of it
        settings.draft_vocab_size = None
    torch.manual_seed(0)
    drafter = kinds[kind](settings, target).to(target.device, target.dtype).eval()
    ks = tuple(k for k in ks if k <= drafter.draft_positions)
    costs = cost_table(target, drafter, batches, ks, context=context, refresh=refresh,
                       drafter_name=f"{kind} untrained (recipe defaults)")
    report = {"target": target_path, "kind": kind, "costs": asdict(costs), "break_even": break_even(costs)}
    write_report(report, Path(out), "break-even")
    return report


def markdown(report: dict) -> str:
    costs = report["costs"]
    whole = costs["stack"].startswith("vllm")
    lines = [f"# {'Predicted speedup' if 'speedup' in report else 'Break-even acceptance'}", "",
             f"- costs: {costs['stack']} on {costs['machine']}, {costs['dtype']}, {costs['context']} cached "
             f"tokens; drafter {costs['drafter']}; "
             + ("whole speculative steps timed in vLLM" if whole else "target forward and drafter proposal timed apart")
             + " (docs/bench.md, \"Prediction\")"]
    if "speedup" in report:
        profile = report["profile"]
        lines += [f"- acceptance profile ({profile['source']}): "
                  + " ".join(f"{a:.3f}" for a in profile["unconditional"])]
        lines += [f"- {note}" for note in profile["notes"]]
        table, pick = report["speedup"], report["chosen_k"]
        ks = sorted({k for row in table.values() for k in row})
        lines += ["", "| batch | " + " | ".join(f"K={k}" for k in ks) + " | chosen K |",
                  "|---:|" + "---:|" * (len(ks) + 1)]
        for b in sorted(table):
            lines.append(f"| {b} | " + " | ".join(f"{table[b][k]:.2f}" if k in table[b] else "-" for k in ks)
                         + f" | {pick[b]} |")
        config = report["speculative_config"]
        lines += ["", "vLLM speculative_config: " + (json.dumps(config) if config else
                                                     "none: no batch size is predicted to gain; serve without it")]
    else:
        table = report["break_even"]
        ks = sorted({k for row in table.values() for k in row})
        lines += ["", "The conditional acceptance a drafter needs at every position for speculation to pay "
                  "(S = 1); '-': not even with every draft accepted.", "",
                  "| batch | " + " | ".join(f"K={k}" for k in ks) + " |", "|---:|" + "---:|" * len(ks)]
        for b in sorted(table):
            lines.append(f"| {b} | " + " | ".join("-" if table[b].get(k) is None else f"{table[b][k]:.2f}"
                                                  for k in ks) + " |")
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(markdown(report))
    plot(report, out / f"{name}.png")


def plot(report: dict, path: Path) -> None:
    import matplotlib  # heavy: only when a report draws its plot
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: only when a report draws its plot
    table = report.get("speedup") or report["break_even"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for b in sorted(table, key=int):
        ks = sorted(k for k, v in table[b].items() if v is not None)
        ax.plot(ks, [table[b][k] for k in ks], marker="o", label=f"batch {b}")
    if "speedup" in report:
        ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("K (draft tokens per step)")
    ax.set_ylabel("predicted speedup" if "speedup" in report else "conditional acceptance needed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
