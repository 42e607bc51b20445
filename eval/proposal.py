"""The proposal on this machine: its shape (tuned to measured forward costs), the context lookup, and
what a target forward and a drafter step cost here (docs/metrics.md, "Speed")."""
from __future__ import annotations

import logging
import time

import torch

from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.lookup import WithLookup
from draftsmith.heads.decoding.settings import EvalSettings
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import DraftContext
from draftsmith.heads.infra.device import synchronize
from draftsmith.heads.runtime.engine import TreeOverRecurrentLayers
from draftsmith.heads.runtime.target import Target

from .prompts import load_prompts

log = logging.getLogger(__name__)


def configure_proposal(drafter, target: Target, options: EvalSettings):
    """Set the drafter's proposal shape and return the drafter to decode with: the same one, or wrapped with
    the context lookup when options.lookup asks for it.  A shape tuned here is written back into options
    (tree_size, tree_depth_topk_total), so a second call, the fp32 exactness check's, reuses it.

    A target with recurrent layers verifies chains only (heads/runtime/engine.py): a tree asked of it is
    refused in one line; its default proposal is a chain, said once."""
    if target.recurrent:
        if options.proposal == "tree" or options.lookup:
            raise TreeOverRecurrentLayers()
        if options.proposal == "default":
            log.warning("target '%s' has recurrent layers, over which a tree cannot be verified: proposing a "
                        "chain of %s", target.name, options.chain_length or "the drafter's own length")
        options.proposal = "chain"
    if options.proposal == "chain":
        drafter.set_proposal(chain=options.chain_length)
    elif drafter.static_tree:                     # static trees (Medusa)
        options.tree_size = options.tree_size or tune_tree_size(drafter, target, options.lookup)
        drafter.set_proposal(tree=drafter.default_tree(options.tree_size))
    elif not drafter.dynamic_tree:                # neither kind of tree: a chain of the drafter's own length
        drafter.set_proposal(chain=options.chain_length)
    elif options.tree_depth_topk_total:           # a dynamic tree tuned by an earlier call
        drafter.set_proposal(tree=TreeSettings(*options.tree_depth_topk_total))
    elif options.tree_size is None and options.proposal == "default":   # dynamic trees: measured here
        drafter.set_proposal(tree=tune_dynamic_tree(drafter, target, options))
    else:
        drafter.set_proposal(tree_size=options.tree_size)
    return with_lookup(drafter, options)


def block_cost(target: Target, sizes: list[int], context: int = 200, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after `context` cached tokens.

    The sizes are measured interleaved (every size once per repeat), so a slow spell of a shared
    machine lands on all of them instead of making one size look dear."""
    cache = target.new_cache(1, context + max(sizes) + 1)
    ids = torch.randint(0, target.vocab_size, (1, context), device=target.device)
    target.forward_block(cache, ids, torch.arange(context, device=target.device)[None], logits="none")
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            block = torch.randint(0, target.vocab_size, (1, n), device=target.device)
            synchronize(target.device)
            t = time.perf_counter()
            target.forward_block(cache, block, torch.arange(context, context + n, device=target.device)[None],
                                 logits="all")
            synchronize(target.device)
            times[n].append(time.perf_counter() - t)
            cache.truncate(context)
    return {n: sorted(ts)[len(ts) // 2] for n, ts in times.items()}


def nondecreasing(costs: dict[int, float]) -> dict[int, float]:
    """The closest costs (least squares) that never fall as the block grows: a forward over more tokens is
    not cheaper, so where a larger block measured cheaper, noise did it, and both get their mean
    (pool-adjacent-violators).  Without this the tuner's pick among near-equal sizes follows the noise."""
    blocks: list[list[float]] = []                       # [mean, count] of pooled runs, in size order
    for n in sorted(costs):
        blocks.append([costs[n], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fitted = [mean for mean, count in blocks for _ in range(count)]
    return dict(zip(sorted(costs), fitted))


def tune_tree_size(drafter, target: Target, lookup: int = 0) -> int:
    """The static tree size with the best expected tokens per second on this machine.

    `lookup`: nodes a context lookup may add to every tree, costed with it (what it accepts is not
    modelled, and does not depend much on the tree's size)."""
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    costs = nondecreasing(block_cost(target, [s + 1 + lookup for s in sizes]))
    rates = drafter.metadata.get("topk_accuracy")
    best = max(sizes, key=lambda s: (1 + drafter.default_tree(s).expected_accepted(rates or [[0.0]]))
               / costs[s + 1 + lookup] if rates else -s)
    log.info("tree size %d (forward costs: %s)", best, {k - 1: round(v * 1000, 1) for k, v in costs.items()})
    return best


def with_lookup(drafter, options: EvalSettings):
    """The drafter, with the context lookup merged into its proposals when options.lookup asks for it."""
    if not options.lookup:
        return drafter
    return WithLookup(drafter, options.lookup, options.lookup_ngram)


DYNAMIC_TREES = [(1, 1, 1), (2, 1, 2), (3, 1, 3), (4, 1, 4), (5, 1, 5), (3, 2, 6), (4, 3, 10), (4, 4, 14), (5, 8, 32)]


def tune_dynamic_tree(drafter, target: Target, options: EvalSettings):
    """The (depth, top_k, total_tokens) with the most tokens/s on a calibration prompt, measured on this machine.

    The drafter's own default joins the candidates.  Costs a few seconds; the calibration
    prompt is MT-bench's first, decoded for 48 tokens per candidate."""
    prompt = load_prompts(target, options.prompts, 1)[0][1]    # not MT-bench's: its package may be absent
    default = drafter.config.tree
    candidates = DYNAMIC_TREES + [(default["depth"], default["top_k"], default["total_tokens"])]
    deepest = getattr(drafter, "max_proposal_depth", None)        # a drafter that refuses deeper proposals (MTP)
    if deepest:
        candidates = [c for c in candidates if c[0] <= deepest]
    rates = {}
    for depth, top_k, total in dict.fromkeys(candidates):
        drafter.set_proposal(tree=TreeSettings(depth, top_k, total))
        run = decode(target, prompt, 48, drafter)
        rates[(depth, top_k, total)] = len(run.tokens) / run.seconds
    best = max(rates, key=rates.get)
    log.info("dynamic tree %s (tokens/s by (depth, top_k, total): %s)", best,
             {k: round(v, 1) for k, v in rates.items()})
    options.tree_depth_topk_total = best
    return TreeSettings(*best)


def step_costs(target: Target, drafter, prompt: list[int]) -> dict:
    """Median ms of a one-token target forward and of one drafter step (a proposal divided by its depth)."""
    forward = block_cost(target, [1])[1] * 1000
    step = measure_draft_step(target, drafter, prompt) * 1000 if drafter is not None else None
    return {"target_forward_ms": forward, "draft_step_ms": step}


def measure_draft_step(target: Target, drafter, prompt: list[int], repeats: int = 7) -> float:
    """Median seconds of one drafter step in steady state: a proposal after one newly committed token,
    divided by the levels it drafts (an EAGLE level is one drafter forward; Medusa drafts all at once)."""
    # a dynamic tree's depth; a static tree, or a parallel drafter's whole proposal, is one step
    levels = 1 if getattr(drafter, "one_forward", False) else getattr(drafter.tree, "depth", 1)
    return measure_proposal(target, drafter, prompt, repeats) / levels


@torch.no_grad()
def measure_proposal(target: Target, drafter, prompt: list[int], repeats: int = 7) -> float:
    """Median seconds of one whole proposal (the drafter's current shape) in steady state: after one
    newly committed token, its hidden states already computed by the target."""
    repeats = max(1, min(repeats, len(prompt) - 2))
    ids = torch.tensor([prompt], device=target.device)
    cache = target.new_cache(1, len(prompt) + 1)
    hidden = target.forward_block(cache, ids, torch.arange(len(prompt), device=target.device)[None],
                                  layer_ids=drafter.required_layers, logits="none").hidden_states
    start = len(prompt) - repeats - 1
    drafter.reset()
    drafter.propose(DraftContext(tokens=ids[0, :start], hidden={i: h[0, :start] for i, h in hidden.items()},
                                 next_token=prompt[start], position=start))
    times = []
    for j in range(start, start + repeats):
        context = DraftContext(tokens=ids[0, j:j + 1], hidden={i: h[0, j:j + 1] for i, h in hidden.items()},
                               next_token=prompt[j + 1], position=j + 1)
        synchronize(target.device)
        t = time.perf_counter()
        drafter.propose(context)
        synchronize(target.device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]
