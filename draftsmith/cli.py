"""The `draftsmith` command: data, train, eval, quickstart, export."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from importlib import resources
from pathlib import Path

log = logging.getLogger("draftsmith")

QUICKSTART_RECIPE = "quickstart-smollm2-135m"


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()


def resolve_recipe(name: str) -> Path:
    """A recipe path, or the name of a recipe shipped with draftsmith (e.g. medusa-smollm2-135m)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = resources.files("draftsmith.recipes").joinpath(f"{name.removesuffix('.yaml')}.yaml")
    if shipped.is_file():
        return Path(str(shipped))
    available = sorted(p.name.removesuffix(".yaml") for p in resources.files("draftsmith.recipes").iterdir()
                       if p.name.endswith(".yaml"))
    raise SystemExit(f"error: recipe '{name}' not found: give a YAML file or one of {available}")


def cmd_data(args) -> dict:
    from draftsmith.heads.device import resolve_device
    from draftsmith.heads.target import Target
    from draftsmith.train.batches import make_recipe_data
    from draftsmith.train.settings import load_recipe

    recipe = load_recipe(resolve_recipe(args.recipe), args.overrides)
    target = Target.load(recipe.target.path, recipe.target.dtype, resolve_device(recipe.target.device),
                         trust_remote_code=recipe.target.trust_remote_code)
    report = make_recipe_data(recipe, target)
    print(f"data: {report.conversations} conversations, {report.training_tokens} tokens "
          f"({report.assistant_tokens} reply tokens) in {recipe.out / 'data'}; generated {report.generated_tokens} "
          f"and prefilled {report.prefilled_tokens} tokens in {report.seconds:.0f}s ({report.tokens_per_second:.0f} tok/s); "
          f"{report.skipped_long_prompts} long prompts skipped, {report.truncated_prompts} truncated")
    return vars(report) | {"tokens_per_second": report.tokens_per_second}


def cmd_train(args) -> dict:
    from draftsmith.train.loop import fit
    from draftsmith.train.settings import load_recipe

    recipe = load_recipe(resolve_recipe(args.recipe), args.overrides)
    report = fit(recipe)
    agreement = " ".join(f"{a:.2f}" for a in report.heldout_agreement)
    print(f"train: {report.steps} steps in {report.seconds:.0f}s ({report.tokens_per_second:.0f} tok/s), "
          f"stopped by {report.stopped_by}; held-out agreement [{agreement}], simulated tau "
          f"{report.heldout_simulated_tau:.2f}; checkpoint {report.checkpoint}")
    return {"steps": report.steps, "seconds": report.seconds, "tokens_per_second": report.tokens_per_second,
            "heldout_agreement": report.heldout_agreement, "heldout_simulated_tau": report.heldout_simulated_tau}


def _eval_options(args):
    from draftsmith.eval.benchmark import EvalOptions
    from draftsmith.heads.device import resolve_device

    proposal = "chain" if args.chain is not None else "tree" if args.tree is not None else "default"
    return EvalOptions(
        prompts=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens, proposal=proposal,
        chain_length=args.chain or None, tree_size=args.tree or None, temperature=args.temperature,
        top_p=args.top_p, rule=args.rule, dtype=args.dtype, baselines=tuple(args.baselines.split(",")),
        exact_prompts=args.exact_prompts, seed=args.seed, cost_per_hour=args.cost_per_hour, target_path=args.target,
        device=str(resolve_device(args.device)), max_minutes=args.max_minutes)    # the device: checked first


def cmd_eval(args) -> dict:
    from draftsmith.eval.benchmark import evaluate
    from draftsmith.eval.report import markdown, write_json

    report = evaluate(args.checkpoint, _eval_options(args))
    print(markdown(report))
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return report.to_dict()


def cmd_quickstart(args) -> dict:
    """Data, training and evaluation on the embedded default target, each within its budget."""
    import resource

    from draftsmith.eval.benchmark import EvalOptions, evaluate
    from draftsmith.eval.report import markdown, write_json
    from draftsmith.heads.device import resolve_device
    from draftsmith.heads.target import Target
    from draftsmith.train.batches import make_recipe_data
    from draftsmith.train.loop import fit
    from draftsmith.train.settings import load_recipe

    start = time.time()
    recipe = load_recipe(resolve_recipe(args.recipe), args.overrides)
    print(f"== draftsmith quickstart: {recipe.method} drafter for {recipe.target.path}, writing {recipe.out}", flush=True)
    device = resolve_device(recipe.target.device)
    target = Target.load(recipe.target.path, recipe.target.dtype, device, trust_remote_code=recipe.target.trust_remote_code)
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
    options = EvalOptions(prompts=recipe.eval.prompts, limit=recipe.eval.limit,
                          max_new_tokens=recipe.eval.max_new_tokens, proposal=recipe.eval.proposal,
                          chain_length=recipe.eval.chain_length, tree_size=recipe.eval.tree_size,
                          temperature=recipe.eval.temperature, top_p=recipe.eval.top_p, dtype=recipe.eval.dtype,
                          baselines=recipe.eval.baselines, target_path=recipe.target.path, seed=recipe.seed,
                          device=str(device), max_minutes=recipe.eval.max_minutes)
    report = evaluate(trained.checkpoint, options)
    write_json(report, recipe.out / "eval.json")
    print()
    print(markdown(report))
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    print(f"\ndata {data.tokens_per_second:.0f} tok/s, training {trained.tokens_per_second:.0f} tok/s, "
          f"peak memory {peak_gib:.1f} GiB, total {(time.time() - start) / 60:.1f} min; "
          f"wrote {recipe.out / 'eval.json'}")
    return report.to_dict()


def cmd_export(args) -> dict:
    from draftsmith.heads.export import export

    written = export(args.checkpoint, args.to, args.out_dir, dtype=args.dtype, overwrite=args.overwrite,
                     target_path=args.target, device=args.device)
    print(f"exported {args.checkpoint} as {args.to} to {written}")
    return {"out_dir": str(written)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="draftsmith", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="verb", required=True)

    for verb, helptext in (("data", "make the training data (self-distillation by the target)"),
                           ("train", "train the recipe's drafter (makes the data first if missing)")):
        p = sub.add_parser(verb, help=helptext)
        p.add_argument("recipe", help="a recipe YAML or a shipped recipe name")
        p.add_argument("overrides", nargs="*", help="key=value or section.key=value")

    p = sub.add_parser("eval", help="acceptance, speedup and exactness of a trained drafter")
    p.add_argument("checkpoint")
    p.add_argument("--prompts", default="mt-bench", help="mt-bench, humaneval, or FILE.jsonl (your traffic)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--chain", type=int, nargs="?", const=0, default=None, metavar="K",
                       help="propose a chain of K tokens (default K: the drafter's depth)")
    shape.add_argument("--tree", type=int, nargs="?", const=0, default=None, metavar="N",
                       help="propose a tree (N nodes for static trees; default: tuned on this machine)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--rule", default="auto", choices=["auto", "greedy", "sampling", "typical"],
                   help="acceptance rule; typical is Medusa's and NOT lossless")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto: bf16 where native, else packed fp16 weights on x86 CPUs (float16), else fp32")
    p.add_argument("--baselines", default="plain,generate", help="plain,generate,prompt-lookup")
    p.add_argument("--exact-prompts", type=int, default=3, help="prompts checked for fp32 exactness")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost-per-hour", type=float, default=None, help="machine price, for cost per request")
    p.add_argument("--target", default=None, help="target path (default: the one the checkpoint names)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="fit the timed runs into this budget (prompts, then tokens, cut from a measured forward cost)")

    p = sub.add_parser("quickstart", help="data + training + evaluation on the embedded default target")
    p.add_argument("--recipe", default=QUICKSTART_RECIPE)
    p.add_argument("overrides", nargs="*", help="key=value or section.key=value")

    p = sub.add_parser("export", help="write a checkpoint in a serving stack's format")
    p.add_argument("checkpoint")
    p.add_argument("--to", required=True, help="vllm, sglang, medusa-original, trtllm, speculators")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--target", default=None, help="check the checkpoint against this target")
    p.add_argument("--device", default="auto", help="where the target's identity is checked (auto, cpu, cuda)")
    return parser


VERBS = {"data": cmd_data, "train": cmd_train, "eval": cmd_eval, "quickstart": cmd_quickstart, "export": cmd_export}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    _quiet_libraries()
    from draftsmith.data.sources import DataError
    from draftsmith.heads.assets import AssetError
    from draftsmith.heads.device import DeviceError
    from draftsmith.heads.target import TargetError
    from draftsmith.train.settings import RecipeError

    try:
        VERBS[args.verb](args)
    except (RecipeError, DataError, AssetError, TargetError, DeviceError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
