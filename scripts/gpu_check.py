"""The prepared GPU check behind scripts/gpu_check.sh: one line per stage, PASS/FAIL/SKIP, seconds, devices seen.

    bash scripts/gpu_check.sh            # or: python scripts/gpu_check.py [--skip-default] [--device cuda]
    DEVICE=cpu SKIP_DEFAULT=1 bash scripts/gpu_check.sh    # its CPU mode (CI runs it: tests/test_gpu_check.py)

In its CPU mode (--device cpu) every stage that does not need CUDA runs through the same code: the tiny
stages, the 1-process torchrun (over gloo), the 2-process launches of the shipped accelerate configs (CPU
processes), and the rehearsal at tiny shapes; a stage that needs CUDA says SKIP with its name.

Stages on a tiny random Llama (4 layers, hidden 64, built here): data, train Medusa and EAGLE-3
(20 steps each), eval (fp32 exactness, tau, tokens/s with device synchronisation), export --to vllm,
a 1-process torchrun (an NCCL process group: a tensor off the GPU in a collective fails there), and
2-process runs under accelerate launch (ddp, fsdp, deepspeed-zero3) when two GPUs are visible; then
one short quickstart on the default target; then scripts/rehearse.py on a random target of
Llama-3.1-8B's shapes (regeneration tokens/s, training step time, peak GPU memory).
While the stages run, the device of each tensor family is recorded: target weights (Target.load),
engine caches (EngineCache), drafter weights and training batches (each drafter's loss()).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQUIRED = ("torch", "transformers", "accelerate", "datasets", "peft", "safetensors", "yaml", "tqdm", "gguf")


def missing_packages() -> list[str]:
    import importlib.util
    return [name for name in REQUIRED if importlib.util.find_spec(name) is None]


SEEN: dict[str, set] = {}


def record(family: str, device) -> None:
    SEEN.setdefault(family, set()).add(str(device))


def install_probes() -> None:
    """Wrap the few places every tensor family passes through, to record its device."""
    from draftsmith.heads.registry import registry
    from draftsmith.heads.runtime import engine
    from draftsmith.heads.runtime.target import Target

    original_load = Target.load.__func__

    def load(cls, *args, **kwargs):
        target = original_load(cls, *args, **kwargs)
        record("target", target.device)
        return target
    Target.load = classmethod(load)

    original_cache = engine.EngineCache.__init__

    def cache_init(self, *args, **kwargs):
        original_cache(self, *args, **kwargs)
        record("engine cache", self.valid.device)
    engine.EngineCache.__init__ = cache_init

    for cls in registry().values():
        def loss(self, batch, _original=cls.loss):
            record("drafter", next(self.parameters()).device)
            record("batch", batch["input_ids"].device)
            record("features", next(iter(batch["features"].values())).device)
            return _original(self, batch)
        cls.loss = loss


def stage(name: str, fn, results: list) -> object:
    SEEN.clear()
    start = time.time()
    try:
        value = fn()
        ok, note = True, value if isinstance(value, str) else ""
    except Exception as err:  # noqa: BLE001 - a check reports every failure and goes on
        ok, note, value = False, f"{type(err).__name__}: {err}", None
        traceback.print_exc()
    devices = ", ".join(f"{k}={'/'.join(sorted(v))}" for k, v in sorted(SEEN.items())) or "-"
    line = f"{'PASS' if ok else 'FAIL'}  {name:<22} {time.time() - start:6.1f}s  devices: {devices}  {note}"
    print(line, flush=True)
    results.append(ok)
    return value


def tiny_recipe(work: Path, target_dir: Path, method: str, device: str) -> Path:
    import yaml
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import chats_file      # the tests' helpers without pytest (tests/tiny_models.py)
    drafter = ({"num_heads": 3, "lm_head": "shared", "draft_vocab_size": None} if method == "medusa" else
               {"layer_ids": [1, 2, 3], "draft_vocab_size": 128, "ttt_steps": 3,
                "tree": {"depth": 3, "top_k": 4, "total_tokens": 8}})
    recipe = {"method": method, "output_dir": str(work / method), "seed": 0,
              "target": {"path": str(target_dir), "dtype": "auto", "device": device},
              "data": {"source": str(chats_file(work / "chats.jsonl", 96)), "max_conversations": None,
                       "batch_size": 16, "max_new_tokens": 32},
              "drafter": drafter,
              "train": {"epochs": 100, "max_steps": 20, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2,
                        "eval_prompts": 1, "heldout_fraction": 0.1, "save_every": 10}}
    path = work / f"{method}.yaml"
    path.write_text(f"# draftsmith train {path}\n" + yaml.safe_dump(recipe))
    return path


def run(*argv) -> None:
    """One draftsmith command through the real CLI."""
    from draftsmith.cli import main as cli
    if cli([str(a) for a in argv]) != 0:
        raise RuntimeError(f"draftsmith {' '.join(map(str, argv))} failed")


def tiny_stages(work: Path, device, gpus: int, results: list, skip_launches: bool = False) -> None:
    """data, train, eval, export (and DDP when two GPUs are visible) on a tiny random Llama built here."""
    def build():
        sys.path.insert(0, str(REPO / "tests"))
        from tiny_models import build_tiny_target      # pytest is not needed (a GPU image may lack it)
        target_dir = build_tiny_target(work / "tiny-llama", "llama", layers=4)
        return {m: tiny_recipe(work, target_dir, m, str(device)) for m in ("medusa", "eagle3")}
    recipes = stage("tiny: build", build, results)
    if recipes is None:
        print("SKIP  tiny: the other stages      the tiny model could not be built (above)", flush=True)
        return

    stage("tiny: data", lambda: run("data", recipes["eagle3"]), results)
    for method in ("medusa", "eagle3"):
        if method == "medusa":      # the same data (its cache holds Medusa's layer too)
            import shutil
            shutil.copytree(work / "eagle3" / "data", work / "medusa" / "data", dirs_exist_ok=True)
        stage(f"tiny: train {method}", lambda m=method: run("train", recipes[m]), results)

    def evaluate(method):
        from draftsmith.eval.benchmark import EvalSettings
        from draftsmith.eval.benchmark import evaluate as run_eval
        report = run_eval(str(work / method / "checkpoint"), EvalSettings(
            prompts=str(work / "chats.jsonl"), limit=4, max_new_tokens=32, baselines=("plain", "generate"),
            exact_prompts=4, device=str(device), lookup=2), progress=False)
        if not report.greedy_exact:
            raise AssertionError(f"speculative greedy differs from plain greedy in fp32 ({report.first_mismatch})")
        rates = " ".join(f"{m} {r:.0f}" for m, r in report.tokens_per_second.items())
        return f"exact (fp32), tau {report.tau:.2f}, tokens/s: {rates} ({report.dtype})"
    for method in ("medusa", "eagle3"):
        stage(f"tiny: eval {method}", lambda m=method: evaluate(m), results)
    for method in ("medusa", "eagle3"):
        stage(f"tiny: export {method}", lambda m=method: run("export", work / m / "checkpoint", "--to", "vllm",
                                                             work / f"export-{m}", "--device", device), results)
    process_stages(work, recipes, torch_device_type(device) == "cuda", gpus, results, skip_launches)


def process_stages(work: Path, recipes: dict, cuda: bool, gpus: int, results: list, skip_launches: bool) -> None:
    """The launched stages on the tiny data: a 1-process torchrun, then the 2-process launches of the
    shipped accelerate configs (2 GPUs, or CPU processes in the CPU mode)."""
    def child_env() -> dict:
        # the checkout first, then what was there (WHEELS= put its private site folder on PYTHONPATH)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        if not cuda:
            env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="")
        return env

    def one_process_torchrun():
        """torchrun with one process: accelerate makes a process group (NCCL on a GPU, where a tensor
        that is not on the GPU in any collective fails; gloo on the CPU, which accepts it)."""
        import shutil
        shutil.copytree(work / "eagle3" / "data", work / "torchrun" / "data", dirs_exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                               "--master_port", "29581", "-m", "draftsmith", "train", str(recipes["eagle3"]),
                               f"output_dir={work / 'torchrun'}", "train.log_every=5", "train.eval_every=10"],
                              env=child_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        ran = json.loads((work / "torchrun" / "logs" / "launch.json").read_text())
        expected = "MULTI_GPU" if cuda else "MULTI_CPU"
        if ran["distributed_type"] != expected:
            raise AssertionError(f"torchrun did not make a process group: {ran}")
        backend = "NCCL" if cuda else "gloo"
        # the launch's object collectives ran over the group of one (the replica check writes what it gathered)
        replicas = json.loads((work / "torchrun" / "logs" / "replicas.json").read_text())
        if len(replicas["processes"]) != 1:
            raise AssertionError(f"the replica check gathered {replicas}")
        return (f"{ran['distributed_type']} over {backend}, 1 process, object collectives ran: "
                + done.stdout.strip().splitlines()[-1])
    stage(f"tiny: torchrun 1 process, {'NCCL' if cuda else 'gloo'}", one_process_torchrun, results)
    if not cuda:
        print("SKIP  tiny: torchrun over NCCL     needs CUDA (the gloo run above took the same path)", flush=True)
    if skip_launches:
        print("SKIP  tiny: " + ", ".join(LAUNCHES) + " 2 processes   --skip-launches (tests/test_launch_files.py "
              "runs them)", flush=True)
    elif gpus >= 2 or not cuda:
        import importlib.util
        import shutil

        def launch(config):
            """The shipped accelerate config as its first line writes it; only the process count is set
            (2 GPUs, or 2 CPU processes in the CPU mode)."""
            done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                                   f"recipes/accelerate/{config}.yaml", "--num_processes", "2",
                                   "--main_process_port", str(29590 + LAUNCHES.index(config)), "-m", "draftsmith",
                                   "train", str(recipes["eagle3"]), f"output_dir={work / config}", "train.batch_size=2"],
                                  env=child_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
            if done.returncode:
                raise RuntimeError(done.stderr[-2000:])
            ran = (work / config / "logs" / "launch.json").read_text().replace("\n", " ")
            return done.stdout.strip().splitlines()[-1] + " " + ran
        where = "GPUs" if cuda else "CPU processes"
        for config in LAUNCHES:
            if config.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
                print(f"SKIP  tiny: {config} 2 {where}   deepspeed is not installed here", flush=True)
                continue
            shutil.copytree(work / "eagle3" / "data", work / config / "data")
            stage(f"tiny: {config} 2 {where}", lambda c=config: launch(c), results)
    else:
        print("SKIP  tiny: " + ", ".join(LAUNCHES) + " 2 processes   one GPU visible", flush=True)


# the rehearsal's sizes: Llama-3.1-8B's shapes on a GPU, tiny shapes (the same stages) in the CPU mode
# (one stage: the 8B target is built once and its data made once; docs/gpu.md counts the check's minutes)
REHEARSAL_SIZE = {
    "cuda": ["--conversations", "64", "--tokens", "1024", "--steps", "5"],
    "cpu": ["--shapes", "tiny", "--conversations", "16", "--tokens", "64", "--steps", "3"],
}
LAUNCHES = ("ddp", "fsdp", "deepspeed-zero2", "deepspeed-zero3")


def torch_device_type(device) -> str:
    return getattr(device, "type", str(device).split(":")[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=os.environ.get("DEVICE", "auto"),
                        help="auto, cuda[:N], or cpu: the CPU mode (every stage that does not need CUDA)")
    parser.add_argument("--skip-default", action="store_true", default=bool(os.environ.get("SKIP_DEFAULT")))
    parser.add_argument("--skip-tiny", action="store_true", default=bool(os.environ.get("SKIP_TINY")),
                        help="run only the default target's quickstart")
    parser.add_argument("--skip-launches", action="store_true", default=bool(os.environ.get("SKIP_LAUNCHES")),
                        help="skip the 2-process launches of the shipped accelerate configs")
    parser.add_argument("--skip-rehearsal", action="store_true", default=bool(os.environ.get("SKIP_REHEARSAL")),
                        help="skip scripts/rehearse.py on the 8B-shaped random target (16 GB of GPU memory)")
    args = parser.parse_args()
    missing = missing_packages()
    if missing:
        print(f"FAIL  packages missing: {missing}; bring their wheels (WHEELS=DIR bash scripts/gpu_check.sh)")
        return 1
    import torch

    from draftsmith.heads.infra.device import resolve_device
    device = resolve_device(args.device)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and device.type == "cuda" else 0
    print(f"draftsmith GPU check{' (CPU mode)' if device.type == 'cpu' else ''}: device {device}, {gpus} GPU(s) "
          f"{torch.cuda.get_device_name(0) if gpus else ''}, torch {torch.__version__}", flush=True)
    install_probes()
    results: list[bool] = []
    work = Path(tempfile.mkdtemp(prefix="draftsmith-gpu-check-"))
    if args.skip_tiny:
        print("SKIP  tiny: every stage          --skip-tiny", flush=True)
    else:
        tiny_stages(work, device, gpus, results, args.skip_launches)
    if args.skip_default:
        print("SKIP  default: quickstart        --skip-default", flush=True)
    else:
        stage("default: quickstart", lambda: run(
            "quickstart", f"output_dir={work / 'quickstart'}", f"target.device={device}", "data.max_minutes=0.5",
            "data.max_conversations=256", "train.max_minutes=0.5", "eval.limit=3", "eval.max_new_tokens=64"), results)
    shapes = "8B" if device.type == "cuda" else "tiny"
    if args.skip_rehearsal:
        print(f"SKIP  rehearsal: {shapes} shapes        --skip-rehearsal", flush=True)
    else:
        def rehearse():
            """One rehearsal on the 8B-shaped random target, built once: dry run, data (the transformers
            backend, batch auto: regeneration tokens/s and peak memory), training, resume, both exports."""
            done = subprocess.run([sys.executable, "scripts/rehearse.py", "--device", str(device), "--data-mode",
                                   "regenerate", *REHEARSAL_SIZE[device.type], "--batch-size", "auto", "--work",
                                   str(work / "rehearsal")], capture_output=True, text=True, timeout=900, cwd=REPO)
            print(done.stdout, flush=True)
            if done.returncode:
                raise RuntimeError(done.stdout[-1500:] + done.stderr[-1500:])
            import importlib.util
            vllm = ("vLLM is installed here: data.backend=vllm can be tried on this machine"
                    if importlib.util.find_spec("vllm") is not None else
                    "vLLM is not installed in this image: only the transformers backend was checked")
            return f"see the rehearsal's lines above; {vllm}"
        stage(f"rehearsal: {shapes} shapes", rehearse, results)
    print(f"{sum(results)} passed, {len(results) - sum(results)} failed", flush=True)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
