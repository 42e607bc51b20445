"""How much of a training batch is padding: what sequence packing could win at most.

    python scripts/padding_share.py DATA_DIR [--batch-size 8] [--max-seq-len 1024] [--seed 0] [--epochs 3]

DATA_DIR is a run's data/ (its tokenized/ rows).  The rows are cut at --max-seq-len and grouped as
training groups them (train/batches.py: shuffled with the seed, sorted by length inside windows of 32
batches, padded to each batch's longest row); the share of padded positions is what packing short
conversations up to max_seq_len could turn into training tokens.  Prints one JSON line per epoch
and the mean."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    import datasets

    from draftsmith.train.batches import Batches

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    rows = datasets.load_from_disk(f"{args.data_dir}/tokenized")
    lengths = [min(len(ids), args.max_seq_len) for ids in rows["input_ids"]]
    batches = Batches({"input_ids": [[0] * n for n in lengths]}, args.batch_size, args.seed)
    shares = []
    for epoch in range(args.epochs):
        groups = batches.epoch(epoch).groups
        real = sum(lengths[i] for g in groups for i in g)
        slots = sum(max(lengths[i] for i in g) * len(g) for g in groups)
        shares.append(1 - real / slots)
        print(json.dumps({"epoch": epoch, "batches": len(groups), "tokens": real, "padded_slots": slots,
                          "padding_share": round(shares[-1], 4)}))
    print(f"{len(lengths)} rows (mean {sum(lengths) / len(lengths):.0f} tokens, longest {max(lengths)}), batch "
          f"{args.batch_size}: padding {100 * sum(shares) / len(shares):.1f}% of the batch positions; packing could "
          f"raise tokens per step by at most {1 / (1 - sum(shares) / len(shares)):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
