"""Exports: names, shapes, layer-id conventions, the Medusa-original round trip, and refusals."""
import json

import pytest
import torch
from conftest import build_tiny_target, eagle3_checkpoint, medusa_checkpoint, prompts
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import CheckpointError
from draftsmith.export import ExportError, export, import_drafter
from draftsmith.heads.runtime.target import TargetError
from safetensors.torch import load_file, save_file


def test_medusa_shared_head_with_draft_vocabulary_to_vllm(tiny_target, tmp_path):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=3, draft_vocab_size=32)
    out = export(tmp_path / "ckpt", "vllm", tmp_path / "out")       # finds the target the checkpoint names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["num_heads"] == 3 and config["truncated_vocab_size"] == 32
    assert config["original_lm_head"] is True and config["medusa_fc_bias"] is True
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == {"token_map", "lm_heads.0.weight"} | {f"blocks.{h}.layers.0.{p}" for h in range(3)
                                                               for p in ("weight", "bias")}
    assert weights["token_map"].tolist() == list(range(5, 37))
    assert torch.allclose(weights["lm_heads.0.weight"].float(),
                          tiny_target.lm_head.weight[5:37].to(torch.bfloat16).float())
    assert "vllm serve" in (out / "README.md").read_text()


def test_medusa_original_round_trip_reproduces_tau(tiny_target, tmp_path):
    drafter = medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=3, lm_head="own")
    out = export(tmp_path / "ckpt", "medusa-original", tmp_path / "orig", dtype="float32")
    assert json.loads((out / "config.json").read_text())["medusa_num_heads"] == 3
    assert "0.1.weight" in load_file(str(out / "medusa_lm_head.safetensors"))
    reloaded = import_drafter(out, "medusa-original", tiny_target)
    for d in (drafter, reloaded):
        d.set_proposal(chain=3)
    for prompt in prompts(tiny_target, count=3):
        a = decode(tiny_target, prompt, 30, drafter=drafter)
        b = decode(tiny_target, prompt, 30, drafter=reloaded)
        assert a.tokens == b.tokens and a.accepted == b.accepted


@pytest.mark.parametrize("fmt, written_ids", [("vllm", [1, 1, 2]), ("trtllm", [0, 0, 1]), ("sglang", [0, 0, 1])])
def test_eagle3_layer_ids_follow_each_stack(tiny_target, tmp_path, fmt, written_ids):
    eagle3_checkpoint(tiny_target, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", fmt, tmp_path / fmt)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == written_ids
    assert config["draft_vocab_size"] == 40 and config["num_hidden_layers"] == 1
    weights = load_file(str(out / "model.safetensors"))
    assert (torch.arange(40) + weights["d2t"]).tolist() == (torch.arange(40) * 3).tolist()
    assert weights["t2d"].sum() == 40 and weights["t2d"][3] and not weights["t2d"][4]
    assert {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.self_attn.q_proj.weight",
            "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight"} <= set(weights)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * tiny_target.hidden_size
    assert ("embed_tokens.weight" in weights) == (fmt == "sglang")


def test_eagle3_speculators_config_states_norm_before_residual(tiny_target, tmp_path):
    eagle3_checkpoint(tiny_target, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "speculators", tmp_path / "spec")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] >= 1
    assert "layers.0.self_attn.q_proj.weight" in load_file(str(out / "model.safetensors"))


def test_export_refusals(tiny_target, tmp_path):
    medusa_checkpoint(tiny_target, tmp_path / "two", num_heads=2, num_layers=2, lm_head="own")
    with pytest.raises(ExportError, match="load exactly one"):
        export(tmp_path / "two", "medusa-original", tmp_path / "x")
    with pytest.raises(ExportError, match="unknown export format 'onnx'"):
        export(tmp_path / "two", "onnx", tmp_path / "x")
    with pytest.raises(ExportError, match="cannot be exported as 'sglang'"):
        export(tmp_path / "two", "sglang", tmp_path / "x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    for overwrite in (False, True):       # --overwrite replaces an earlier export, never anything else
        with pytest.raises(ExportError, match="not empty and is not an earlier draftsmith export"):
            export(tmp_path / "two", "vllm", tmp_path / "busy", overwrite=overwrite)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    eagle3_checkpoint(tiny_target, tmp_path / "e0", layer_ids=(0, 1, 2))
    with pytest.raises(ExportError, match="layer id 0"):
        export(tmp_path / "e0", "sglang", tmp_path / "x")
    medusa_checkpoint(tiny_target, tmp_path / "path", num_heads=2, conditioning="path")
    for fmt in ("vllm", "medusa-original"):
        with pytest.raises(ExportError, match="path-conditioned Medusa heads"):
            export(tmp_path / "path", fmt, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_damaged_checkpoint_and_wrong_target_are_refused(tiny_target, tmp_path):
    medusa_checkpoint(tiny_target, tmp_path / "ckpt", num_heads=2, lm_head="own")
    weights = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    weights["stray.weight"] = torch.zeros(2)
    del weights["blocks.1.0.linear.bias"]
    save_file(weights, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="damaged checkpoint: .* does not match the checksum"):
        export(tmp_path / "ckpt", "vllm", tmp_path / "out")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config["weights_sha256"]          # as written before checksums: the tensor check still catches it
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"missing \['blocks.1.0.linear.bias'\], extra \['stray.weight'\]"):
        export(tmp_path / "ckpt", "vllm", tmp_path / "out")
    medusa_checkpoint(tiny_target, tmp_path / "good", num_heads=2, lm_head="own")
    other = build_tiny_target(tmp_path / "other", seed=11)
    with pytest.raises(TargetError, match="weights_sha256"):
        export(tmp_path / "good", "vllm", tmp_path / "out", target_path=str(other))


ROUND_TRIPS = [("medusa", "vllm", {"num_heads": 3, "draft_vocab_size": 32}),
               ("medusa", "vllm", {"num_heads": 2, "lm_head": "own"}),
               ("medusa", "medusa-original", {"num_heads": 2, "lm_head": "own"}),
               ("eagle3", "vllm", None), ("eagle3", "speculators", None), ("eagle3", "sglang", None),
               ("eagle3", "trtllm", None)]


@pytest.mark.parametrize("kind,fmt,settings", ROUND_TRIPS,
                         ids=[f"{k}-{f}-{i}" for i, (k, f, _) in enumerate(ROUND_TRIPS)])
def test_export_then_import_gives_the_same_weights_and_the_same_decoding(tiny_target, tiny_target_dir, tmp_path,
                                                                          kind, fmt, settings, capsys):
    """`draftsmith import` inverts every export: identical weights, and identical accepted tokens (so tau)
    on the same prompts."""
    from draftsmith.cli import main
    from draftsmith.heads.drafter import load_drafter

    if kind == "medusa":
        original = medusa_checkpoint(tiny_target, tmp_path / "ckpt", **settings)
    else:
        original = eagle3_checkpoint(tiny_target, tmp_path / "ckpt")
    export(tmp_path / "ckpt", fmt, tmp_path / "export", dtype="float32")
    assert main(["import", str(tmp_path / "export"), "--from", fmt, str(tmp_path / "back"),
                 "--target", str(tiny_target_dir)]) == 0
    assert "drafter.init_from=" in capsys.readouterr().out
    back = load_drafter(tmp_path / "back", tiny_target)
    mine, theirs = original.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.equal(mine[key].float(), theirs[key].float()), key
    for prompt in prompts(tiny_target, count=2, length=6):
        assert decode(tiny_target, prompt, 24, drafter=original).accepted == \
            decode(tiny_target, prompt, 24, drafter=back).accepted


def test_import_refuses_maps_that_disagree_and_another_target(tiny_target, tiny_target_dir, tmp_path):
    from draftsmith.export.importers import ImportError_, import_drafter
    from draftsmith.heads.infra.outputs import EXPORT_MARK

    eagle3_checkpoint(tiny_target, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "vllm", tmp_path / "export", dtype="float32")
    weights = load_file(str(out / "model.safetensors"))
    weights["t2d"][0] = not bool(weights["t2d"][0])
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(ImportError_, match="t2d and d2t disagree"):
        import_drafter(out, "vllm", tiny_target)
    medusa_checkpoint(tiny_target, tmp_path / "m", num_heads=2, draft_vocab_size=32)
    export(tmp_path / "m", "vllm", tmp_path / "mx", dtype="float32")
    from draftsmith.heads.runtime.target import Target
    other = Target.load(str(build_tiny_target(tmp_path / "other", seed=9)), "float32")
    with pytest.raises(ImportError_, match="made for target 'tiny-llama0' but the loaded target is 'other'"):
        import_drafter(tmp_path / "mx", "vllm", other)            # draftsmith's manifest names the target
    (tmp_path / "mx" / EXPORT_MARK).unlink()                      # an export without it: the weights tell
    with pytest.raises(ImportError_, match="shared head is not this target's lm_head"):
        import_drafter(tmp_path / "mx", "vllm", other)


def test_a_recipe_warm_starts_from_an_imported_checkpoint(tiny_target_dir, tmp_path):
    """drafter.init_from: training starts from the checkpoint's weights (step 0 equals them) and a
    checkpoint whose shapes do not fit the recipe is refused, naming the tensor."""
    import yaml
    from draftsmith.heads.drafter import CheckpointError
    from draftsmith.train.loop import fit
    from draftsmith.train.settings import recipe_from_dict
    from conftest import tiny_recipe

    raw = tiny_recipe(tmp_path, tiny_target_dir, epochs=1, eval_prompts=0, lr=0.0, warmup_steps=0)
    first = fit(recipe_from_dict(raw), progress=False)
    raw2 = yaml.safe_load(yaml.safe_dump(raw))
    raw2["output_dir"] = str(tmp_path / "warm")
    raw2["drafter"]["init_from"] = first.checkpoint
    import shutil
    shutil.copytree(tmp_path / "run" / "data", tmp_path / "warm" / "data")
    warm = fit(recipe_from_dict(raw2), progress=False)           # lr 0: the weights stay what they started as
    a = load_file(f"{first.checkpoint}/model.safetensors")
    b = load_file(f"{warm.checkpoint}/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    raw2["drafter"]["num_heads"] = 2
    raw2["output_dir"] = str(tmp_path / "bad")
    shutil.copytree(tmp_path / "run" / "data", tmp_path / "bad" / "data")
    with pytest.raises(CheckpointError, match=r"does not fit this recipe's drafter"):
        fit(recipe_from_dict(raw2), progress=False)


def test_eagle_repository_layout_imports_with_its_fixed_layers(tiny_target, tiny_target_dir, tmp_path):
    """`--from eagle`: the EAGLE repository's EAGLE-3 layout (its tensors plus the target's embedding,
    no layer ids in config.json: that code always fuses hidden_states at (2, N//2, N-3)) imports with
    those layers and identical weights; a foreign embedding and pickled-only weights are refused."""
    from draftsmith.export import ImportError_
    from draftsmith.heads.eagle3 import default_layer_ids

    ids = default_layer_ids(tiny_target.num_layers)
    original = eagle3_checkpoint(tiny_target, tmp_path / "ckpt", layer_ids=ids)
    out = export(tmp_path / "ckpt", "vllm", tmp_path / "vllm", dtype="float32")
    repo = tmp_path / "eagle"
    repo.mkdir()
    config = json.loads((out / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "eagle_config"):
        config.pop(key)
    (repo / "config.json").write_text(json.dumps(config))
    weights = load_file(str(out / "model.safetensors"))
    weights["embed_tokens.weight"] = tiny_target.embed_tokens.weight.detach().float().clone()
    save_file(weights, str(repo / "model.safetensors"))
    back = import_drafter(repo, "eagle", tiny_target)
    assert list(back.layer_ids) == list(ids)
    mine, theirs = original.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k].float(), theirs[k].float()) for k in mine)

    weights["embed_tokens.weight"] = weights["embed_tokens.weight"] + 1.0
    save_file(weights, str(repo / "model.safetensors"))
    with pytest.raises(ImportError_, match="embedding that is not this target's"):
        import_drafter(repo, "eagle", tiny_target)
    (repo / "model.safetensors").unlink()
    (repo / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ImportError_, match="pickled files are never loaded"):
        import_drafter(repo, "eagle", tiny_target)
