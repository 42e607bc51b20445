"""A drafter is one file: a toy drafter defined here alone, registered, then trained, evaluated, exported
and imported through the real CLI, with no other file of draftsmith knowing it exists
(docs/adding-a-drafter.md walks through the same steps)."""
import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from torch import nn

from conftest import chats_file, tiny_recipe
from draftsmith.cli import main
from draftsmith.heads.contract import DrafterBase
from draftsmith.heads.decoding.tree import DraftTree, TreeShape
from draftsmith.heads.draft_vocab import add_draft_vocabulary, set_draft_map
from draftsmith.heads.drafter import StepOutput, divide, read_weights, term_denominators
from draftsmith.heads.formats import ExportFormat, cast, fill, readme, renamed
from draftsmith.heads.registry import register, registry, unregister


@dataclass
class ToyConfig:
    draft_vocab_size: int | None = None
    init_from: str | None = None


class Toy(DrafterBase):
    """One residual projection of the target's final hidden state h_t, through the target's lm_head:
    it guesses token t+2 (one draft token per step)."""

    title = "toy drafter"
    config_class = ToyConfig

    def __init__(self, config: ToyConfig, target):
        super().__init__()
        self.config, self.target, self.target_identity = config, target, target.identity
        add_draft_vocabulary(self, target.vocab_size, target.vocab_size)
        self.proj = nn.Linear(target.hidden_size, target.hidden_size)
        nn.init.zeros_(self.proj.weight)
        self.tree = TreeShape.chain(1)
        self.metadata: dict = {}

    @staticmethod
    def parameter_layout(config: dict) -> dict:
        d, v = config["target"]["hidden_size"], config["target"]["vocab_size"]
        return {"draft_to_target": (v,), "proj.weight": (d, d), "proj.bias": (d,)}

    @property
    def required_layers(self):
        return (self.target.num_layers,)

    draft_positions = 1

    def set_draft_vocabulary(self, draft_to_target):
        set_draft_map(self, draft_to_target)

    def set_proposal(self, chain=None, **shape):
        return None

    def _logits(self, hidden):
        hidden = hidden.to(self.proj.weight.dtype)
        return self.target.compute_logits(hidden + self.proj(hidden)).float()

    def loss_counts(self, batch):
        return batch["loss_mask"][:, 2:].bool().sum().reshape(1)

    def loss(self, batch):
        hidden = batch["features"][self.target.num_layers][:, :-2]
        mask = batch["loss_mask"][:, 2:].bool()
        labels = batch["input_ids"][:, 2:][mask]
        logits = self._logits(hidden[mask])
        total = F.cross_entropy(logits, labels, reduction="sum")
        loss = divide(total, term_denominators(batch, self.loss_counts(batch))[0])
        correct = (logits.argmax(-1) == labels).sum().reshape(1)
        return StepOutput(loss=loss, correct=correct, counted=mask.sum().reshape(1))

    def reset(self):
        return None

    @torch.no_grad()
    def propose(self, context):
        hidden = context.hidden[self.target.num_layers][-1:]
        token = self._logits(hidden).argmax(-1)
        return DraftTree(tokens=token.reshape(1), parents=self.tree.parents)


# its one serving format: a made-up stack that names the projection "layer"
def write_toy(config, weights, target, dtype, checkpoint):
    files = {"config.json": {"toy_stack": True, "hidden_size": config["target"]["hidden_size"]},
             "README.md": readme(config, checkpoint, "toy drafter", serve_toy(config))}
    return {"model.safetensors": cast(renamed(config, weights, "toy-stack"), dtype)}, files


def serve_toy(config):
    return "toy-serve TARGET_DIR --draft THIS_DIR"


def read_toy(config, weights, target, confirmed=False):
    drafter = Toy(ToyConfig(), target)
    fill(drafter, weights, "toy-stack", torch.arange(target.vocab_size))
    return drafter


Toy.formats = (ExportFormat("toy-stack", write_toy, serve_toy, rules=((r"^proj\.", "layer."),), read=read_toy,
                            recognizes=lambda config: bool(config.get("toy_stack"))),)


@pytest.fixture
def toy():
    register("toy")(Toy)
    yield Toy
    unregister("toy")


def test_a_drafter_in_one_file_trains_evaluates_exports_and_imports(toy, tiny_target_dir, tmp_path, capsys):
    assert registry()["toy"] is Toy
    raw = tiny_recipe(tmp_path, tiny_target_dir, max_steps=4, eval_prompts=0)
    raw["method"], raw["drafter"] = "toy", {}
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["train", str(recipe)]) == 0
    checkpoint = tmp_path / "run" / "checkpoint"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["kind"] == "toy" and "toy drafter" in (checkpoint / "README.md").read_text()
    trained = read_weights(checkpoint)
    assert trained["proj.weight"].abs().sum() > 0                  # training moved it off its zero start

    prompts = chats_file(tmp_path / "p.jsonl", 2)
    report = tmp_path / "eval.json"
    assert main(["eval", str(checkpoint), "--prompts", str(prompts), "--limit", "2", "--max-new-tokens", "6",
                 "--exact-prompts", "1", "--baselines", "plain", "--json", str(report)]) == 0
    measured = json.loads(report.read_text())
    assert measured["greedy_exact"] is True and measured["tau"] >= 1.0

    exported = tmp_path / "export"
    assert main(["export", str(checkpoint), "--to", "toy-stack", str(exported), "--dtype", "float32"]) == 0
    tensors = load_file(str(exported / "model.safetensors"))
    assert set(tensors) == {"layer.weight", "layer.bias"}
    assert torch.equal(tensors["layer.weight"], trained["proj.weight"])
    assert "toy-serve" in (exported / "README.md").read_text()

    back = tmp_path / "imported"
    assert main(["import", str(exported), "--from", "toy-stack", str(back), "--target", str(tiny_target_dir)]) == 0
    again = read_weights(back)
    assert torch.equal(again["proj.weight"], trained["proj.weight"]) and torch.equal(again["proj.bias"],
                                                                                     trained["proj.bias"])
    capsys.readouterr()


def test_a_second_class_under_a_taken_kind_is_refused(toy):
    class Other(Toy):
        pass

    with pytest.raises(ValueError, match="registered twice"):
        register("toy")(Other)
    assert registry()["toy"] is Toy
