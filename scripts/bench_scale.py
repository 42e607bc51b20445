"""Training throughput and memory, one process against two, for each way of spreading a run.

Runs `draftsmith train RECIPE` for a fixed number of steps at one global batch: once in one process
(batch B, all threads), then under `accelerate launch --config_file recipes/accelerate/<launch>.yaml
--num_processes 2` (batch B/2 each, one thread each) for each launch config, one run after the other,
all reading the same data directory (made first, or given with --data).  Prints, per run: wall time,
training tokens/s (the run's own count over its training seconds, as `draftsmith train` prints it), the final loss, the held-out
agreement, and the peak resident memory of the largest single process (GNU time's maximum RSS over
the launcher and its children).

    .venv/bin/python scripts/bench_scale.py recipes/eagle3-smollm2-135m.yaml --data runs/bench/data \
        --steps 40 --batch 8 --launches ddp fsdp deepspeed-zero2 deepspeed-zero3 [--set data.max_conversations=N ...]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(command: list[str], env: dict) -> tuple[float, int, str]:
    """(seconds, peak RSS in MB of the largest process, combined output)."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        start = time.time()
        done = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", rss.name, *command], env=env, cwd=REPO,
                              capture_output=True, text=True)
        seconds = time.time() - start
        if done.returncode != 0:
            sys.exit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
        return seconds, int(rss.read().split()[-1]) // 1024, done.stdout + done.stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("--data", required=True, help="a data directory made for this recipe (output_dir/data)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="global batch (two processes take half each)")
    parser.add_argument("--launches", nargs="+", default=["ddp", "fsdp", "deepspeed-zero2", "deepspeed-zero3"])
    parser.add_argument("--work", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides the data was made with (data.max_conversations=..., ...)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-scale-"))
    common = [args.recipe, f"train.max_steps={args.steps}", "train.eval_every=0", "train.eval_prompts=0",
              "train.max_minutes=null", "train.epochs=100", f"train.save_every={args.steps}", "overwrite=true", *args.set]
    rows = []
    for launch in ["one process", *args.launches]:
        out = work / launch.replace(" ", "-")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(args.data, out / "data")
        env = dict(os.environ, PYTHONPATH=str(REPO))
        if launch == "one process":
            env.update(ACCELERATE_USE_CPU="true")
            command = [sys.executable, "-m", "draftsmith", "train", *common, f"output_dir={out}",
                       f"train.batch_size={args.batch}"]
        else:
            env.update(OMP_NUM_THREADS="1")
            command = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                       f"recipes/accelerate/{launch}.yaml", "--num_processes", "2", "--mixed_precision", "no",
                       "-m", "draftsmith", "train", *common, f"output_dir={out}", f"train.batch_size={args.batch // 2}"]
        seconds, rss, output = run(command, env)
        summary = re.search(r"train: (\d+) steps in (\d+)s \((\d+) tok/s\)", output)
        logged = [json.loads(line) for line in (out / "logs" / "train.jsonl").read_text().splitlines()]
        steps = [r for r in logged if "train/loss" in r]
        final = [r for r in logged if "heldout/agreement" in r][-1]
        config = json.loads((out / "checkpoint" / "config.json").read_text())
        rows.append((launch, seconds, int(summary.group(3)), steps[-1]["train/loss"],
                     final["heldout/agreement"], rss, json.loads((out / "logs" / "launch.json").read_text())))
        print(f"{launch:>16}: {seconds:6.1f} s wall, {rows[-1][2]:6.0f} tok/s, final loss {rows[-1][3]:.4f}, held-out "
              f"[{' '.join(f'{a:.3f}' for a in final['heldout/agreement'])}], peak RSS {rss} MB "
              f"({rows[-1][6]['distributed_type']}, {config['kind']})", flush=True)
    print("\n| launch | wall s | tokens/s | final loss | held-out agreement | peak RSS (largest process) |")
    print("|---|---|---|---|---|---|")
    for launch, seconds, tps, loss, agreement, rss, _ in rows:
        print(f"| {launch} | {seconds:.0f} | {tps:.0f} | {loss:.4f} | {' '.join(f'{a:.3f}' for a in agreement)} | {rss} MB |")


if __name__ == "__main__":
    main()
