"""What rolling back a recurrent layer costs, two ways, measured side by side on one hybrid target.

    python scripts/rollback_cost.py TARGET [--prompt 64] [--draft 4] [--accepted 1] [--repeats 9]

A verification forward reads the root and `--draft` drafted tokens; the target accepts `--accepted` of them.
Attention layers then just forget the rejected slots; a recurrent layer's state has already read them:
- recorded (what draftsmith does, heads/runtime/engine.py): the forward records each token's state, and
  the rejected tail is cropped away;
- re-run: the forward records nothing; the state is copied before it, restored after, and the root plus
  the accepted tokens are run again.
Prints the median milliseconds of each (forward included) and of a plain one-token forward, for scale.
TARGET: a local Hugging Face directory of a model with linear-attention or Mamba layers."""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from draftsmith.heads.runtime import engine
from draftsmith.heads.runtime.target import Target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--draft", type=int, default=4)
    parser.add_argument("--accepted", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if not 0 <= args.accepted <= args.draft:
        parser.error("--accepted must be within 0..--draft")
    target = Target.load(args.target, "float32", "cpu")
    if not target.recurrent:
        parser.error(f"target '{args.target}' has no recurrent layers: nothing to roll back")
    torch.manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (1, args.prompt))
    block = torch.randint(0, target.vocab_size, (1, args.draft + 1))
    kept = args.accepted + 1
    positions = torch.arange(args.prompt, args.prompt + args.draft + 1)[None]

    def prefilled(record: bool) -> engine.EngineCache:
        cache = target.new_cache(1, args.prompt + 2 * (args.draft + 1))
        if not record:
            for layer in cache.recurrent.layers:
                layer.record_past = False
        target.forward_block(cache, prompt, torch.arange(args.prompt)[None], logits="none")
        cache._recorded = record            # nothing recorded: nothing to commit before the next block
        return cache

    def recorded() -> float:
        cache = prefilled(True)
        start = time.perf_counter()
        target.forward_block(cache, block, positions, logits="all")
        cache.truncate(args.prompt + kept)
        cache.commit_recurrent()
        return time.perf_counter() - start

    def rerun() -> float:
        cache = prefilled(False)
        start = time.perf_counter()
        saved = copy.deepcopy(cache.recurrent.layers)
        target.forward_block(cache, block, positions, logits="all")
        cache.recurrent.layers = saved                             # the state before the block ...
        cache._recorded = False
        cache.length = args.prompt
        cache.valid[:, args.prompt:] = False
        target.forward_block(cache, block[:, :kept], positions[:, :kept], logits="none")   # ... and the kept tokens
        return time.perf_counter() - start

    def single() -> float:
        cache = prefilled(True)
        start = time.perf_counter()
        target.forward_block(cache, block[:, :1], positions[:, :1], logits="all")
        return time.perf_counter() - start

    times = {"recorded + crop": [], "copy + re-run": [], "one-token forward": []}
    with torch.no_grad():
        for _ in range(args.repeats):              # interleaved: a slow spell lands on all three
            times["recorded + crop"].append(recorded())
            times["copy + re-run"].append(rerun())
            times["one-token forward"].append(single())
    print(f"target {target.name} ({target.config.model_type}), prompt {args.prompt}, block {args.draft + 1}, "
          f"kept {kept}, {args.repeats} repeats, median ms:")
    for name, values in times.items():
        print(f"  {name:18s} {statistics.median(values) * 1000:8.2f}")


if __name__ == "__main__":
    main()
