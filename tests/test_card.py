"""Hub conventions: the model card a checkpoint carries, the folder `draftsmith push` uploads, from_pretrained."""
import json
from pathlib import Path

import pytest
import torch
import yaml
from draftsmith.cli import main
from draftsmith.train.loop import fit
from draftsmith.train.settings import recipe_from_dict
from conftest import tiny_recipe


@pytest.fixture(scope="module")
def trained(tiny_target_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("card")
    raw = tiny_recipe(tmp, tiny_target_dir, epochs=1, eval_prompts=1)
    raw["drafter"].update(draft_vocab_size=None, lm_head="shared")
    report = fit(recipe_from_dict(raw), progress=False)
    return Path(report.checkpoint), tmp


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_a_trained_checkpoint_carries_a_model_card_and_eval_adds_its_figures(trained, capsys):
    checkpoint, tmp = trained
    config = json.loads((checkpoint / "config.json").read_text())
    card = (checkpoint / "README.md").read_text()
    assert front_matter(card) == {"base_model": config["target"]["name"], "library_name": "draftsmith",
                                  "tags": ["speculative-decoding", "draft-model", "draftsmith", "medusa"]}
    assert f"`{config['target']['weights_sha256']}`" in card and f"`{config['target']['layers_sha256']}`" in card
    assert f"| {config['target_layer_ids']} |" in card.replace("] |", "] |")
    assert f"| data source | {tmp / 'chats.jsonl'} |" in card
    agreement = " ".join(f"{a:.3f}" for a in config["heldout"]["heldout/agreement"])
    assert f"top-1 agreement per draft position {agreement}" in card
    assert "draftsmith export THIS_DIR --to vllm OUT_DIR" in card and '"method": "medusa"' in card
    assert "Last `draftsmith eval`" not in card
    assert main(["eval", str(checkpoint), "--prompts", str(tmp / "chats.jsonl"), "--limit", "2",
                 "--max-new-tokens", "8", "--exact-prompts", "1", "--baselines", "plain"]) == 0
    last = json.loads((checkpoint / "last_eval.json").read_text())
    card = (checkpoint / "README.md").read_text()
    assert f"Last `draftsmith eval` ({last['date']}): tau {last['tau']:.2f}" in card
    assert f"{last['prompts']} prompts of" in card and "greedy output exact" in card


def test_push_uploads_the_checkpoint_without_its_resume_state_plus_the_exports(trained, monkeypatch, capsys):
    from huggingface_hub import HfApi

    checkpoint, _ = trained
    seen = {}

    def create_repo(self, repo_id, private=False, exist_ok=False, **kwargs):
        seen["created"] = (repo_id, private, exist_ok)

    def upload_folder(self, folder_path, repo_id, commit_message=None, **kwargs):
        folder = Path(folder_path)
        seen["files"] = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        seen["card"] = (folder / "README.md").read_text()
        return "commit-id"

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    assert main(["push", str(checkpoint), "me/tiny-medusa", "--export", "vllm", "--private"]) == 0
    assert seen["created"] == ("me/tiny-medusa", True, True)
    assert {"config.json", "model.safetensors", "README.md", "recipe.yaml", "export-vllm/model.safetensors",
            "export-vllm/config.json", "export-vllm/README.md"} <= set(seen["files"])
    assert not any(f.startswith("state/") for f in seen["files"])            # no optimizer, no RNG
    assert seen["card"].startswith("---\nbase_model:")
    assert "pushed" in capsys.readouterr().out


def test_from_pretrained_loads_a_directory_and_names_what_it_cannot_fetch(trained, monkeypatch):
    import huggingface_hub
    from draftsmith.export.hub import Drafter
    from draftsmith.heads.drafter import load_drafter
    from draftsmith.heads.runtime.target import Target

    checkpoint, _ = trained
    drafter = Drafter.from_pretrained(str(checkpoint), dtype="float32", device="cpu")
    config = json.loads((checkpoint / "config.json").read_text())
    reference = load_drafter(checkpoint, Target.load(config["target_source"], "float32", "cpu"))
    for (name, a), (_, b) in zip(drafter.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match=r"drafter 'nobody/no-drafter' could not be fetched from the Hugging "
                                                r"Face Hub .* give a local checkpoint directory"):
        Drafter.from_pretrained("nobody/no-drafter")
    with pytest.raises(FileNotFoundError, match="neither a checkpoint directory nor a Hub repository id"):
        Drafter.from_pretrained("no/such/dir")
