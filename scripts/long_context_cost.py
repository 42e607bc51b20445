"""Peak memory and time of one training step at long sequences, for the shipped EAGLE-3, P-EAGLE and
DFlash recipes' drafters on a target's width.

    python scripts/long_context_cost.py [--target smollm2-135m] [--lengths 2048,8192,16384]
                                        [--kinds eagle3,p_eagle,dflash]

One step (forward, backward, AdamW) on one row of `length` tokens, its last 90% reply tokens, with
random features (the cost depends on the shapes only), in fp32, each (kind, length) in a process of its
own: "peak" is that process's peak resident memory less what it held before the step (the target and
drafter loaded), so it is what the step itself adds.  The drafters are the recipes'
(`recipes/KIND-smollm2-135m.yaml`: layers, steps, block, draft vocabulary of its first ids).  A length
past the target's context is measured all the same (the drafter's rotary extends), and said.
Prints one JSON line per measurement and a table."""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def one(kind: str, length: int, target_path: str) -> dict:
    import yaml

    from draftsmith.heads.registry import registry
    from draftsmith.heads.runtime.target import Target
    from draftsmith.recipe_files import resolve_recipe
    from draftsmith.train.settings import recipe_from_dict

    raw = yaml.safe_load(resolve_recipe(f"{kind}-smollm2-135m").read_text())
    target = Target.load(target_path, "float32", "cpu")
    drafter_settings = dict(raw["drafter"])
    if drafter_settings.get("layer_ids"):             # the recipe's layers, scaled to this target's depth
        n = target.num_layers
        drafter_settings["layer_ids"] = [max(1, min(n, round(i * n / 30))) for i in drafter_settings["layer_ids"]]
    if drafter_settings.get("draft_vocab_size"):    # at most the target's vocabulary (a small test target)
        drafter_settings["draft_vocab_size"] = min(drafter_settings["draft_vocab_size"], target.vocab_size)
    recipe = recipe_from_dict({"method": kind, "drafter": drafter_settings})
    torch.manual_seed(0)                              # the same drafter weights in every run: comparable losses
    drafter = registry()[kind](recipe.drafter, target)
    vocab = recipe.drafter.draft_vocab_size
    if vocab:
        drafter.set_draft_vocabulary(torch.arange(vocab))
    drafter.train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, length), generator=generator)
    reply = torch.zeros(1, length, dtype=torch.long)
    reply[:, length // 10:] = 1
    hidden = target.config.hidden_size
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": reply,
             "features": {layer: torch.randn(1, length, hidden, generator=generator)
                          for layer in drafter.required_layers}}
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = drafter.loss(batch)
    out.loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    context = target.context_length
    return {"kind": kind, "length": length, "seconds": round(seconds, 2), "peak_gib": round(peak / 2 ** 20, 3),
            "loss": round(float(out.loss), 4), "past_context": bool(context and length > context),
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument("--kinds", default="eagle3,p_eagle,dflash")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.target)), flush=True)
        return
    rows = []
    for kind in args.kinds.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            done = subprocess.run([sys.executable, __file__, "--target", args.target, "--one", kind, str(length)],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                row = {"kind": kind, "length": length, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| drafter | tokens | step s | peak GiB |\n|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['kind']} | {row['length']} | failed: {row['error'][:80]} | |")
        else:
            print(f"| {row['kind']} | {row['length']} | {row['seconds']:.2f} | {row['peak_gib']:.2f} |")
    sys.exit(1 if any("error" in row for row in rows) else 0)


if __name__ == "__main__":
    main()
