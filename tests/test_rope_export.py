"""Rope scaling survives export: every EAGLE-3 and DFlash export writes `rope_parameters` (transformers 5),
the legacy `rope_scaling` and `rope_theta` from the same settings, and a reader of either spelling gets the
target's rotary angles back, far past the original context (position 4,000), for llama3 and YaRN scaling."""
import json

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from draftsmith.export import export
from draftsmith.heads.drafter import save_drafter
from draftsmith.heads.formats import rope_fields
from draftsmith.heads.runtime.target import Target
from tiny_models import build_tiny_target

SCALINGS = {
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "original_max_position_embeddings": 512},
}
FAR = 4000          # past every original context above: the scaled angles differ from the plain ones there
WRITES = {"eagle3": ("vllm", "speculators", "sglang", "trtllm"), "dflash": ("vllm", "speculators")}


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def scaled_target(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"rope-{request.param}")
    build_tiny_target(directory, "llama", overrides={"rope_parameters": SCALINGS[request.param],
                                                     "max_position_embeddings": 8192})
    return request.param, Target.load(str(directory), "float32")


def angles(rotary, head_dim: int, position: int = FAR) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, 1, head_dim)
    return rotary(x, torch.tensor([[position]]))


def drafter_of(kind: str, target):
    torch.manual_seed(0)
    if kind == "eagle3":
        from draftsmith.heads.eagle3 import Eagle3, Eagle3Config
        ids = [1, 2, 3] if target.num_layers >= 3 else [1, 1, 2]     # the speculators library wants them distinct
        drafter = Eagle3(Eagle3Config(layer_ids=ids, draft_vocab_size=40), target)
    else:
        from draftsmith.heads.dflash import DFlash, DFlashConfig
        drafter = DFlash(DFlashConfig(layer_ids=[1, 2], num_layers=1, draft_vocab_size=40), target)
    drafter.set_draft_vocabulary(torch.arange(40) * 3)
    return drafter


def test_rope_fields_spell_one_setting_three_ways():
    plain = rope_fields({"rope_type": "default", "rope_theta": 1e4})
    assert plain == {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": None,
                     "rope_theta": 1e4}
    scaled = rope_fields(SCALINGS["llama3"])
    assert scaled["rope_scaling"] == {k: v for k, v in SCALINGS["llama3"].items() if k != "rope_theta"}
    assert scaled["rope_parameters"] == SCALINGS["llama3"] and scaled["rope_theta"] == 500000.0


@pytest.mark.parametrize("kind", sorted(WRITES))
def test_every_export_carries_the_scaling_in_both_spellings(scaled_target, kind, tmp_path):
    name, target = scaled_target
    drafter = drafter_of(kind, target)
    head_dim = drafter.shape.head_dim
    theirs_cos, theirs_sin = angles(target.decoder.rotary_emb, head_dim)
    mine_cos, mine_sin = angles(drafter.rotary, head_dim)
    plain_cos, _ = angles(LlamaRotaryEmbedding(LlamaConfig(head_dim=head_dim, hidden_size=64, num_attention_heads=4,
                                                           rope_theta=SCALINGS[name]["rope_theta"])), head_dim)
    assert not torch.allclose(theirs_cos, plain_cos, atol=1e-3)       # the scaling matters at this position
    torch.testing.assert_close(mine_cos, theirs_cos) and torch.testing.assert_close(mine_sin, theirs_sin)
    save_drafter(drafter, tmp_path / "ckpt")
    layer_class, rotary_class = ((LlamaConfig, LlamaRotaryEmbedding) if kind == "eagle3"
                                 else (Qwen3Config, Qwen3RotaryEmbedding))
    for fmt in WRITES[kind]:
        written = json.loads((export(tmp_path / "ckpt", fmt, tmp_path / fmt, dtype="float32")
                              / "config.json").read_text())
        layer = written.get("transformer_layer_config", written)          # speculators nests the layer's fields
        assert layer["rope_parameters"] == SCALINGS[name], (fmt, layer["rope_parameters"])
        assert layer["rope_scaling"] == {k: v for k, v in SCALINGS[name].items() if k != "rope_theta"}, fmt
        assert layer["rope_theta"] == SCALINGS[name]["rope_theta"], fmt
        legacy = {k: v for k, v in layer.items() if k != "rope_parameters"}     # a reader of rope_scaling only
        fields = ("model_type", "architectures", "draft_vocab_size", "target_hidden_size", "block_size")
        for reader in (layer, legacy):
            config = layer_class(**{k: v for k, v in reader.items() if k not in fields})
            cos, sin = angles(rotary_class(config), head_dim)
            torch.testing.assert_close(cos, theirs_cos, msg=f"{fmt}: the exported rope read back")
            torch.testing.assert_close(sin, theirs_sin, msg=f"{fmt}: the exported rope read back")
