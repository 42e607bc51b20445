"""A LoRA adapter on the target (target.adapter): base + adapter is the target in every verb."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_config, make_tokenizer, save_lora, tiny_recipe
from draftsmith.heads.runtime.adapter import Adapter, AdapterError
from draftsmith.heads.drafter import checkpoint_target, load_drafter
from draftsmith.heads.runtime.target import Target, TargetError
from draftsmith.train.loop import fit
from draftsmith.train.settings import RecipeError, recipe_from_dict



@pytest.fixture(scope="module")
def lora_dir(tiny_target_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    return save_lora(AutoModelForCausalLM.from_pretrained(tiny_target_dir), tmp_path_factory.mktemp("lora"))


def logits_of(target: Target, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return target.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


def test_an_adapter_changes_the_target_and_is_part_of_its_identity(tiny_target_dir, lora_dir):
    bare = Target.load(str(tiny_target_dir), "float32")
    merged = Target.load(str(tiny_target_dir), "float32", adapter=lora_dir)
    layered = Target.load(str(tiny_target_dir), "float32", adapter=lora_dir, merge_adapter=False)
    ids = [7, 8, 9, 10, 11, 12]
    assert (logits_of(merged, ids) - logits_of(bare, ids)).abs().max() > 0.1            # the adapter matters
    assert torch.allclose(logits_of(merged, ids), logits_of(layered, ids), atol=1e-4)    # merging changes nothing
    assert merged.identity == layered.identity and merged.identity.adapter_sha256 == Adapter.read(lora_dir).sha256
    assert merged.identity.layers_sha256 == bare.identity.layers_sha256                  # the base's own hashes
    with pytest.raises(TargetError, match="LoRA adapter: none vs"):
        bare.identity.require_same(merged.identity, "a drafter")


def test_training_on_an_adapted_target_records_it_and_the_bare_base_is_refused(tiny_target_dir, lora_dir, tmp_path):
    from draftsmith.heads.decoding.verifier import decode

    spec = tiny_recipe(tmp_path, tiny_target_dir, epochs=2)
    spec["target"]["adapter"] = str(lora_dir)
    report = fit(recipe_from_dict(spec), progress=False)
    config = json.loads((Path(report.checkpoint) / "config.json").read_text())
    sha = Adapter.read(lora_dir).sha256
    assert config["target"]["adapter_sha256"] == sha and config["target_adapter"] == str(lora_dir.resolve())
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert manifest["target"]["adapter_sha256"] == sha
    with pytest.raises(TargetError, match="LoRA adapter"):
        load_drafter(report.checkpoint, Target.load(str(tiny_target_dir), "float32"))
    with pytest.raises(TargetError, match="LoRA adapter"):          # eval --adapter none
        load_drafter(report.checkpoint, checkpoint_target(config, "float32", "cpu", adapter="none"))
    target = checkpoint_target(config, "float32", "cpu")              # eval's default: the checkpoint's adapter
    drafter = load_drafter(report.checkpoint, target)
    for prompt in ([1, 5, 9, 30, 12], [1, 40, 41, 42]):                # lossless against the adapted target
        assert decode(target, prompt, 24, drafter).tokens == decode(target, prompt, 24).tokens
    shutil.copytree(tmp_path / "run" / "data", tmp_path / "bare" / "data")     # that data, under the bare base
    bare_spec = tiny_recipe(tmp_path, tiny_target_dir, epochs=1)
    bare_spec["output_dir"] = str(tmp_path / "bare")
    with pytest.raises(TargetError, match="LoRA adapter"):
        fit(recipe_from_dict(bare_spec), progress=False)


def test_bad_adapters_are_named(tiny_target_dir, tmp_path):
    from peft import IA3Config, get_peft_model
    from transformers import AutoModelForCausalLM

    with pytest.raises(AdapterError, match="no adapter_config.json"):
        Adapter.read(tmp_path)
    ia3 = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_target_dir),
                         IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]))
    ia3.save_pretrained(tmp_path / "ia3")
    with pytest.raises(AdapterError, match="'IA3' is not supported"):
        Adapter.read(tmp_path / "ia3")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(AdapterError, match="pickled"):
        Adapter.read(tmp_path / "pickled")
    with pytest.raises(RecipeError, match="pickled"):                 # a recipe names it before anything loads
        recipe_from_dict({"method": "medusa", "target": {"adapter": str(tmp_path / "pickled")}})
    narrow = AutoModelForCausalLM.from_config(make_config("llama", len(make_tokenizer()), hidden=32))
    save_lora(narrow, tmp_path / "narrow")
    with pytest.raises(AdapterError, match="does not fit target"):
        Target.load(str(tiny_target_dir), "float32", adapter=tmp_path / "narrow")


def test_export_of_a_drafter_for_an_adapted_target_says_how_to_serve_it(tiny_target_dir, lora_dir, tmp_path):
    from draftsmith.heads.drafter import save_drafter
    from draftsmith.export import export
    from draftsmith.heads.medusa import Medusa, MedusaConfig

    target = Target.load(str(tiny_target_dir), "float32", adapter=lora_dir)
    save_drafter(Medusa(MedusaConfig(num_heads=2, lm_head="shared"), target), tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "vllm", tmp_path / "vllm", dtype="float32")      # loads base + adapter
    readme = (out / "README.md").read_text()
    assert str(lora_dir.resolve()) in readme and "--enable-lora" in readme and "merge_and_unload" in readme
    save_drafter(Medusa(MedusaConfig(num_heads=2, lm_head="shared"), Target.load(str(tiny_target_dir), "float32")),
                 tmp_path / "bare-ckpt")
    assert "LoRA" not in (export(tmp_path / "bare-ckpt", "vllm", tmp_path / "bare", dtype="float32")
                          / "README.md").read_text()


def test_export_with_target_writes_the_merged_model(tiny_target_dir, lora_dir, tmp_path):
    from draftsmith.heads.drafter import save_drafter
    from draftsmith.export import export
    from draftsmith.heads.medusa import Medusa, MedusaConfig

    adapted = Target.load(str(tiny_target_dir), "float32", adapter=lora_dir)
    save_drafter(Medusa(MedusaConfig(num_heads=2, lm_head="shared"), adapted), tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "vllm", tmp_path / "vllm", dtype="float32", with_target=True)
    merged = Target.load(str(out / "target"), "float32")                       # a plain model, adapter inside
    ids = [7, 8, 9, 10, 11, 12]
    assert torch.allclose(logits_of(merged, ids), logits_of(adapted, ids), atol=1e-4)
