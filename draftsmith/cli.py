"""The `draftsmith` command: data, train, eval, quickstart, export (bench in bench_command.py; recipes,
show, import and push in tools.py).

Each verb imports the packages it runs inside its own function, the one exception to module-level
imports: `draftsmith --help`, `draftsmith recipes` and a mistyped flag answer at once instead of after
loading torch and transformers (about 5 s on 2 cores).  The packages themselves import at module level."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

from .bench_command import Interrupted, add_bench_parser, cmd_bench
from .recipe_files import resolve_recipe
from .tools import add_tool_parsers, cmd_import, cmd_push, cmd_recipes, cmd_show

log = logging.getLogger("draftsmith")

QUICKSTART_RECIPE = "quickstart-smollm2-135m"


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()


def cmd_data(args) -> dict:
    """The recipe's data step; under torchrun or accelerate launch, one process per device, each making its
    share of the shards (data/progress.py)."""
    import torch

    from draftsmith.data.health import ends
    from draftsmith.data.progress import data_launch, launch_from_environment
    from draftsmith.data.vllm_backend import use_spawn
    from draftsmith.heads.infra.device import resolve_device
    from draftsmith.heads.infra.files import require_writable
    from draftsmith.heads.infra.outputs import guard_output
    from draftsmith.train.batches import make_recipe_data
    from draftsmith.train.settings import load_recipe

    use_spawn()     # first: the recipe's checks already ask torch about CUDA, and vLLM must not fork after it
    recipe = load_recipe(resolve_recipe(args.recipe), args.overrides)
    if args.dry_run:
        from draftsmith.train.plan import dry_run
        return dry_run(recipe, recipe.target.load(), "data")
    guard_output(recipe.out, "data", "run", overwrite=True, foreign_ok=True)
    require_writable(recipe.out, "output_dir")
    device = resolve_device(recipe.target.device)
    rank, world, local_rank = launch_from_environment()
    if world > 1 and device.type == "cuda":
        device = torch.device("cuda", local_rank)
    # vLLM generates with the target's weights off the device; they load for the feature pass, after it
    with_vllm = recipe.data.backend == "vllm" and recipe.data.mode != "prefill"
    with data_launch(recipe.out, recipe.train.dist_timeout_minutes, recipe.to_dict()) as launch:
        target = recipe.target.load("cpu", layers=False) if with_vllm else recipe.target.load(device)
        report = make_recipe_data(recipe, target, launch=launch, full_target=lambda: recipe.target.load(device))
    if report is None:                    # not the main rank: it made its shards, the main rank says the rest
        return {}
    health = report.health or {}
    print(f"data: {report.conversations} conversations, {report.training_tokens} tokens "
          f"({report.assistant_tokens} reply tokens) in {recipe.out / 'data'}; generated {report.generated_tokens} "
          f"and prefilled {report.prefilled_tokens} tokens in {report.seconds:.0f}s ({report.tokens_per_second:.0f} tok/s"
          f"{f' over {world} processes' if world > 1 else ''}); "
          f"{report.skipped_long_prompts} long prompts skipped, {report.truncated_prompts} truncated"
          + (f"; replies: {ends(health)}, {health['loop_share']:.1%} in loops, top token "
             f"{health['top_token_share']:.1%}" if health else "")
          + (f"; peak GPU memory {torch.cuda.max_memory_allocated(device) / 2 ** 30:.1f} GiB"
             if device.type == "cuda" else ""))
    return vars(report) | {"tokens_per_second": report.tokens_per_second}


def cmd_train(args) -> dict:
    from draftsmith.train.loop import fit
    from draftsmith.train.settings import load_recipe

    recipe = load_recipe(resolve_recipe(args.recipe), args.overrides)
    if args.dry_run:
        from draftsmith.train.plan import dry_run
        return dry_run(recipe, recipe.target.load(), "train")
    report = fit(recipe)
    agreement = " ".join(f"{a:.2f}" for a in report.heldout_agreement)
    if int(os.environ.get("RANK", "0")) == 0:          # under a launcher, one summary for the run
        print(f"train: {report.steps} steps in {report.seconds:.0f}s ({report.tokens_per_second:.0f} tok/s), "
              f"stopped by {report.stopped_by}; held-out agreement [{agreement}], simulated tau "
              f"{report.heldout_simulated_tau:.2f}; checkpoint {report.checkpoint}")
    return {"steps": report.steps, "seconds": report.seconds, "tokens_per_second": report.tokens_per_second,
            "heldout_agreement": report.heldout_agreement, "heldout_simulated_tau": report.heldout_simulated_tau}


EVAL_KEYS = ("prompts", "limit", "max_new_tokens", "temperature", "top_p", "rule", "dtype", "baselines",
             "exact_prompts", "seed", "cost_per_hour", "target", "adapter", "device", "device_map", "max_minutes",
             "lookup", "long_prompts")   # flag names = keys


def eval_settings(args):
    """Flags and key=value overrides (`limit=5` or `eval.limit=5`) into one EvalSettings, checked as a recipe's
    eval section is: types coerced, ranges and names validated, before anything loads."""
    from draftsmith.heads.decoding.settings import EvalSettings
    from draftsmith.heads.infra.config import config_from_dict
    from draftsmith.train.settings import apply_overrides

    values = {key: getattr(args, key) for key in EVAL_KEYS if hasattr(args, key)}
    for flag, length in (("chain", "chain_length"), ("tree", "tree_size")):
        if hasattr(args, flag):
            values["proposal"] = flag
            if getattr(args, flag) != "default":
                values[length] = getattr(args, flag)
    overrides = [o.removeprefix("eval.") for o in args.overrides]
    return config_from_dict(EvalSettings, apply_overrides(values, overrides), "eval settings")


def cmd_eval(args) -> dict:
    from draftsmith.eval.benchmark import evaluate
    from draftsmith.eval.report import markdown, write_json
    from draftsmith.heads.drafter import read_config
    from draftsmith.heads.infra.files import require_writable
    from draftsmith.heads.infra.outputs import guard_output

    settings = eval_settings(args)
    read_config(args.checkpoint)              # a damaged or missing checkpoint is named before anything loads
    if args.json:
        guard_output(args.json, "eval --json", "eval report", sources=[args.checkpoint], overwrite=True)
        require_writable(Path(args.json).expanduser().resolve().parent, "the --json report's directory")
    report = evaluate(args.checkpoint, settings)
    print(markdown(report))
    if args.json:
        import json

        from draftsmith.heads.infra.files import keep_report
        keep_report(lambda where: write_json(report, where), Path(args.json), "the --json report",
                    lambda: json.dumps(report.to_dict(), indent=2), is_file=True)
        print(f"wrote {args.json}")
    from draftsmith.heads.card import record_eval
    if settings.target is None and settings.adapter is None:     # the checkpoint's own target: its card says so
        try:
            record_eval(args.checkpoint, report)
        except OSError as err:
            logging.getLogger("draftsmith").warning("the checkpoint's model card was not updated (%s)", err)
    return report.to_dict()


def cmd_quickstart(args) -> dict:
    """Data, training and evaluation on the embedded default target, each within its budget."""
    from draftsmith.heads.infra.files import DirectoryLock, require_writable
    from draftsmith.heads.infra.outputs import guard_output
    from draftsmith.train.settings import load_recipe

    start = time.time()
    recipe = load_recipe(resolve_recipe(args.recipe), args.overrides)
    guard_output(recipe.out, "quickstart", "run", overwrite=True, foreign_ok=True)
    require_writable(recipe.out, "output_dir")
    with DirectoryLock(recipe.out, "quickstart"):
        return _quickstart(recipe, start)


def _quickstart(recipe, start: float) -> dict:
    import resource

    from draftsmith.eval.benchmark import evaluate
    from draftsmith.eval.report import markdown, write_json
    from draftsmith.heads.infra.device import resolve_device
    from draftsmith.train.batches import make_recipe_data
    from draftsmith.train.checkpointing import set_aside
    from draftsmith.train.loop import fit

    print(f"== draftsmith quickstart: {recipe.method} drafter for {recipe.target.path}, writing {recipe.out}", flush=True)
    if not recipe.resume and (aside := set_aside(recipe.out / "checkpoint")):
        print(f"   the earlier quickstart's checkpoint is kept, moved to {aside}", flush=True)
    device = resolve_device(recipe.target.device)
    target = recipe.target.load(device)
    print(f"== 1/3 data ({recipe.data.mode}): the target labels its training data (at most "
          f"{recipe.data.max_minutes} min)", flush=True)
    data = make_recipe_data(recipe, target)
    print(f"   {data.conversations} conversations ({data.assistant_tokens} reply tokens): {data.generated_tokens} "
          f"tokens generated, {data.prefilled_tokens} prefilled, {data.tokens_per_second:.0f} tok/s", flush=True)
    print(f"== 2/3 training (at most {recipe.train.max_minutes} min)", flush=True)
    trained = fit(recipe, target=target)
    print(f"   {trained.steps} steps at {trained.tokens_per_second:.0f} tok/s; held-out agreement "
          + " ".join(f"{a:.2f}" for a in trained.heldout_agreement), flush=True)
    print(f"== 3/3 evaluation: {recipe.eval.limit} {recipe.eval.prompts} prompts, side by side", flush=True)
    options = dataclasses.replace(recipe.eval, target=recipe.eval.target or recipe.target.path, device=str(device))
    report = evaluate(trained.checkpoint, options)
    write_json(report, recipe.out / "eval.json")
    from draftsmith.heads.card import record_eval
    record_eval(trained.checkpoint, report)             # the checkpoint's model card carries it too
    print()
    print(markdown(report))
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"\ndata {data.tokens_per_second:.0f} tok/s, training {trained.tokens_per_second:.0f} tok/s, "
          f"peak memory {peak_gib:.1f} GiB, total {(time.time() - start) / 60:.1f} min; "
          f"wrote {recipe.out / 'eval.json'}")
    print(f"\n{report.verdict['text']}", flush=True)      # the headline: on with this configuration, or off and why
    return report.to_dict()


def cmd_export(args) -> dict:
    from draftsmith.export import export

    written = export(args.checkpoint, args.to, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                     target_path=args.target, device=args.device, with_target=args.with_target,
                     serving_report=args.serving_config)
    print(f"exported {args.checkpoint} as {args.to} to {written}")
    return {"out_dir": str(written)}


def _eval_parser(sub) -> None:
    """`draftsmith eval`'s flags: only those given are passed on (the defaults live in EvalSettings)."""
    p = sub.add_parser("eval", help="acceptance, speedup and exactness of a trained drafter",
                       description="Flags and key=value overrides set the same eval settings (docs/metrics.md); "
                                   "every value is checked before anything loads.")
    p.add_argument("checkpoint")
    p.add_argument("overrides", nargs="*", help="key=value (or eval.key=value), e.g. limit=5 top_p=0.9")
    S = argparse.SUPPRESS       # only the flags given are passed on: the defaults live in EvalSettings
    p.add_argument("--prompts", default=S, help="mt-bench (default), humaneval, or FILE.jsonl (your traffic)")
    p.add_argument("--limit", default=S, help="prompts evaluated (default 20)")
    p.add_argument("--max-new-tokens", default=S, help="tokens per prompt (default 128)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--chain", nargs="?", const="default", default=S, metavar="K",
                       help="propose a chain of K tokens (default K: the drafter's depth)")
    shape.add_argument("--tree", nargs="?", const="default", default=S, metavar="N",
                       help="propose a tree (N nodes for static trees; default: tuned on this machine)")
    p.add_argument("--lookup", default=S, metavar="K",
                   help="also propose K tokens copied from the context (prompt lookup), merged into the drafter's "
                        "tree (default 0: off)")
    p.add_argument("--temperature", default=S, help=">= 0; 0 (default) is greedy")
    p.add_argument("--top-p", default=S, help="in (0, 1] (default 1)")
    p.add_argument("--rule", default=S, help="auto (default), greedy, sampling, or typical (Medusa's, NOT lossless)")
    p.add_argument("--dtype", default=S,
                   help="auto (default: bf16 where native, else packed fp16 weights on x86 CPUs), bfloat16, "
                        "float16, float32")
    p.add_argument("--baselines", default=S, help="plain,generate (default); prompt-lookup may be added")
    p.add_argument("--exact-prompts", default=S, help="prompts checked for fp32 exactness (default 3)")
    p.add_argument("--seed", default=S)
    p.add_argument("--cost-per-hour", default=S, help="machine price, for cost per request")
    p.add_argument("--target", default=S, help="target path (default: the one the checkpoint names)")
    p.add_argument("--adapter", default=S,
                   help="LoRA adapter on the target (default: the one the checkpoint was trained with; none: bare)")
    p.add_argument("--long-prompts", default=S, help="truncate (default: a prompt that, with its new tokens, does "
                   "not fit the target's context keeps its last tokens, with a warning) or refuse")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--device", default=S, help="auto (default: cuda when present, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--device-map", default=S, help="spread the target over the devices: auto, balanced, "
                   "balanced_low_0 or sequential (default: none)")
    p.add_argument("--max-minutes", default=S,
                   help="fit the timed runs into this budget (prompts, then tokens, cut from a measured forward cost)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="verb", required=True)

    for verb, helptext in (("data", "make the training data (self-distillation by the target)"),
                           ("train", "train the recipe's drafter (makes the data first if missing)")):
        p = sub.add_parser(verb, help=helptext)
        p.add_argument("recipe", help="a recipe YAML or a shipped recipe name")
        p.add_argument("overrides", nargs="*", help="key=value or section.key=value")
        p.add_argument("--dry-run", action="store_true", help="print the conversations, tokens, feature-cache "
                       "size against free disk and the minutes a short probe here predicts; write nothing")

    add_tool_parsers(sub)

    _eval_parser(sub)
    add_bench_parser(sub)

    p = sub.add_parser("quickstart", help="data + training + evaluation on the embedded default target")
    p.add_argument("--recipe", default=QUICKSTART_RECIPE)
    p.add_argument("overrides", nargs="*", help="key=value or section.key=value")

    p = sub.add_parser("export", help="write a checkpoint in a serving stack's format")
    p.add_argument("checkpoint")
    p.add_argument("--to", required=True, help="a format the checkpoint's drafter declares (docs/formats.md)")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--target", default=None, help="check the checkpoint against this target")
    p.add_argument("--with-target", action="store_true",
                   help="also write the target as a Hugging Face directory in OUT_DIR/target (with its LoRA adapter "
                        "merged, if it has one): what to serve beside the drafter")
    p.add_argument("--device", default="auto", help="where the target's identity is checked (auto, cpu, cuda)")
    p.add_argument("--serving-config", default=None, metavar="REPORT_JSON",
                   help="a `draftsmith bench --engine vllm` report.json: the README carries the speculative_config "
                        "it measured for this drafter")
    return parser



VERBS = {"data": cmd_data, "train": cmd_train, "eval": cmd_eval, "bench": cmd_bench, "quickstart": cmd_quickstart,
         "export": cmd_export, "recipes": cmd_recipes, "show": cmd_show, "push": cmd_push,
         "import": cmd_import}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with key=value overrides accepted anywhere among the flags (`train R --dry-run
    train.lr=1` as `train R train.lr=1 --dry-run`), in the order given, for every verb that takes them."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if late and hasattr(args, "overrides"):
        args.overrides = [*args.overrides, *late]
        extra = [a for a in extra if a not in late]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    quiet_libraries()
    try:
        VERBS[args.verb](args)
    except Interrupted as stop:
        print(stop.message, file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted: finished work is kept; run the same command again to continue", file=sys.stderr)
        return 130
    except Exception as err:               # one line with the fix; the traceback only with -v
        if args.verbose:
            raise
        _close_progress_bars()             # the error starts a line of its own
        print(f"error: {describe(err)}", file=sys.stderr)
        return 2
    return 0


def _close_progress_bars() -> None:
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def describe(err: BaseException) -> str:
    """One line for an error: draftsmith's own errors say what to do; anything else is named as a bug."""
    from draftsmith.heads.infra.files import describe_os_error

    if isinstance(err, OSError) and not isinstance(err, FileNotFoundError):
        return describe_os_error(err)
    if isinstance(err, (ValueError, FileNotFoundError)):
        return str(err)
    return (f"{type(err).__name__}: {err} (unexpected: run again with -v for the traceback, and report it "
            "if it looks like a bug)")


if __name__ == "__main__":
    sys.exit(main())
