"""Self-distillation throughput: generated tokens/s of draftsmith's engine, fixed batches (the batch
shrinks as rows finish) and continuous batching (finished rows refilled: data/stream.py, what
`draftsmith data` uses), side by side; optionally transformers' generate and the vLLM backend.

    python scripts/bench_generation.py --batch-sizes 32 64 --prompts 128 --max-new-tokens 256

Prompts are ShareGPT first turns rendered with the target's chat template
(longest first-turn prompts skipped, as data.max_prompt_tokens does).  Both
engines decode greedily in the same dtype, one after the other in one process.
"""
import argparse
import time

import torch

from draftsmith.data import sources
from draftsmith.data.chat import prompt_ids
from draftsmith.data.generate import generate_batch
from draftsmith.data.stream import generate_stream
from draftsmith.heads.infra.device import resolve_device, synchronize
from draftsmith.heads.runtime.target import Target


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--capture", type=int, nargs="*", default=[], help="layer ids to capture as features")
    parser.add_argument("--hf", action="store_true", help="also time transformers' generate on the same batches")
    parser.add_argument("--vllm", action="store_true", help="also time the vLLM data backend on the same batches")
    args = parser.parse_args()

    target = Target.load(args.target, args.dtype, resolve_device(args.device))
    prompts = []
    for conv in sources.sharegpt(limit=args.prompts * 3):
        ids = prompt_ids(target.tokenizer, conv.messages[:1])
        if len(ids) <= args.max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == args.prompts:
            break
    prompts.sort(key=len)
    print(f"{len(prompts)} prompts, {sum(map(len, prompts)) / len(prompts):.0f} tokens on average; "
          f"{target.dtype} on {target.device}, {torch.get_num_threads()} threads")
    generate_batch(target, prompts[:2], 4)                          # warm-up, untimed
    for batch_size in args.batch_sizes:
        synchronize(target.device)
        generated, start = 0, time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            outs = generate_batch(target, prompts[i:i + batch_size], args.max_new_tokens,
                                  capture_layers=args.capture)
            generated += sum(len(o.token_ids) for o in outs)
        synchronize(target.device)
        seconds = time.perf_counter() - start
        line = f"batch {batch_size:>4}: fixed batches {generated / seconds:7.1f} tok/s ({generated} tokens, {seconds:.0f}s)"
        synchronize(target.device)
        start = time.perf_counter()
        outs = generate_stream(target, prompts, args.max_new_tokens, rows=batch_size, capture_layers=args.capture)
        synchronize(target.device)
        c_seconds, c_generated = time.perf_counter() - start, sum(len(o.token_ids) for o in outs)
        line += (f" | continuous {c_generated / c_seconds:7.1f} tok/s ({c_generated} tokens, {c_seconds:.0f}s; "
                 f"{c_generated / c_seconds / (generated / seconds):.2f}x)")
        if args.hf:
            tok = target.tokenizer
            hf_generated, start = 0, time.perf_counter()
            for i in range(0, len(prompts), batch_size):
                chunk = prompts[i:i + batch_size]
                longest = max(map(len, chunk))
                ids = torch.tensor([[tok.pad_token_id or 0] * (longest - len(p)) + p for p in chunk])
                mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in chunk])
                out = target.model.generate(ids.to(target.device), attention_mask=mask.to(target.device), max_new_tokens=args.max_new_tokens,
                                            do_sample=False, eos_token_id=target.eos_token_ids,
                                            pad_token_id=target.eos_token_ids[0])
                for row in out[:, longest:].tolist():      # up to and including the first stop token
                    stop = next((i for i, t in enumerate(row) if t in target.eos_token_ids), len(row) - 1)
                    hf_generated += stop + 1
            synchronize(target.device)
            hf_seconds = time.perf_counter() - start
            line += f" | transformers generate {hf_generated / hf_seconds:7.1f} tok/s ({hf_seconds:.0f}s)"
        if args.vllm:
            from draftsmith.data import vllm_backend
            from draftsmith.data.distill import DataSettings
            settings = DataSettings(max_prompt_tokens=max(map(len, prompts)), max_new_tokens=args.max_new_tokens)
            engine = vllm_backend.Engine(target, settings)                           # start-up, untimed
            v_generated, start = 0, time.perf_counter()
            for i in range(0, len(prompts), batch_size):
                outs = engine.generate(prompts[i:i + batch_size], [0] * len(prompts[i:i + batch_size]), settings)
                v_generated += sum(len(o.token_ids) for o in outs)
            v_seconds = time.perf_counter() - start
            line += f" | vLLM backend {v_generated / v_seconds:7.1f} tok/s ({v_seconds:.0f}s)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
