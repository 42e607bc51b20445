"""Every command a shipped recipe's header gives is run here as written, with CPU overrides only: the
recipe copied with a tiny target, tiny sizes and the transformers data backend (`cpu_recipe`), 2 CPU
processes for torchrun and accelerate, and a short eval (`EVAL_OVERRIDES`, flags after the recipe's own,
so they win).  Paths the header names (recipes/NAME.yaml, runs/...) point into the test's directory.
`draftsmith quickstart` is `make demo`, run as such."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import free_port
from tiny_models import chats_file, dialogues_file

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if not p.stem.startswith("quickstart"))
EVAL_OVERRIDES = ["--limit", "1", "--max-new-tokens", "8", "--exact-prompts", "1", "--baselines", "plain",
                  "--device", "cpu"]


def header_commands(recipe: Path) -> list[str]:
    """The commands of the recipe's header comment, in order: lines (or `then:` / `first:` parts) that
    start with draftsmith, torchrun or accelerate, a trailing `(...)` remark dropped."""
    commands = []
    for line in recipe.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = re.sub(r"^#\s*(then:|before any of it:)?\s*", "", line)
        if re.match(r"(draftsmith|torchrun|accelerate) ", text):
            commands.append(re.sub(r"\s+\(.*\)\s*$", "", text).strip())
    return commands


def test_every_recipe_header_gives_its_commands():
    """The parser sees what a reader sees: a train command, and an eval, in every recipe's header."""
    for recipe in RECIPES:
        commands = header_commands(recipe)
        assert any(" train " in f" {c} " for c in commands), (recipe.name, commands)
        assert any(c.startswith("draftsmith eval ") for c in commands), (recipe.name, commands)


def cpu_recipe(recipe: Path, work: Path, target_dir: Path) -> Path:
    """The recipe with the CPU overrides: a tiny target (its own prompt format settings kept), tiny sizes."""
    raw = yaml.safe_load(recipe.read_text())
    raw["output_dir"] = str(work / "runs" / recipe.stem)
    raw["target"] = {**raw.get("target", {}), "path": str(target_dir), "dtype": "float32"}
    raw["target"].pop("device_map", None)                          # one CPU
    prefill = raw.get("data", {}).get("mode") == "prefill"          # the source's replies are read: dialogues
    source = dialogues_file(work / "dialogues.jsonl", 12) if prefill else chats_file(work / "chats.jsonl", 12)
    raw["data"] = {**raw.get("data", {}), "source": str(source), "backend": "transformers",
                   "max_conversations": 8, "batch_size": 4, "max_new_tokens": 8, "max_prompt_tokens": 64,
                   "max_seq_len": 128, "max_minutes": None}
    raw["data"].pop("vllm", None)
    if raw["data"].get("thinking", "template") != "template":    # the tiny target's template has no switch
        from test_reasoning_data import QWEN3_STYLE
        (work / "qwen3-style.jinja").write_text(QWEN3_STYLE)
        raw["target"]["chat_template"] = str(work / "qwen3-style.jinja")
    drafter = raw.setdefault("drafter", {})
    if "layer_ids" in drafter:
        drafter["layer_ids"] = [1, 1, 2]
    if drafter.get("draft_vocab_size"):
        drafter["draft_vocab_size"] = 64
    train = raw.setdefault("train", {})
    train.update(epochs=1, batch_size=2, grad_accum=1, max_minutes=0.03, warmup_steps=1, eval_every=0,
                 eval_prompts=1, save_every=1000, report_to="none")
    train.pop("wandb_project", None)
    path = work / "recipes" / recipe.name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def as_run(command: str, recipe: Path, cpu: Path, work: Path) -> list[str]:
    """The header's command with the CPU overrides: this environment's executables, the CPU recipe and
    the test's runs/, 2 CPU processes, a short eval."""
    text = command.replace(f"recipes/{recipe.name}", str(cpu)).replace(" runs/", f" {work / 'runs'}/")
    argv = shlex.split(text)
    bin_dir = Path(sys.executable).parent
    if argv[0] == "torchrun":
        at = argv.index("--nproc-per-node")
        argv = [str(bin_dir / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port())] + \
            argv[at + 2:]
    elif argv[0] == "accelerate":
        argv = [str(bin_dir / "accelerate"), "launch", "--num_processes", "2", "--main_process_port",
                str(free_port())] + [str(REPO / a) if a.startswith("recipes/accelerate/") else a for a in argv[2:]]
    if "eval" in argv[:4]:
        argv += EVAL_OVERRIDES
    return argv


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_a_recipe_headers_commands_run_as_written(recipe, tiny_target_dir, tmp_path, capsys, monkeypatch):
    """`draftsmith ...` runs in this process (draftsmith.cli.main, the console script's function: the
    same command without 6 s of imports); torchrun and accelerate launch their processes."""
    from draftsmith.cli import main

    commands = header_commands(recipe)
    if yaml.safe_load(recipe.read_text())["method"] == "mtp":     # a target that ships an MTP layer
        from tiny_models import build_mtp_target
        tiny_target_dir = build_mtp_target(tmp_path / "mtp-target", "glm4_moe")
    cpu = cpu_recipe(recipe, tmp_path, tiny_target_dir)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    monkeypatch.chdir(tmp_path)
    for command in commands:
        argv = as_run(command, recipe, cpu, tmp_path)
        if argv[0] == "draftsmith":
            code = main(argv[1:])
            assert code == 0, (command, argv, capsys.readouterr().err[-3000:])
            continue
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (command, argv, done.stdout[-1500:], done.stderr[-3000:])
    assert (tmp_path / "runs" / recipe.stem / "checkpoint" / "config.json").is_file()
