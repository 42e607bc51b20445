"""A drafter's whole proposal against a one-token target forward, in ms, measured interleaved.

    .venv/bin/python scripts/bench_draft_step.py [--target smollm2-135m] [--dtype bfloat16] [--depth 4]
        [--kinds eagle3 p_eagle dflash] [--repeats 15]

Each drafter is built fresh for the target with its shipped recipe's settings (recipes/<kind>-smollm2-135m.yaml
when there is one, weights do not change the cost) and proposes a chain of `depth` after one newly committed
token, over a 200-token context: EAGLE-3 pays `depth` drafter forwards, P-EAGLE and DFlash one.  Every
repeat times the target forward and each drafter once, so a slow spell of a shared machine lands on all.
Prints the medians and each proposal's share of the target forward.
"""
import argparse
import time
from pathlib import Path

import torch

from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.drafter import DraftContext
from draftsmith.heads.registry import drafter_class
from draftsmith.heads.runtime.target import Target
from draftsmith.train.settings import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def build(kind: str, target: Target, depth: int):
    recipe = RECIPES / f"{kind}-smollm2-135m.yaml"
    cls = drafter_class(kind)
    config = load_recipe(recipe).drafter if recipe.is_file() else cls.config_class()
    drafter = cls(config, target).to(target.dtype).eval()
    drafter.set_proposal(tree=TreeSettings.chain(depth))
    return drafter


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--kinds", nargs="+", default=["eagle3", "p_eagle", "dflash"])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    target = Target.load(args.target, args.dtype)
    drafters = {kind: build(kind, target, args.depth) for kind in args.kinds}
    layers = sorted({i for d in drafters.values() for i in d.required_layers})
    n = args.context
    ids = torch.randint(0, target.vocab_size, (1, n + args.repeats + 2))
    cache = target.new_cache(1, n + args.repeats + 4)
    hidden = target.forward_block(cache, ids[:, :n], torch.arange(n)[None], layer_ids=layers,
                                  logits="none").hidden_states
    for d in drafters.values():
        d.reset()
        d.propose(DraftContext(ids[0, :n], {i: h[0] for i, h in hidden.items()}, int(ids[0, n]), n))
    times = {name: [] for name in ["target", *drafters]}
    for r in range(args.repeats):
        position = n + r
        start = time.perf_counter()
        out = target.forward_block(cache, ids[:, position:position + 1], torch.tensor([[position]]),
                                   layer_ids=layers, logits="all")
        times["target"].append(time.perf_counter() - start)
        step = {i: h[0] for i, h in out.hidden_states.items()}
        for kind, d in drafters.items():
            context = DraftContext(ids[0, position:position + 1], step, int(ids[0, position + 1]), position + 1)
            start = time.perf_counter()
            d.propose(context)
            times[kind].append(time.perf_counter() - start)
    median = {k: sorted(v)[len(v) // 2] * 1000 for k, v in times.items()}
    print(f"{args.target} ({args.dtype}), {torch.get_num_threads()} threads, context {n}, chain of {args.depth}, "
          f"median of {args.repeats}")
    print(f"  target one-token forward  {median['target']:7.2f} ms")
    for kind, d in drafters.items():
        print(f"  {kind:<9} proposal        {median[kind]:7.2f} ms  = {median[kind] / median['target']:6.1%} of it  "
              f"({d.describe_proposal()})")


if __name__ == "__main__":
    main()
