"""Does acceptance hold past the training length?  Two EAGLE-3 drafters on one target, trained alike on
the same long ShareGPT conversations cut at two lengths, evaluated on prompts whose contexts reach
6-8k tokens: tau and per-position acceptance by context length (docs/metrics.md, "By context length").

    python scripts/long_context_acceptance.py OUT [--target smollm2-135m] [--lengths 512,2048]
        [--conversations 96] [--train-steps 60] [--prompt-tokens 768,1536,3072,6144,7680]
        [--per-length 2] [--max-new-tokens 64] [--batch-tokens 4096]

- Training data: ShareGPT conversations (shuffled with seed 0) long enough to fill a row (their text
  past 6 characters per token of the length: 12,288 at 2048), read as the source wrote them (data.mode=prefill: the target labels every assistant
  turn), cut at each length: `--conversations` of them at the longest length and proportionally more
  at shorter ones (384 at 512 for 96 at 2048), so both drafters learn from about the same tokens.
  Each drafter is the recipe's (recipes/eagle3-smollm2-135m.yaml), trained for the same steps of the
  same tokens (a batch of 4096: 8 rows of 512, 2 of 2048); steps, not minutes, so the comparison
  does not depend on what else the machine runs.
- Evaluation prompts: other ShareGPT conversations, turn pairs appended until the rendered chat would
  pass each `--prompt-tokens` length, then the next user question (`--per-length` prompts per length);
  greedy, a chain of the drafter's depth, `--max-new-tokens` tokens each.
Prints the table (context bucket x drafter) and writes OUT/acceptance.json.  Not a timing: it runs
alongside other work."""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

CHARS_PER_TOKEN = 6             # English is about 4 characters a token: a conversation this long fills a row


def conversations_split(seed: int = 0):
    from draftsmith.data import sources
    convs = list(sources.sharegpt())
    random.Random(seed).shuffle(convs)
    half = len(convs) // 2
    return convs[:half], convs[half:]           # training pool, evaluation pool (disjoint)


def training_source(pool, count: int, length: int, path: Path) -> int:
    """The first `count` conversations of the pool that fill a row of `length` tokens, as a JSONL source."""
    chosen = [c for c in pool if sum(len(m["content"]) for m in c.messages) > CHARS_PER_TOKEN * length][:count]
    path.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in chosen))
    return len(chosen)


def long_prompts(tokenizer, pool, lengths: list[int], per_length: int, path: Path) -> list[int]:
    """Chats built from consecutive conversations' turn pairs, each as long as the rendered chat stays
    under its length, ending with a user question."""
    from draftsmith.data.chat import prompt_ids
    pairs = []
    for conv in pool:
        messages = [m for m in conv.messages if m["role"] in ("user", "assistant")]
        pairs += [messages[i:i + 2] for i in range(0, len(messages) - 1, 2)
                  if messages[i]["role"] == "user" and messages[i + 1]["role"] == "assistant"]
    records, sizes, at = [], [], 0
    for length in lengths:
        for n in range(per_length):
            chat: list[dict] = []
            while at < len(pairs) - 1:
                question = pairs[at + 1][0]
                if len(prompt_ids(tokenizer, chat + pairs[at] + [question])) > length:
                    break
                chat += pairs[at]
                at += 1
            at += 1                          # the pair that did not fit is skipped, not cut
            chat.append(pairs[at][0])
            at += 1
            sizes.append(len(prompt_ids(tokenizer, chat)))
            records.append({"id": f"ctx{length}-{n}", "messages": chat})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return sizes


def main(argv=None) -> int:
    import yaml

    from draftsmith.eval.benchmark import EvalSettings, evaluate
    from draftsmith.heads.runtime.target import Target
    from draftsmith.recipe_files import resolve_recipe
    from draftsmith.train.loop import fit
    from draftsmith.train.settings import recipe_from_dict

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--prompt-tokens", default="768,1536,3072,6144,7680")
    parser.add_argument("--per-length", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-tokens", type=int, default=4096, help="tokens per training step, at every length")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]

    train_pool, eval_pool = conversations_split()
    found = {n: training_source(train_pool, args.conversations * max(lengths) // n, n, out / f"train-{n}.jsonl")
             for n in lengths}
    target = Target.load(args.target, "float32", "cpu")
    context = target.context_length
    wanted = [int(x) for x in args.prompt_tokens.split(",")]
    fitting = [n for n in wanted if not context or n + args.max_new_tokens <= context]
    sizes = long_prompts(target.tokenizer, eval_pool, fitting, args.per_length, out / "prompts.jsonl")
    print(f"training sources (length: conversations): {found}; prompts of {sizes} tokens"
          + (f" (lengths past the target's {context} positions dropped)" if fitting != wanted else ""), flush=True)
    raw = yaml.safe_load(resolve_recipe("eagle3-smollm2-135m").read_text())
    drafter = dict(raw["drafter"])            # the recipe's layers scaled to this target's depth (a small test
    drafter["layer_ids"] = [max(1, min(target.num_layers, round(i * target.num_layers / 30)))   # target's too)
                            for i in drafter["layer_ids"]]
    drafter["draft_vocab_size"] = min(drafter["draft_vocab_size"], target.vocab_size)
    del target

    results = {}
    for length in lengths:
        spec = {"method": "eagle3", "seed": 0, "output_dir": str(out / f"trained-{length}"),
                "target": {"path": args.target, "dtype": "auto"},
                "data": {"source": str(out / f"train-{length}.jsonl"), "mode": "prefill", "max_conversations": None,
                         "batch_size": 16, "max_seq_len": length},
                "drafter": drafter,
                "train": {**raw["train"], "batch_size": max(1, args.batch_tokens // length), "epochs": 1000,
                          "max_steps": args.train_steps, "max_minutes": None, "eval_prompts": 0, "heldout_fraction": 0.05}}
        report = fit(recipe_from_dict(spec), progress=False)
        evaluated = evaluate(report.checkpoint, EvalSettings(
            prompts=str(out / "prompts.jsonl"), limit=len(sizes), max_new_tokens=args.max_new_tokens,
            proposal="chain", baselines=("plain",), exact_prompts=1, long_prompts="refuse"), progress=False)
        results[length] = {"steps": report.steps, "tau": evaluated.tau, "greedy_exact": evaluated.greedy_exact,
                           "by_context": evaluated.acceptance_by_context}
        print(json.dumps({"max_seq_len": length, **results[length]}), flush=True)
    (out / "acceptance.json").write_text(json.dumps({"prompt_tokens": sizes, "results": results}, indent=1))

    buckets = sorted({b["context"] for r in results.values() for b in r["by_context"]},
                     key=lambda name: int(name.split("-")[0].rstrip("k+")))
    print("\n| context | " + " | ".join(f"trained at {n}: tau (steps) | a1" for n in lengths) + " |")
    print("|---|" + "---:|---:|" * len(lengths))
    for name in buckets:
        cells = []
        for n in lengths:
            b = next((b for b in results[n]["by_context"] if b["context"] == name), None)
            cells += [f"{b['tau']:.2f} ({b['steps']})", f"{b['per_position_acceptance'][0]:.2f}"] if b else ["-", "-"]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| all | " + " | ".join(f"{results[n]['tau']:.2f} | " for n in lengths) + "|")
    print("training steps: " + ", ".join(f"{n}: {results[n]['steps']}" for n in lengths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
