"""A checkpoint's model card (README.md), written from what the directory itself holds.

The card (`README.md` in the checkpoint) is written with the checkpoint and again after each
`draftsmith eval`, from what the directory itself holds: config.json (target identity, drafter,
layer ids, held-out figures), recipe.yaml (data and budget), state/progress.json (steps done) and
last_eval.json (the last evaluation and its conditions).  Nothing in it is typed by hand.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import yaml

from draftsmith.heads.drafter import CONFIG_FILE, WEIGHTS_FILE, read_config, target_path
from draftsmith.heads.formats import formats_of
from draftsmith.heads.infra import strict_yaml
from draftsmith.heads.infra.files import write_atomic
from draftsmith.heads.infra.kept import NUMBER, KeptFileError, read_kept_json
from draftsmith.heads.infra.version import __version__
from draftsmith.heads.registry import registry, trained_class
from draftsmith.heads.runtime.assets import looks_like_hub_id

CARD_FILE = "README.md"
log = logging.getLogger(__name__)
LAST_EVAL_FILE = "last_eval.json"
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}      # embedded targets: where they come from
# what a pushed folder holds: the checkpoint without its resume state (optimizer, RNG)
PUSHED = (CONFIG_FILE, WEIGHTS_FILE, "recipe.yaml", LAST_EVAL_FILE)   # and the card, made anew
ADAPTER_DIR = "adapter"      # a LoRA trained with the drafter: adapter_config.json and its safetensors only


def base_model(config: dict) -> str:
    source = str(target_path(config))
    if source in HUB_IDS:
        return HUB_IDS[source]
    return source if looks_like_hub_id(source) else config["target"]["name"]


def _table(rows: list[tuple[str, object]]) -> str:
    return "\n".join(["| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]])


def _rates(values) -> str:
    return " ".join(f"{float(v):.3f}" for v in values) if values else "-"


def model_card(directory: Path) -> str:
    directory = Path(directory)
    config = read_config(directory)
    target, kind = config["target"], config["kind"]
    kind_name = trained_class(config).title
    recipe = strict_yaml.load((directory / "recipe.yaml").read_text()) if (directory / "recipe.yaml").is_file() else {}
    progress_file = directory / "state" / "progress.json"
    progress = json.loads(progress_file.read_text()) if progress_file.is_file() else {}
    last_eval = read_last_eval(directory)
    heldout = config.get("heldout", {})
    front = {"base_model": base_model(config), "library_name": "draftsmith",
             "tags": ["speculative-decoding", "draft-model", "draftsmith", kind]}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {kind_name} for {base_model(config)}", "",
             f"{kind_name} trained with draftsmith "
             f"{config.get('draftsmith_version', __version__)} for the target `{config.get('target_source') or target['name']}`"
             + (" with the LoRA adapter in `adapter/` (merged: base + adapter is the target)"
                if config.get("target_adapter") else "") + ". Speculative decoding with it is lossless: greedy output "
             "equals the target's own, token for token.", "",
             "## Target", "",
             "It loads only against this target: draftsmith compares these hashes and refuses any other.", "",
             _table([("model type", target.get("model_type")), ("layers", target.get("num_layers")),
                     ("hidden size", target.get("hidden_size")), ("vocabulary", target.get("vocab_size")),
                     ("weights_sha256 (embedding, lm_head)", f"`{target.get('weights_sha256')}`"),
                     ("layers_sha256 (every parameter, sampled)", f"`{target.get('layers_sha256', '')}`"),
                     ("adapter_sha256", f"`{target.get('adapter_sha256') or 'none'}`")]), "",
             "## Drafter", "",
             _table([("kind", kind), ("target layer ids (hidden_states index: 0 = embeddings, "
                                      f"{target.get('num_layers')} = final normed output)",
                      config.get("target_layer_ids")),
                     *[(k, v) for k, v in config["drafter"].items() if not isinstance(v, dict)]]), ""]
    lines += _training_section(recipe, progress) + _measured_section(heldout, last_eval) + _serving_section(config)
    lines += ["## Load it", "", "```python", "from draftsmith.export import Drafter",
              'drafter = Drafter.from_pretrained("THIS_DIR_OR_REPO")     # loads the target named above, checks it',
              "```", ""]
    return "\n".join(lines)


def _training_section(recipe: dict, progress: dict) -> list[str]:
    data, train = recipe.get("data", {}), recipe.get("train", {})
    if not recipe:
        return []
    return ["## Data and training", "",
            _table([("data source", data.get("source")), ("data mode", data.get("mode", "regenerate")),
                    ("conversations (cap)", data.get("max_conversations")),
                    ("data minutes (cap)", data.get("max_minutes")),
                    ("training minutes (cap)", train.get("max_minutes")), ("epochs (cap)", train.get("epochs")),
                    ("batch size x accumulation", f"{train.get('batch_size')} x {train.get('grad_accum', 1)}"),
                    ("learning rate", train.get("lr")), ("steps done", progress.get("step", "-")),
                    ("training tokens seen", progress.get("tokens", "-")), ("seed", recipe.get("seed"))]), ""]


LAST_EVAL_SHAPE = {"date": str, "tau": NUMBER, "per_position_acceptance": list, "speedup_vs_plain": NUMBER,
                   "greedy_exact": bool, "exact_checked_prompts": int, "prompts": int, "prompts_source": str,
                   "max_new_tokens": int, "temperature": NUMBER, "proposal": str, "dtype": str, "device": str}


def read_last_eval(directory: Path, shape: dict = LAST_EVAL_SHAPE) -> dict | None:
    """The checkpoint's last_eval.json (what `draftsmith eval` measured on it), or None when there is none or
    it is damaged (said in the log: the card, bench and push then go without it).  shape: the keys the
    caller reads, and their types."""
    path = Path(directory) / LAST_EVAL_FILE
    if not path.is_file():
        return None
    try:
        report = read_kept_json(path, "the checkpoint's last evaluation", "It is left out; run `draftsmith eval` on "
                                "the checkpoint to measure it again", shape)
    except (OSError, KeptFileError) as err:
        log.warning("%s", err)
        return None
    rates = report["per_position_acceptance"]
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in rates):
        log.warning("%s (the checkpoint's last evaluation) is damaged: its per-position acceptance is not a list "
                    "of rates in [0, 1]. It is left out; run `draftsmith eval` on the checkpoint to measure it again",
                    path)
        return None
    return report


def _measured_section(heldout: dict, last_eval: dict | None) -> list[str]:
    lines = ["## Measured", ""]
    if heldout:
        lines += [f"- Held-out conversations at the end of training: top-1 agreement per draft position "
                  f"{_rates(heldout.get('heldout/agreement'))}, simulated tau {heldout.get('heldout/simulated_tau', 0):.2f}"
                  + (f"; decoding {heldout.get('eval/tau', 0):.2f} tau on held-out prompts" if "eval/tau" in heldout
                     else "") + "."]
    if last_eval:
        lines += [f"- Last `draftsmith eval` ({last_eval['date']}): tau {last_eval['tau']:.2f}, per-position "
                  f"acceptance {_rates(last_eval['per_position_acceptance'])}, {last_eval['speedup_vs_plain']:.2f}x "
                  f"over plain decoding, greedy output {'exact' if last_eval['greedy_exact'] else 'NOT exact'} "
                  f"({last_eval['exact_checked_prompts']} prompts checked in fp32). Conditions: "
                  f"{last_eval['prompts']} prompts of {last_eval['prompts_source']}, {last_eval['max_new_tokens']} new "
                  f"tokens, temperature {last_eval['temperature']}, {last_eval['proposal']} proposal, "
                  f"{last_eval['dtype']} on {last_eval['device']}. Speed depends on the machine: measure on yours."]
    if not heldout and not last_eval:
        lines += ["- Nothing measured yet: run `draftsmith eval` on this checkpoint."]
    return lines + [""]


def _serving_section(config: dict) -> list[str]:
    lines = ["## Serve it", ""]
    for fmt, declared in formats_of(config["kind"]).items():
        if declared.write is None:
            continue
        try:
            command = declared.serve(config)
        except ValueError as err:
            command = f"# not exportable to {fmt}: {err}"
        lines += [f"`{fmt}`:", "", "```bash", f"draftsmith export THIS_DIR --to {fmt} OUT_DIR",
                  command.replace("THIS_DIR", "OUT_DIR"), "```", ""]
    return lines


def write_card(directory: Path) -> Path:
    path = Path(directory) / CARD_FILE
    write_atomic(path, model_card(directory))
    return path


def record_eval(directory: Path, report) -> None:
    """The last evaluation, beside the checkpoint (and in its card)."""
    keep = ("tau", "per_position_acceptance", "speedup_vs_plain", "greedy_exact", "exact_checked_prompts", "prompts",
            "prompts_source", "max_new_tokens", "temperature", "proposal", "dtype", "device")
    summary = {k: getattr(report, k) for k in keep} | {"date": time.strftime("%Y-%m-%d")}
    write_atomic(Path(directory) / LAST_EVAL_FILE, json.dumps(summary, indent=1))
    write_card(directory)


def pushed_files() -> tuple[str, ...]:
    """What a pushed folder holds of a checkpoint: PUSHED, and the files drafters keep beside their weights
    (`checkpoint_files`: Medusa-2's state)."""
    extra = sorted({name for cls in registry().values() for name in cls.checkpoint_files})
    return PUSHED + tuple(extra)
