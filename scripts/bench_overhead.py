"""The timing overhead of `draftsmith bench --engine vllm`, against bare `LLM.generate`.

Runs in the vLLM environment (.venv-vllm/bin/python scripts/bench_overhead.py). One vLLM engine
(the default target, no drafter) serves the same MT-bench prompts two ways, alternating over the
repeats: through the bench worker's loop (eval/vllm_worker.py: add_request/step, a timestamp per
request at admission, first token and finish), and through bare `LLM.generate`, which is what a
user would time by hand. At concurrency 1, `generate` gets one request at a time; at the highest
level it gets them all at once with max_num_seqs equal to that level, which is what the worker's
loop keeps in flight. The overhead is the worker's wall time over generate's, minus one, per
level, as the median over repeats and pooled.

    .venv-vllm/bin/python scripts/bench_overhead.py --prompts 8 --max-tokens 64 --repeats 3 --concurrency 1 8
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")        # as the bench worker does

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm_worker import run

    from draftsmith.data import sources
    from draftsmith.data.chat import prompt_ids
    from draftsmith.heads.runtime.assets import resolve_target_path

    target = str(resolve_target_path("smollm2-135m")[0])
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_ids(tokenizer, c.messages[:1]) for c in sources.mt_bench(limit=args.prompts)]
    requests = [{"id": f"r{i}", "prompt": p, "max_tokens": args.max_tokens} for i, p in enumerate(prompts)]
    llm = LLM(model=target, dtype=args.dtype, max_model_len=max(map(len, prompts)) + args.max_tokens + 16,
              enforce_eager=True, max_num_seqs=max(args.concurrency), seed=0, disable_log_stats=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for request in requests[:2]:                                                       # warm-up
        llm.generate([{"prompt_token_ids": request["prompt"]}], greedy, use_tqdm=False)

    def bare(concurrency: int) -> float:
        start = time.perf_counter()
        if concurrency == 1:
            for request in requests:
                llm.generate([{"prompt_token_ids": request["prompt"]}], greedy, use_tqdm=False)
        else:
            llm.generate([{"prompt_token_ids": r["prompt"]} for r in requests], greedy, use_tqdm=False)
        return time.perf_counter() - start

    def harness(concurrency: int) -> float:
        # ignore_eos as in bare(): both decode the same number of tokens
        answer = run(llm, {"requests": requests, "concurrency": concurrency, "temperature": 0.0, "seed": 0,
                           "ignore_eos": True})
        return answer["wall"]

    for concurrency in args.concurrency:
        if concurrency not in (1, max(args.concurrency)):
            print(f"concurrency {concurrency}: skipped (generate matches the worker only at 1 and at max_num_seqs)")
            continue
        ratios, walls = [], {"bare": 0.0, "harness": 0.0}
        for repeat in range(args.repeats):
            order = ("bare", "harness") if repeat % 2 == 0 else ("harness", "bare")
            seconds = {mode: (bare if mode == "bare" else harness)(concurrency) for mode in order}
            ratios.append(seconds["harness"] / seconds["bare"])
            for mode in walls:
                walls[mode] += seconds[mode]
            print(f"concurrency {concurrency} repeat {repeat}: generate {seconds['bare']:.2f} s, "
                  f"bench worker {seconds['harness']:.2f} s ({(ratios[-1] - 1) * 100:+.1f}%)", flush=True)
        tokens = len(requests) * args.max_tokens
        print(f"concurrency {concurrency}: overhead median {(statistics.median(ratios) - 1) * 100:+.1f}%, pooled "
              f"{(walls['harness'] / walls['bare'] - 1) * 100:+.1f}% ({len(requests)} requests x {args.max_tokens} "
              f"tokens, {tokens * args.repeats / walls['bare']:.1f} tok/s by generate)", flush=True)


if __name__ == "__main__":
    main()
