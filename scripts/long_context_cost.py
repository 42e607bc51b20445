"""Peak memory and time of one training step at long sequences, for the shipped EAGLE-3, P-EAGLE and
DFlash recipes' drafters on a target's width.

    python scripts/long_context_cost.py [--target smollm2-135m] [--lengths 2048,8192,16384]
                                        [--kinds eagle3,p_eagle,dflash] [--shape llama-3.1-8b]

One step (forward, backward, AdamW) on one row of `length` tokens, its last 90% reply tokens, with
random features (the cost depends on the shapes only), in fp32, each (kind, length) in a process of its
own: "peak" is that process's peak resident memory during the step less what it held before it (the
target and drafter loaded), so it is what the step itself adds; "process peak" is the whole process's
peak resident memory, which is what the estimate below bounds from below.  The drafters are the recipes'
(`recipes/KIND-smollm2-135m.yaml`: layers, steps, block, draft vocabulary of its first ids).  A length
past the target's context is measured all the same (the drafter's rotary extends), and said.

`--shape llama-3.1-8b`: instead of `--target`, a stand-in with Llama-3.1-8B's configuration whose
embedding and lm_head only are made (random, fp32; the layers never run), and the drafter of
`recipes/KIND-llama-3.1-8b.yaml` where one exists (else the small recipe's, its layers scaled to 32).
Beside each measurement, the estimate `train` checks before any work (train/plan.py
`sequence_memory`: target, drafter state, activations extended from rows of 256 and 512 tokens): a
length whose estimate is past this machine's memory is not run, and said.
Prints one JSON line per measurement and a table."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


SHAPES = ("llama-3.1-8b", "tiny")      # scripts/rehearse.py's configurations


def shaped_target(shape: str):
    """A target of `shape`'s configuration with only its embedding and lm_head made (random): what a drafter's
    training step reads from its target."""
    from torch import nn
    from transformers import AutoModelForCausalLM, LlamaConfig

    from draftsmith.heads.runtime.identity import TargetIdentity
    from draftsmith.heads.runtime.target import Target
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
    from rehearse import LLAMA_31_8B, TINY
    config = LlamaConfig(**(LLAMA_31_8B if shape == "llama-3.1-8b" else TINY))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    for module in (model.get_input_embeddings(), model.get_output_embeddings()):
        module.weight = nn.Parameter(torch.randn(tuple(module.weight.shape), generator=generator) * 0.02,
                                     requires_grad=False)
    identity = TargetIdentity(name=shape, model_type="llama", vocab_size=config.vocab_size,
                              hidden_size=config.hidden_size, num_layers=config.num_hidden_layers, weights_sha256="")
    target = Target(model, None, shape, identity)
    target.layers_loaded = False
    return target


def one(kind: str, length: int, target_path: str, shape: str | None = None) -> dict:
    import yaml

    from draftsmith.heads.registry import registry
    from draftsmith.heads.runtime.target import Target
    from draftsmith.recipe_files import resolve_recipe
    from draftsmith.heads.infra.device import total_memory
    from draftsmith.train.plan import sequence_memory
    from draftsmith.train.settings import recipe_from_dict

    own = None
    if shape == "llama-3.1-8b":
        try:
            own = resolve_recipe(f"{kind}-llama-3.1-8b")
        except Exception:       # no 8B recipe of this kind: the small one's drafter
            own = None
    raw = yaml.safe_load((own or resolve_recipe(f"{kind}-smollm2-135m")).read_text())
    target = shaped_target(shape) if shape else Target.load(target_path, "float32", "cpu")
    drafter_settings = dict(raw["drafter"])
    if drafter_settings.get("layer_ids") and own is None:     # the recipe's layers, scaled to this target's depth
        n = target.num_layers
        drafter_settings["layer_ids"] = [max(1, min(n, round(i * n / 30))) for i in drafter_settings["layer_ids"]]
    if drafter_settings.get("draft_vocab_size"):    # at most the target's vocabulary (a small test target)
        drafter_settings["draft_vocab_size"] = min(drafter_settings["draft_vocab_size"], target.vocab_size)
    estimate = sequence_memory(recipe_from_dict({"method": kind, "drafter": drafter_settings,
                                                 "data": {"max_seq_len": length},
                                                 "train": {"batch_size": 1, "mixed_precision": "no"}}), target)
    estimated = estimate and estimate["target"] + estimate["drafter_state"] + estimate["activations"]
    row = {"kind": kind, "length": length, "shape": shape or target_path, "recipe": (own or
           resolve_recipe(f"{kind}-smollm2-135m")).name, "estimate_gib": round(estimated / 2 ** 30, 3)
           if estimated else None,
           "estimate_parts_gib": {part: round(estimate[part] / 2 ** 30, 3)
                                  for part in ("target", "drafter_state", "activations")} if estimate else None}
    if estimated and estimated > total_memory("cpu"):
        return {**row, "skipped": f"the estimate is past this machine's {total_memory('cpu') / 2 ** 30:.1f} GiB"}
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
    before = reset_peak()            # the estimate's probes above raised the peak: start it again here
    start = time.perf_counter()
    out = drafter.loss(batch)
    out.loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM") - before
    context = target.context_length
    return {**row, "seconds": round(seconds, 2), "peak_gib": round(peak / 2 ** 20, 3),
            "process_peak_gib": round(status_kib("VmHWM") / 2 ** 20, 3),
            "loss": round(float(out.loss), 4), "past_context": bool(context and length > context),
            "threads": torch.get_num_threads()}


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak() -> int:
    """Start this process's peak resident memory (VmHWM) again at what it holds now; that, in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--lengths", default="2048,8192,16384")
    parser.add_argument("--kinds", default="eagle3,p_eagle,dflash")
    parser.add_argument("--shape", choices=SHAPES, help="a stand-in target of this configuration (see above)")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.target, args.shape)), flush=True)
        return
    rows = []
    for kind in args.kinds.split(","):
        for length in (int(x) for x in args.lengths.split(",")):
            done = subprocess.run([sys.executable, __file__, "--target", args.target, "--one", kind, str(length)]
                                  + (["--shape", args.shape] if args.shape else []), capture_output=True, text=True)
            if done.returncode != 0:
                row = {"kind": kind, "length": length, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
            else:
                row = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| drafter | tokens | step s | peak GiB | process peak GiB | estimate GiB (train's check) |"
          "\n|---|---|---|---|---|---|")
    for row in rows:
        estimate = f"{row['estimate_gib']:.2f}" if row.get("estimate_gib") is not None else "not made"
        if "error" in row:
            print(f"| {row['kind']} | {row['length']} | failed: {row['error'][:80]} | | | |")
        elif "skipped" in row:
            print(f"| {row['kind']} | {row['length']} | not run: {row['skipped']} | | | {estimate} |")
        else:
            print(f"| {row['kind']} | {row['length']} | {row['seconds']:.2f} | {row['peak_gib']:.2f} | "
                  f"{row['process_peak_gib']:.2f} | {estimate} |")
    sys.exit(1 if any("error" in row for row in rows) else 0)


if __name__ == "__main__":
    main()
