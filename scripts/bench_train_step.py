"""EAGLE-3 training-step cost on the default target: draftsmith's loss against the plain formula, side by side.

    python scripts/bench_train_step.py --batch 8 --seq 400 --reply 250 --repeats 4

One optimizer step (forward, backward, AdamW) on a batch shaped like the shipped recipe's (random
features: the cost depends on the shapes only), under the training's bf16 autocast.  `plain` computes
the same loss the textbook way: the target's full-vocabulary logits in fp32 and their argmax, the
target rows gathered to the drafter's order at every step, `-(p * log_softmax(z)).sum()`.  `draftsmith`
is the drafter's own `loss` (heads/soft_loss.py, heads/eagle3.py).  The two alternate, after a warm-up,
so a noisy machine slows both alike; the losses must agree, or the script says so and exits 1.
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F

from draftsmith.heads.eagle3 import Eagle3, Eagle3Config
from draftsmith.heads.runtime.target import Target


def plain_loss(drafter: Eagle3, batch: dict) -> torch.Tensor:
    target = drafter.target
    final = batch["features"][target.num_layers]
    wanted = F.pad(batch["loss_mask"][:, 1:], (0, 1)).bool()
    with torch.no_grad():
        logits = target.compute_logits(final[wanted]).float()
        ok = drafter.target_to_draft[logits.argmax(-1)] >= 0
        probs = torch.softmax(logits[:, drafter.draft_to_target], dim=-1)
    index = torch.full(wanted.shape, -1, dtype=torch.long)
    index[wanted] = torch.arange(int(wanted.sum()))
    total = torch.zeros(())
    for step, hidden in enumerate(drafter.unroll(batch)):
        rows = F.pad(index[:, 1 + step:], (0, 1 + step), value=-1)
        scored = rows >= 0
        log_q = torch.log_softmax(drafter.logits(hidden[scored]).float(), dim=-1)
        per_position = -(probs[rows[scored]] * log_q).sum(-1) * ok[rows[scored]]
        total = total + drafter.config.loss_decay ** step * per_position.sum() / scored.sum().clamp(min=1)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=400, help="row length (prompt + reply)")
    parser.add_argument("--reply", type=int, default=250, help="reply tokens per row (scored)")
    parser.add_argument("--ttt-steps", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()

    torch.manual_seed(0)
    target = Target.load(args.target, "auto")
    drafter = Eagle3(Eagle3Config(ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab), target)
    stride = max(1, target.vocab_size // args.draft_vocab)
    drafter.set_draft_vocabulary(torch.arange(args.draft_vocab) * stride)
    b, s = args.batch, args.seq
    layers = sorted(set(drafter.required_layers) | {target.num_layers})
    features = {i: torch.randn(b, s, target.config.hidden_size, dtype=torch.bfloat16) for i in layers}
    loss_mask = torch.zeros(b, s, dtype=torch.long)
    loss_mask[:, s - args.reply:] = 1
    batch = {"input_ids": torch.randint(0, target.vocab_size, (b, s)), "attention_mask": torch.ones(b, s, dtype=torch.long),
             "loss_mask": loss_mask, "features": features}
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    ways = {"plain": lambda: plain_loss(drafter, batch), "draftsmith": lambda: drafter.loss(batch).loss}

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        values = {name: float(way()) for name, way in ways.items()}
    if abs(values["plain"] - values["draftsmith"]) > 1e-2 * abs(values["plain"]):
        print(f"the two losses differ: {values}", file=sys.stderr)
        sys.exit(1)

    def step(way) -> float:
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = way()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - start

    for way in ways.values():
        step(way)                                           # warm-up
    times = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, way in ways.items():
            times[name].append(step(way))
    tokens = int(loss_mask.sum())
    print(f"EAGLE-3 training step, {args.target}: batch {b} x {s} tokens ({tokens} scored), "
          f"{args.ttt_steps} test-time steps, draft vocabulary {args.draft_vocab}, bf16 autocast, "
          f"{torch.get_num_threads()} threads; loss {values['draftsmith']:.4f} (plain {values['plain']:.4f})")
    for name, spent in times.items():
        mean = sum(spent) / len(spent)
        print(f"  {name:10s} {mean * 1000:7.0f} ms/step  {tokens / mean:7.0f} scored tokens/s  "
              f"(steps: {', '.join(f'{t * 1000:.0f}' for t in spent)} ms)")
    ratio = sum(times["plain"]) / sum(times["draftsmith"])
    print(f"  draftsmith / plain: {ratio:.2f}x the steps per second")


if __name__ == "__main__":
    main()
