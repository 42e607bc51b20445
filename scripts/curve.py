"""Acceptance per CPU-minute: one curve per data mode, the figures behind the README's choice of recipe.

For each data mode (regenerate, prefill, mix) and each budget B (minutes of data plus training on
this machine), the recipe's drafter is trained on `share * B` minutes of data for `(1 - share) * B`
minutes, then evaluated on MT-bench with the same settings each time.  A mode's data grows by
resuming one data run (`data.max_minutes` is per run, and a rerun continues where it stopped), so
budget 20 reuses the data of budget 10 and adds to it: the data of every budget is what a single
run of that length would have made.  Each budget is copied aside before training on it.

    python scripts/curve.py --work runs/curve --modes regenerate prefill --budgets 10 20 40 60

Resumable: finished points are read back from WORK/curve.json and skipped.  The minutes reported
are measured (data making and training, wall clock), not the asked ones.  Run nothing else heavy
beside it: the speedups are timed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from draftsmith.cli import quiet_libraries
from draftsmith.recipe_files import resolve_recipe


def _recipe(args, mode: str, out: Path, extra: list[str]):
    from draftsmith.train.settings import load_recipe

    return load_recipe(resolve_recipe(args.recipe), [f"output_dir={out}", f"data.mode={mode}", *args.overrides,
                                                      *extra])


def grow_data(args, mode: str, minutes: float, state: dict) -> None:
    """Resume the mode's one data run until it has had `minutes` of data making in all."""
    from draftsmith.train.batches import make_recipe_data

    missing = minutes - state["data_seconds"] / 60
    if missing <= 0.05:
        return
    recipe = _recipe(args, mode, args.work / mode / "grow", [f"data.max_minutes={missing:.3f}"])
    start = time.time()
    target = recipe.target.load()
    report = make_recipe_data(recipe, target, progress=False)
    state["data_seconds"] += time.time() - start
    state["conversations"] = report.conversations
    state["reply_tokens"] = report.assistant_tokens
    state["training_tokens"] = report.training_tokens


def train_and_eval(args, mode: str, budget: float, state: dict) -> dict:
    """Copy the mode's data as it stands, train on it for the rest of the budget, evaluate."""
    from draftsmith.eval.benchmark import evaluate
    from draftsmith.heads.decoding.settings import EvalSettings
    from draftsmith.train.loop import fit

    out = args.work / mode / f"B{budget:g}"
    if out.exists():
        shutil.rmtree(out)                    # an interrupted point starts again from its data
    shutil.copytree(args.work / mode / "grow" / "data", out / "data")
    train_minutes = budget - state["data_seconds"] / 60
    trained = fit(_recipe(args, mode, out, [f"train.max_minutes={train_minutes:.3f}"]), progress=False)
    settings = EvalSettings(prompts=args.prompts, limit=args.limit, max_minutes=args.eval_minutes,
                            lookup=args.lookup, exact_prompts=1)
    report = evaluate(trained.checkpoint, settings, progress=False).to_dict()
    return {"mode": mode, "budget": budget, "data_minutes": state["data_seconds"] / 60,
            "train_minutes": trained.seconds / 60, "conversations": state["conversations"],
            "reply_tokens": state["reply_tokens"], "training_tokens": state["training_tokens"],
            "steps": trained.steps, "heldout_agreement": trained.heldout_agreement,
            **{key: report[key] for key in ("prompts", "proposal", "tau", "per_position_acceptance",
                                            "speedup_vs_plain", "speedup_vs_generate", "greedy_exact",
                                            "target_forward_ms", "draft_step_ms", "accepted_by_source")}}


def table(points: list[dict]) -> str:
    rows = ["| mode | budget (min) | data + training (measured) | reply tokens | steps | held-out agreement "
            "| MT-bench prompts | tau | x plain | x generate | exact |",
            "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for p in sorted(points, key=lambda p: (p["mode"], p["budget"])):
        agreement = " ".join(f"{a:.2f}" for a in p["heldout_agreement"])
        rows.append(f"| {p['mode']} | {p['budget']:g} | {p['data_minutes']:.1f} + {p['train_minutes']:.1f} "
                    f"| {p['reply_tokens']:,} | {p['steps']} | {agreement} | {p['prompts']} | {p['tau']:.2f} "
                    f"| {p['speedup_vs_plain']:.2f} | {p['speedup_vs_generate']:.2f} | {p['greedy_exact']} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="quickstart-smollm2-135m")
    parser.add_argument("--work", type=Path, default=Path("runs/curve"))
    parser.add_argument("--modes", nargs="+", default=["regenerate", "prefill", "mix"],
                        choices=["regenerate", "prefill", "mix"])
    parser.add_argument("--budgets", nargs="+", type=float, default=[10, 20, 40, 60],
                        help="minutes of data plus training per point")
    parser.add_argument("--data-share", type=float, default=None,
                        help="the share of each budget spent making data (default: the recipe's split)")
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--limit", type=int, default=10,
                        help="MT-bench prompts per point, the same at every point (default 10)")
    parser.add_argument("--eval-minutes", type=float, default=None,
                        help="size the evaluation to this many minutes instead (prompt counts then differ by "
                             "point, and so does the mix of MT-bench categories: tau is then not comparable)")
    parser.add_argument("--lookup", type=int, default=None, help="default: the recipe's eval.lookup")
    parser.add_argument("overrides", nargs="*", help="recipe key=value, applied to every point")
    args = parser.parse_args()
    quiet_libraries()
    from draftsmith.train.settings import load_recipe

    base = load_recipe(resolve_recipe(args.recipe), args.overrides)
    if args.data_share is None:
        args.data_share = base.data.max_minutes / (base.data.max_minutes + base.train.max_minutes)
    if not 0 < args.data_share < 1:
        raise SystemExit(f"error: --data-share must be in (0, 1), got {args.data_share}")
    args.lookup = base.eval.lookup if args.lookup is None else args.lookup
    args.work.mkdir(parents=True, exist_ok=True)
    state_path = args.work / "curve.json"
    saved = json.loads(state_path.read_text()) if state_path.exists() else {"data": {}, "points": []}
    for budget in sorted(args.budgets):
        for mode in args.modes:
            if any(p["mode"] == mode and p["budget"] == budget for p in saved["points"]):
                continue
            state = saved["data"].setdefault(mode, {"data_seconds": 0.0})
            grow_data(args, mode, args.data_share * budget, state)
            state_path.write_text(json.dumps(saved, indent=1))
            point = train_and_eval(args, mode, budget, state)
            saved["points"].append(point)
            state_path.write_text(json.dumps(saved, indent=1))
            print(table([point]).splitlines()[-1], flush=True)
    print(table(saved["points"]))


if __name__ == "__main__":
    main()
