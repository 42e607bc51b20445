"""Where batch-1 decoding time goes: the engine's plain decoding against one bare target forward and
transformers' generate, repeated in rounds, then a profile of one plain decode.

    python scripts/decode_timing.py [--target smollm2-135m] [--device auto] [--random-weights]

Each round times, on new prompts of new lengths (as real traffic has), (a) a one-token forward after 200 cached tokens
(`block_cost`), (b) `decode()` without a drafter, (c) `generate`. If (b) costs much more per token than
(a), the difference is per-step overhead outside the forward (masks, host copies, host syncs), and the
profile names it. Then the cost curve of a forward over n tokens is printed beside this machine's limit
(the weights' bytes over the measured read bandwidth, the FLOPs over the measured GEMM rate). On CUDA the first visit of each new sequence length costs more than later ones
(measured on an H200: see docs/gpu.md), so only rounds after the first compare like with like.
`--random-weights` builds the target's architecture with random weights (timing does
not depend on the weights; it needs only the target's config and tokenizer). Prompts are random token ids.
"""
import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from draftsmith.eval import machine_limits
from draftsmith.eval.benchmark import time_generate
from draftsmith.eval.proposal import block_cost
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.infra.device import resolve_device, synchronize
from draftsmith.heads.runtime.target import Target


def random_copy(source: Path) -> Path:
    """The same architecture and tokenizer as `source`, with freshly initialised weights."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(source)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(tempfile.mkdtemp(prefix="draftsmith-random-"))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="a name, a directory, or a .gguf file")
    parser.add_argument("--config-dir", help="with --random-weights: a directory holding config.json and the tokenizer")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eagle3-tree", type=int, nargs=3, metavar=("DEPTH", "TOP_K", "TOTAL"),
                        help="also time speculative decoding with an untrained EAGLE-3 drafter proposing this "
                             "dynamic tree (its cost per step, not its acceptance)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one decode (speculative when a drafter is given) and print the top operators")
    args = parser.parse_args()

    path = args.target
    if args.random_weights:
        path = str(random_copy(Path(args.config_dir)))
    target = Target.load(path, args.dtype, resolve_device(args.device))
    gen = torch.Generator().manual_seed(0)

    def new_prompts():
        lengths = torch.randint(args.prompt_tokens // 2, args.prompt_tokens * 3 // 2, (args.prompts,), generator=gen)
        return [torch.randint(100, target.vocab_size, (int(n),), generator=gen).tolist() for n in lengths]
    prompts = new_prompts()
    print(f"{target.name}: {target.dtype} on {target.device}, {torch.get_num_threads()} threads, "
          f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.max_new_tokens} new tokens", flush=True)
    drafter = None
    if args.eagle3_tree:
        from draftsmith.heads.decoding.dynamic_tree import TreeSettings
        from draftsmith.heads.eagle3 import Eagle3, Eagle3Config
        drafter = Eagle3(Eagle3Config(draft_vocab_size=8192), target).to(target.device).eval()
        drafter.set_proposal(tree=TreeSettings(*args.eagle3_tree))
        decode(target, prompts[0], 8, drafter)
    decode(target, prompts[0], 8)                                        # warm-up
    time_generate(target, prompts[0], 8, lookup=False)
    for r in range(args.rounds):
        prompts = new_prompts()
        forward = block_cost(target, [1])[1]
        plain_s = plain_n = gen_s = gen_n = 0.0
        for prompt in prompts:
            run = decode(target, prompt, args.max_new_tokens)
            plain_s, plain_n = plain_s + run.seconds, plain_n + len(run.tokens)
            seconds, tokens = time_generate(target, prompt, args.max_new_tokens, lookup=False)
            gen_s, gen_n = gen_s + seconds, gen_n + len(tokens)
        line = (f"round {r + 1}: one-token forward {forward * 1000:6.1f} ms | plain decode "
                f"{plain_s / plain_n * 1000:6.1f} ms/token ({plain_n / plain_s:6.1f} tok/s) | generate "
                f"{gen_s / gen_n * 1000:6.1f} ms/token ({gen_n / gen_s:6.1f} tok/s)")
        if drafter is not None:
            runs = [decode(target, prompt, args.max_new_tokens, drafter) for prompt in prompts]
            steps, seconds = sum(run.forwards for run in runs), sum(run.seconds for run in runs)
            line += f" | eagle3 {args.eagle3_tree}: {seconds / steps * 1000:6.1f} ms per verification step"
        print(line, flush=True)
    sizes = [1, 2, 4, 8, 16, 32]
    measured = block_cost(target, sizes)
    bandwidth, flops = machine_limits.memory_bandwidth(target.device), machine_limits.gemm_rate(target.device)
    print("\nthe cost curve against this machine's limit (eval/machine_limits.py):")
    print(machine_limits.table(measured, machine_limits.bounds(target.model, sizes, bandwidth, flops), bandwidth,
                               flops, machine_limits.linear_weights(target.model)[1]), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            decode(target, prompts[0], 32, drafter)
            synchronize(target.device)
        sort = "cuda_time_total" if target.device.type == "cuda" else "cpu_time_total"
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
        if sort != "cpu_time_total":
            print(prof.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
