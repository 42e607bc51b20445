"""Tiny models built in-process: 2 layers, hidden 64, a word-level vocabulary of a few hundred tokens.

Nothing is downloaded.  A tiny target is saved to a temporary directory with
its tokenizer, so tests load it through the same path as a user's local
Hugging Face directory.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):      # `make test` runs 2 workers on the machine's cores: a thread
    os.environ.setdefault("OMP_NUM_THREADS", "1")     # each, so neither starves the other (nor the
                                                        # processes its tests start, which inherit this)
import torch  # noqa: E402

from tiny_models import CHATML, SPECIALS, WORDS, build_tiny_target, chats_file, make_config, make_tokenizer  # noqa: F401


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from draftsmith.heads.runtime.target import Target

    return Target.load(str(tiny_target_dir), "float32")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: without one they are deselected (and counted as such in the
    summary), never reported as passed or skipped."""
    if torch.cuda.is_available():
        return
    kept = [item for item in items if item.get_closest_marker("gpu") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("gpu") is not None])
        items[:] = kept


# -- the real default target (slow and serving tests) ------------------------------------------

# Training steps per drafter: about 30 s each on a quiet 2-core machine for the three whose acceptance the
# tests read, about 15 s for DFlash and Medusa-2 (their tests compare vLLM's acceptance with draftsmith's,
# whatever it is).  Steps, not minutes: a loaded machine gets the same drafters, only later.
STEPS = {"eagle3": 60, "p_eagle": 60, "medusa": 24, "dflash": 30, "medusa2": 12}


class DefaultRuns(dict):
    """method -> checkpoint, each drafter trained the first time a test asks for it: the default run trains
    only what its tests read (Medusa-2, about 4.5 minutes of a worker, only the heavy tier reads).  The
    data is generated once, by EAGLE-3 (trained first: its cache holds every layer the others read)."""

    def __init__(self, out: Path, common: dict, drafters: dict):
        super().__init__()
        self.out, self.common, self.drafters = out, common, drafters
        self["eagle3"]                           # noqa: B018 -- the data, and the drafter most tests read

    def __missing__(self, method: str) -> Path:
        import shutil

        from draftsmith.train.loop import fit
        from draftsmith.train.settings import recipe_from_dict

        if method not in self.drafters:
            raise KeyError(f"the default run trains {', '.join(self.drafters)}, not '{method}'")
        spec = {**self.common, "method": method, "drafter": self.drafters[method],
                "output_dir": str(self.out / method)}
        spec["train"] = {**self.common["train"], "max_steps": STEPS[method]}
        if method == "medusa2":  # its backbone takes gradients: an unpacked target
            spec["target"] = {"path": "smollm2-135m", "dtype": "float32"}
        if method != "eagle3":   # the same data (and cache: layer 30 is among EAGLE-3's), no second generation
            shutil.copytree(self.out / "eagle3" / "data", self.out / method / "data")
        self[method] = fit(recipe_from_dict(spec), progress=False).checkpoint
        return self[method]


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """Self-distilled data on SmolLM2-135M, then a few steps of training (STEPS) each for an EAGLE-3, a
    P-EAGLE, a Medusa, a DFlash and a Medusa-2 drafter (each when a test first reads it: DefaultRuns), no
    decoding evaluation at the end (train.eval_prompts 0: the tests evaluate).  train.max_minutes is only a
    ceiling for a pathologically slow machine.  Medusa scores the full vocabulary (vLLM 0.32 cannot load a
    Medusa token_map)."""
    out = tmp_path_factory.mktemp("default-run")
    common = {
        "output_dir": str(out), "seed": 0, "target": {"path": "smollm2-135m"},
        "data": {"max_conversations": 64, "batch_size": 32, "max_new_tokens": 96, "max_prompt_tokens": 128},
        "train": {"batch_size": 8, "lr": 3e-3, "warmup_steps": 5, "epochs": 20, "max_minutes": 4,
                  "save_every": 1000, "heldout_fraction": 0.1, "eval_prompts": 0},
    }
    medusa = {"num_heads": 3, "lm_head": "shared", "draft_vocab_size": None}
    eagle = {"layer_ids": [2, 15, 27], "draft_vocab_size": 2048, "tree": {"depth": 3, "top_k": 1, "total_tokens": 3}}
    return DefaultRuns(out, common, {
        "eagle3": {**eagle, "ttt_steps": 2}, "p_eagle": {**eagle, "ttt_steps": 3}, "dflash": {**eagle, "block_size": 4},
        "medusa": medusa,
        "medusa2": {**medusa, "lora_r": 8, "lora_alpha": 16, "heads_only_steps": 5, "ramp_steps": 5}})


def kill_at_step(proc, checkpoint: Path, step: int, group: bool = False, timeout: float = 300) -> dict:
    """SIGKILL `proc` (its whole process group with group=True) once the checkpoint in `checkpoint`
    has saved `step` steps; returns the saved progress (what a resume starts from)."""
    import json
    import signal
    import time

    progress = Path(checkpoint) / "state" / "progress.json"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if json.loads(progress.read_text() or "{}").get("step", 0) >= step:
                break
        except (OSError, ValueError):            # not written yet, or swapped in this very moment
            pass
        time.sleep(0.01)
    if group:
        os.killpg(proc.pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    if not progress.exists():                    # killed inside the swap: the resume reads checkpoint.old
        progress = Path(str(checkpoint) + ".old") / "state" / "progress.json"
    return json.loads(progress.read_text())


# -- helpers shared by several test files --------------------------------------------------------------

LORA_MODULES = ["q_proj", "v_proj", "down_proj"]     # what save_lora adapts

@pytest.fixture(scope="session")
def checkpoint(tiny_target_dir, tmp_path_factory):
    """A tiny Medusa checkpoint trained once, shared by the bench tests (read-only for them)."""
    import yaml
    from draftsmith.cli import main

    work = tmp_path_factory.mktemp("bench")
    recipe = {
        "method": "medusa", "output_dir": str(work / "run"), "seed": 0,
        "target": {"path": str(tiny_target_dir), "dtype": "float32", "device": "cpu"},
        "data": {"source": str(chats_file(work / "chats.jsonl", 24)), "max_conversations": None, "batch_size": 8,
                 "max_new_tokens": 12},
        "drafter": {"num_heads": 2, "lm_head": "shared", "draft_vocab_size": 64},
        "train": {"epochs": 1, "batch_size": 4, "warmup_steps": 1, "mixed_precision": "no", "eval_prompts": 0,
                  "heldout_fraction": 0.2},
    }
    path = work / "recipe.yaml"
    path.write_text("# draftsmith train recipe.yaml\n" + yaml.safe_dump(recipe))
    assert main(["train", str(path)]) == 0
    return work / "run" / "checkpoint"


def tiny_recipe(tmp_path, target_dir, **train):
    return {
        "method": "medusa", "output_dir": str(tmp_path / "run"), "seed": 0,
        "target": {"path": str(target_dir), "dtype": "float32"},
        "data": {"source": str(chats_file(tmp_path / "chats.jsonl", 40)), "max_conversations": None,
                 "batch_size": 8, "max_new_tokens": 24},
        "drafter": {"num_heads": 3, "lm_head": "own", "draft_vocab_size": 64},
        "train": {"epochs": 2, "batch_size": 4, "lr": 1e-2, "warmup_steps": 2, "log_every": 2, "save_every": 3,
                  "mixed_precision": "no", "heldout_fraction": 0.2, **train},
    }


def prompts(target, count=4, length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, target.vocab_size, (length,), generator=g).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    from draftsmith.heads.runtime.target import Target

    directory = build_tiny_target(tmp_path_factory.mktemp("tiny-vocab"), seed=3, vocab_size=12, sharpen=1.5)
    return Target.load(str(directory), "float32")


def exact_two_token_distribution(target, prompt, temperature):
    """P(x1, x2 | prompt) by enumeration: [v, v]."""
    from draftsmith.heads.decoding.sampling import probabilities

    v = target.vocab_size
    with torch.no_grad():
        p1 = probabilities(target.model(input_ids=torch.tensor([prompt])).logits[0, -1], temperature)
        batch = torch.tensor([prompt + [x] for x in range(v)])
        p2 = probabilities(target.model(input_ids=batch).logits[:, -1], temperature)
    return p1[:, None] * p2


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test, cells with expected count < 5 pooled; p from the regularized upper incomplete gamma."""
    n = counts.sum()
    expected = expected_probs.flatten() * n
    counts = counts.flatten().double()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


class RandomDrafter:  # noqa: D101 - a Proposer (heads/contract.py)
    """Proposes from a fixed, wrong distribution q: as a chain of i.i.d. samples with q attached (classic rule),
    or as a top-k tree (point-mass rule)."""

    required_layers = ()

    def __init__(self, vocab, shape, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(torch.randn(vocab, generator=g) * 2, -1)
        self.shape = shape
        self.g = torch.Generator().manual_seed(seed + 1)

    def reset(self):
        pass

    def observe(self, path):
        pass

    def propose(self, context):
        from draftsmith.heads.decoding.tree import DraftTree

        if self.shape == "chain":
            tokens = torch.multinomial(self.q, 2, replacement=True, generator=self.g)
            return DraftTree(tokens=tokens, parents=torch.tensor([-1, 0]), draft_probs=self.q.expand(2, -1))
        top = self.q.topk(3).indices              # 3 candidates at depth 1, 2 under the first
        return DraftTree(tokens=torch.cat([top, top[:2]]), parents=torch.tensor([-1, -1, -1, 0, 0]))


def sample_pairs(target, drafter, prompt, runs, temperature, rule="auto"):
    """Counts [v, v] of the first two tokens of `runs` speculative decodes (end to end, through the model)."""
    from draftsmith.heads.decoding.verifier import decode

    v = target.vocab_size
    counts = torch.zeros(v, v)
    g = torch.Generator().manual_seed(1234)
    for _ in range(runs):
        out = decode(target, prompt, 2, drafter=drafter, temperature=temperature, rule=rule, generator=g)
        counts[out.tokens[0], out.tokens[1]] += 1
    return counts


class OracleDrafter:
    """Proposes the target's own greedy continuation: every draft is accepted (tau = K + 1)."""

    required_layers = ()

    def __init__(self, target, depth):
        self.target, self.depth = target, depth
        self.sequence: list[int] = []

    def reset(self):
        self.sequence = []

    def observe(self, path):
        pass

    def propose(self, context):
        from draftsmith.heads.decoding.tree import DraftTree
        from draftsmith.heads.decoding.verifier import decode

        self.sequence += context.tokens.tolist()
        continuation = decode(self.target, self.sequence + [context.next_token], self.depth + 1).tokens
        proposal = continuation[: self.depth]
        return DraftTree(tokens=torch.tensor(proposal), parents=torch.arange(len(proposal)) - 1)


def one_training_step(target, drafter, ids: torch.Tensor) -> tuple:
    """One AdamW step of `drafter` on rows `ids` [2, 12] (loss on the last 8 tokens), with the target's
    features computed online; returns the loss output before the step and the loss after it."""
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "loss_mask": torch.cat([torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)], 1)}
    batch["features"] = target.features(ids, batch["attention_mask"], drafter.required_layers)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    first = drafter.loss(batch)
    first.loss.backward()
    optimizer.step()
    return first, drafter.loss(batch).loss


def medusa_checkpoint(target, directory, **config):
    from draftsmith.heads.drafter import save_drafter
    from draftsmith.heads.medusa import Medusa, MedusaConfig

    torch.manual_seed(0)
    drafter = Medusa(MedusaConfig(**config), target)
    for block in drafter.blocks:
        torch.nn.init.normal_(block[0].linear.weight, std=0.3)
    if config.get("draft_vocab_size"):
        drafter.set_draft_vocabulary(torch.arange(5, 5 + config["draft_vocab_size"]))
    save_drafter(drafter, directory)
    return drafter


def eagle3_checkpoint(target, directory, layer_ids=(1, 1, 2)):
    from draftsmith.heads.drafter import save_drafter
    from draftsmith.heads.eagle3 import Eagle3, Eagle3Config

    torch.manual_seed(0)
    drafter = Eagle3(Eagle3Config(layer_ids=list(layer_ids), draft_vocab_size=40), target)
    drafter.set_draft_vocabulary(torch.arange(40) * 3)
    save_drafter(drafter, directory)
    return drafter


def save_lora(model, out: Path, seed: int = 0, **config) -> Path:
    """A random LoRA adapter (B not zero, so it changes the model) in peft's own format."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": LORA_MODULES, "init_lora_weights": False} | config
    peft_model = get_peft_model(model, LoraConfig(**settings))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(out)
    return out


def fake_hub(monkeypatch) -> dict:
    """`push` without a network: a token, create_repo a no-op, and upload_folder recording each file it is
    given (seen["files"]: name -> bytes)."""
    from huggingface_hub import HfApi

    seen = {}

    def upload_folder(self, folder_path, repo_id, commit_message=None, **kwargs):
        folder = Path(folder_path)
        seen["files"] = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        return "commit"

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(HfApi, "create_repo", lambda self, *a, **k: None)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return seen


def free_port() -> int:
    """A local port nothing holds now (for a launch's rendezvous)."""
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
