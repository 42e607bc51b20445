"""`draftsmith bench --endpoint URL --baseline-endpoint URL`: before and after on running servers.

Two OpenAI-compatible servers serve the same target: `--endpoint` with the drafter, and
`--baseline-endpoint` without it (a running server cannot switch speculation on and off). Every
request is sent to `/v1/completions` as token ids, streamed, so the time to first token is the time
to the first streamed chunk that carries text, as a client sees it. At each load level `concurrency`
requests are in flight: a finished one is replaced at once. Only one server is loaded at a time, and
the order alternates between repeats, as in the offline engine.

Acceptance comes from the speculative server's Prometheus `/metrics` (vLLM's
`vllm:spec_decode_*` counters), read before and after each load level; a server without them
gives no tau. Greedy text is compared through the token ids vLLM streams when asked
(`return_token_ids`), else through the text tokenized here.
"""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import AutoTokenizer

from draftsmith.heads.runtime.assets import resolve_target_path

from .bench_settings import BenchError, BenchSettings
from .bench_vllm import sweep_levels
from .traffic import load_traffic
from .vllm_worker import counter_delta

TIMEOUT_S = 600
SPEC_METRIC = re.compile(r'^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$')


def base_url(url: str) -> str:
    """'http://host:8000', 'http://host:8000/' and 'http://host:8000/v1' name the same server."""
    if not re.match(r"^https?://[^/\s]+", url or ""):
        raise BenchError(f"an endpoint must be an http(s) URL such as http://localhost:8000, got '{url}'")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _get(url: str, what: str, timeout: float = 30) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except urllib.error.HTTPError as err:
        raise BenchError(f"{what}: {url} answered HTTP {err.code}") from None
    except (urllib.error.URLError, OSError) as err:
        raise BenchError(f"{what}: cannot reach {url} ({getattr(err, 'reason', err)}); is the server running?") from None


def served_model(base: str, what: str) -> dict:
    """The first model a server lists: {'id', 'root', ...}."""
    listing = _get(f"{base}/v1/models", what)
    try:
        models = json.loads(listing)["data"]
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{what}: {base}/v1/models is not an OpenAI model list") from None
    if not models:
        raise BenchError(f"{what}: {base} serves no model")
    return models[0]


def check_target(config: dict, plain: dict, speculative: dict) -> str:
    """Both servers serve one target, and it is the checkpoint's where it can be read here.

    Returns how far the target could be checked (for the report)."""
    plain_root, spec_root = plain.get("root") or plain["id"], speculative.get("root") or speculative["id"]
    if plain_root != spec_root:
        raise BenchError(f"the two servers serve different targets: --baseline-endpoint serves '{plain_root}', "
                         f"--endpoint serves '{spec_root}'; start both on the target the drafter was trained for")
    try:
        directory = Path(resolve_target_path(spec_root)[0])
    except Exception:        # a hub name or a path on another machine: nothing here to read
        return f"not checked: the served target '{spec_root}' cannot be read on this machine"
    served_config = directory / "config.json"
    if not served_config.is_file():
        return f"not checked: '{directory}' has no config.json"
    served = json.loads(served_config.read_text())
    served = served.get("text_config", served)
    trained = config["target"]
    pairs = {"vocab_size": served.get("vocab_size"), "hidden_size": served.get("hidden_size"),
             "num_layers": served.get("num_hidden_layers"), "model_type": served.get("model_type")}
    diffs = [f"{k}: {trained[k]} vs {v}" for k, v in pairs.items() if k in trained and v is not None and trained[k] != v]
    if diffs:
        raise BenchError(f"the checkpoint was trained for target '{trained['name']}' but the servers serve "
                         f"'{spec_root}' ({'; '.join(diffs)}); serve the target it was trained for")
    return f"checked: '{spec_root}' has the checkpoint's architecture (vocabulary, width, depth)"


def spec_counters(base: str) -> dict:
    """vLLM's speculative-decoding counters from Prometheus text, summed over engines; per-position
    counters become a list indexed by position."""
    counters: dict = {}
    for line in _get(f"{base}/metrics", "reading acceptance").decode().splitlines():
        match = SPEC_METRIC.match(line.strip())
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name.endswith(("_created", "_bucket", "_sum", "_count")):
            continue
        position = re.search(r'position="(\d+)"', labels)
        if position:
            values = counters.setdefault(name, [])
            index = int(position.group(1))
            values.extend([0.0] * (index + 1 - len(values)))
            values[index] += value
        else:
            counters[name] = counters.get(name, 0.0) + value
    return counters


def stream_one(base: str, model: str, request: dict, temperature: float, seed: int, tokenizer) -> dict:
    """One streamed completion: seconds to the first text chunk and to the end, and the tokens."""
    body = {"model": model, "prompt": request["prompt"], "max_tokens": request["max_tokens"],
            "temperature": temperature, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if temperature > 0:
        body["seed"] = seed
    http = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                  headers={"Content-Type": "application/json"})
    text, token_ids, first = [], [], None
    admitted = time.perf_counter()
    try:
        with urllib.request.urlopen(http, timeout=TIMEOUT_S) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        first = first or time.perf_counter()
                        text.append(choice["text"])
                    token_ids += choice.get("token_ids") or []
    except urllib.error.HTTPError as err:
        raise BenchError(f"{base}/v1/completions answered HTTP {err.code}: {err.read()[:300].decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as err:
        raise BenchError(f"{base}/v1/completions failed ({getattr(err, 'reason', err)})") from None
    end = time.perf_counter()
    joined = "".join(text)
    tokens = token_ids or tokenizer.encode(joined, add_special_tokens=False)
    return {"id": request["id"], "seconds": end - admitted, "first_token_seconds": (first or end) - admitted,
            "tokens": tokens}


def serve_level(base: str, model: str, requests: list[dict], concurrency: int, temperature: float, seed: int,
                tokenizer) -> tuple[list[dict], float]:
    """The whole sample with `concurrency` requests in flight. Returns (runs, wall seconds)."""
    start = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = [pool.submit(stream_one, base, model, r, temperature, seed + i, tokenizer)
                   for i, r in enumerate(requests)]
        runs = [f.result() for f in futures]
    finally:            # on Ctrl-C or an error, queued requests are dropped; those in flight run out
        pool.shutdown(wait=False, cancel_futures=True)
    return runs, time.perf_counter() - start


def run_endpoint(checkpoint: str, config: dict, target_path: str, settings: BenchSettings, out_dir: Path,
                 progress=None) -> dict:
    """Check both servers, warm them, sweep. Returns what run_vllm returns."""


    bases = {"plain": base_url(settings.baseline_endpoint), "speculative": base_url(settings.endpoint)}
    models = {mode: served_model(base, f"--{'baseline-' if mode == 'plain' else ''}endpoint")
              for mode, base in bases.items()}
    target_check = check_target(config, models["plain"], models["speculative"])
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_target_path(target_path)[0]))
    traffic = load_traffic(tokenizer, settings.traffic, settings.limit, settings.seed, settings.max_new_tokens)
    for mode, base in bases.items():                                     # warm-up, untimed
        request = traffic.requests[0]
        stream_one(base, models[mode]["id"], {"id": request.id, "prompt": request.prompt, "max_tokens": 4}, 0.0, 0,
                   tokenizer)

    def serve(mode: str, requests: list[dict], concurrency: int, temperature: float, seed: int) -> dict:
        before = spec_counters(bases[mode]) if mode == "speculative" else {}
        answered, wall = serve_level(bases[mode], models[mode]["id"], requests, concurrency, temperature, seed,
                                     tokenizer)
        after = spec_counters(bases[mode]) if mode == "speculative" else {}
        return {"runs": answered, "wall": wall, "metrics": counter_delta(before, after)}
    return {**sweep_levels(serve, traffic, settings, progress),
            "engine": f"OpenAI-compatible servers, streamed (with drafter: {bases['speculative']}, "
                      f"without: {bases['plain']}); target {target_check}",
            "proposal": "as the speculative server is configured", "dtype": "as served", "device": "the servers' own"}
