"""Medusa-2: heads trained jointly with a LoRA on the backbone (self-distillation)."""
import json
from pathlib import Path

import pytest
import torch
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import checkpoint_target, load_drafter, read_config
from draftsmith.heads.medusa2 import Medusa2, Medusa2Config
from draftsmith.heads.runtime.target import Target
from draftsmith.train.loop import fit
from draftsmith.train.settings import recipe_from_dict
from safetensors.torch import load_file
from conftest import tiny_recipe

JOINT = {"num_heads": 2, "lm_head": "shared", "draft_vocab_size": None, "lora_r": 4, "lora_alpha": 8,
         "heads_coefficient": 0.5, "ramp_steps": 2, "heads_only_steps": 2}


def medusa2_recipe(tmp_path, target_dir, out="run", **train):
    spec = tiny_recipe(tmp_path, target_dir, **train)
    spec.update(method="medusa2", drafter=dict(JOINT), output_dir=str(tmp_path / out))
    return spec


def test_the_distillation_kl_starts_at_zero_and_the_ramp_starts_after_the_heads_alone(tiny_target_dir):
    target = Target.load(str(tiny_target_dir), "float32")
    drafter = Medusa2(Medusa2Config(**JOINT), target)
    drafter.attach_backbone()
    ids = torch.tensor([[1, 5, 9, 30, 12, 40, 41, 42]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])}
    assert drafter.distill_kl(batch, drafter._adapted_hidden(batch, grad=False)).item() == 0.0     # B starts at zero
    assert [drafter.heads_weight(s) for s in range(2)] == [0.0, 0.0]
    assert 0 < drafter.heads_weight(2) < drafter.heads_weight(3) == pytest.approx(0.5)


def test_medusa2_trains_the_lora_keeps_the_original_and_decodes_the_adapted_model_exactly(tiny_target_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    report = fit(recipe_from_dict(medusa2_recipe(tmp_path, tiny_target_dir, epochs=3)), progress=False)
    ckpt = Path(report.checkpoint)
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["kind"] == "medusa" and raw["target_adapter"] == "adapter"         # loads as Medusa, adapter beside it
    lora = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in lora.items())      # the LoRA trained (B left zero)
    assert not any(k.startswith("backbone") for k in load_file(str(ckpt / "model.safetensors")))
    config = read_config(ckpt)
    target = checkpoint_target(config, "float32", "cpu")                           # base + the trained adapter
    assert target.identity.adapter_sha256 == raw["target"]["adapter_sha256"] != ""
    bare = Target.load(str(tiny_target_dir), "float32")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    assert all(torch.equal(a, b) for a, b in zip(bare.model.parameters(), fresh.parameters()))  # original untouched
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_target_dir), str(ckpt / "adapter"))
    ids = torch.tensor([[1, 5, 9, 30, 12]])
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, target.model(input_ids=ids).logits, atol=1e-4)
        assert not torch.allclose(bare.model(input_ids=ids).logits, target.model(input_ids=ids).logits, atol=1e-4)
    drafter = load_drafter(ckpt, target)
    for prompt in ([1, 5, 9, 30, 12], [1, 40, 41, 42]):
        assert decode(target, prompt, 24, drafter).tokens == decode(target, prompt, 24).tokens


def test_medusa2_resumes_exactly(tiny_target_dir, tmp_path, monkeypatch):
    """Killed after the step-3 save (inside the joint stage), resumed: the heads and the LoRA end as in one run."""
    import shutil

    from draftsmith.train import loop

    spec = {"max_steps": 6, "epochs": 5, "save_every": 3}
    whole = fit(recipe_from_dict(medusa2_recipe(tmp_path, tiny_target_dir, "whole", **spec)), progress=False)
    shutil.copytree(tmp_path / "whole" / "data", tmp_path / "half" / "data")
    stop = loop._stop_reason

    def killed_at_step_4(settings, state, total_steps):
        if state["step"] == 4:
            raise KeyboardInterrupt("killed")
        return stop(settings, state, total_steps)

    monkeypatch.setattr(loop, "_stop_reason", killed_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        fit(recipe_from_dict(medusa2_recipe(tmp_path, tiny_target_dir, "half", **spec)), progress=False)
    monkeypatch.setattr(loop, "_stop_reason", stop)
    resumed = fit(recipe_from_dict({**medusa2_recipe(tmp_path, tiny_target_dir, "half", **spec), "resume": True}),
                  progress=False)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(str(Path(whole.checkpoint) / name)), load_file(str(Path(resumed.checkpoint) / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_medusa2_refuses_a_target_that_cannot_take_gradients(tiny_target_dir, tmp_path):
    from draftsmith.heads.runtime.cpu_linear import fbgemm_fp16_available
    if not fbgemm_fp16_available():
        pytest.skip("float16 on this CPU is plain float32 (no FBGEMM): nothing packed to refuse")
    drafter = Medusa2(Medusa2Config(**JOINT), Target.load(str(tiny_target_dir), "float16", "cpu"))
    with pytest.raises(ValueError, match="cannot take gradients.*target.dtype=float32"):
        drafter.attach_backbone()


def test_drift_is_zero_against_itself_and_seen_against_a_changed_model(tiny_target_dir, tmp_path):
    from draftsmith.eval.drift import drift
    from conftest import save_lora
    from transformers import AutoModelForCausalLM

    bare = Target.load(str(tiny_target_dir), "float32")
    prompts = [("a", [1, 5, 9, 30, 12]), ("b", [1, 40, 41, 42])]
    same = drift(bare, bare, prompts, 16)
    assert same["token_agreement"] == 1.0 and same["mean_kl"] == pytest.approx(0, abs=1e-6)
    assert same["identical_replies"] == 1.0
    lora = save_lora(AutoModelForCausalLM.from_pretrained(tiny_target_dir), tmp_path / "lora")
    changed = drift(Target.load(str(tiny_target_dir), "float32", adapter=lora), bare, prompts, 16)
    assert changed["token_agreement"] < 1.0 and changed["mean_kl"] > 0.01
