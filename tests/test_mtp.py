"""MTP (heads/mtp.py): the MTP layers a target ships with, read by its family's naming, equal to transformers'
own `MtpModel` before any training, lossless in the verifier, and trained in place; targets without MTP
layers, with an unknown naming, or with a missing or misshapen MTP tensor are refused by name.

Two families with different layers: DeepSeek-V3 (MLA, routed experts) and GLM-4-MoE (GQA with qk-norm,
shared and routed experts), tiny and random, with one MTP layer written into the checkpoint as the real
checkpoints store it (tests/tiny_models.py: build_mtp_target)."""
import json
from pathlib import Path

import pytest
import torch
from conftest import chats_file
from tiny_models import MTP_FAMILIES, build_mtp_target

from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import DraftContext
from draftsmith.heads.mtp import Mtp, MtpConfig, MtpError
from draftsmith.heads.runtime.target import Target


@pytest.fixture(scope="module", params=MTP_FAMILIES)
def mtp_target(request, tmp_path_factory):
    directory = build_mtp_target(tmp_path_factory.mktemp(f"mtp-{request.param}"), request.param)
    return Target.load(str(directory), "float32", "cpu")


def reference_mtp(target: Target):
    """transformers' own MtpModel for the target (its loader, its conversions).  transformers finds MTP tensors
    by the layer index the real checkpoints use (61 for DeepSeek-V3); the tiny one keeps them after its own
    N layers, so the pattern is pointed there for this call."""
    from transformers.modeling_layers import MtpModel
    main = target.model
    before = main._keys_to_ignore_on_load_unexpected
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{target.num_layers}\..*"]
    try:
        reference = MtpModel.from_pretrained(main).eval()
    finally:
        main._keys_to_ignore_on_load_unexpected = before
    reference.config._attn_implementation = "eager"
    return reference


@torch.no_grad()
def reference_chain(target: Target, reference, prompt: list[int], depth: int) -> tuple[list[int], torch.Tensor]:
    """The shipped MTP drafting `depth` tokens after `prompt`, recomputed from scratch for every draft with
    transformers' MtpLayer: pairs (h_j, x_{j+1}) at positions j, the embedding zeroed at position 0 (as vLLM
    feeds it), each draft's normed output and token appended as the next pair."""
    ids = torch.tensor([prompt])
    hidden = target.features(ids, torch.ones_like(ids), [target.num_layers])[target.num_layers]  # [1, m, H]
    root = int(target.compute_logits(hidden[:, -1]).argmax(-1))
    states, tokens = hidden, torch.tensor([prompt[1:] + [root]])
    drafts, first = [], None
    for _ in range(depth):
        positions = torch.arange(tokens.shape[1])[None]
        embeds = reference.embed_tokens(tokens).clone()
        embeds[:, 0] = 0
        out = reference.forward_layer(0, states, positions, None, inputs_embeds=embeds)
        logits = reference._project_to_logits(out[:, -1])
        first = logits[0] if first is None else first
        drafts.append(int(logits.argmax(-1)))
        states = torch.cat([states, out[:, -1:]], dim=1)
        tokens = torch.cat([tokens, torch.tensor([[drafts[-1]]])], dim=1)
    return drafts, first


def test_warm_start_proposes_what_transformers_mtp_computes(mtp_target):
    """Before any training the drafter is the shipped MTP: its cached chain of 3 drafts equals transformers'
    MtpModel recomputed from scratch, token for token, and its first logits agree to float rounding."""
    drafter = Mtp(MtpConfig(tree={"depth": 3, "top_k": 1, "total_tokens": 3}), mtp_target).eval()
    reference = reference_mtp(mtp_target)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(3, mtp_target.vocab_size, (9,), generator=generator).tolist()
        want, first = reference_chain(mtp_target, reference, prompt, 3)
        ids = torch.tensor([prompt])
        hidden = mtp_target.features(ids, torch.ones_like(ids), [mtp_target.num_layers])
        root = int(mtp_target.compute_logits(hidden[mtp_target.num_layers][:, -1]).argmax(-1))
        drafter.reset()
        tree = drafter.propose(DraftContext(tokens=ids[0], hidden={k: v[0] for k, v in hidden.items()},
                                            next_token=root, position=len(prompt)))
        assert tree.tokens.tolist() == want and tree.parents.tolist() == [-1, 0, 1]
        mine = drafter.logits(drafter._block(hidden[mtp_target.num_layers][:, :], torch.tensor([prompt[1:] + [root]]),
                                             torch.arange(len(prompt))[None],
                                             torch.ones(len(prompt), len(prompt), dtype=torch.bool).tril()[None, None]))
        assert torch.allclose(mine[0, -1], first, atol=1e-4), (mine[0, -1] - first).abs().max()


@pytest.mark.parametrize("proposal", [{"chain": 3}, {"tree": {"depth": 3, "top_k": 2, "total_tokens": 5}}])
def test_decoding_with_the_shipped_mtp_is_lossless(mtp_target, proposal):
    """Greedy speculative decoding with the MTP drafter (a chain of 3, and EAGLE-2's dynamic tree grown with the
    same block) gives plain greedy decoding's tokens."""
    from draftsmith.heads.decoding.dynamic_tree import TreeSettings
    drafter = Mtp(MtpConfig(), mtp_target).eval()
    if "chain" in proposal:
        drafter.set_proposal(chain=proposal["chain"])
    else:
        drafter.set_proposal(tree=TreeSettings(**proposal["tree"]))
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        prompt = torch.randint(3, mtp_target.vocab_size, (7,), generator=generator).tolist()
        plain = decode(mtp_target, prompt, 24)
        speculative = decode(mtp_target, prompt, 24, drafter)
        assert speculative.tokens == plain.tokens
        assert speculative.forwards < len(plain.tokens) or not any(speculative.accepted)


def test_targets_without_readable_mtp_layers_are_refused_by_name(tiny_target, tmp_path, monkeypatch):
    """No MTP layers: pointed at EAGLE-3.  Declared but not in the files (a checkpoint transformers saved): the
    first missing tensor and the file named.  A misshapen tensor: its shape and the one needed.  A family whose
    naming draftsmith does not know: the known ones listed."""
    from safetensors.torch import load_file, save_file

    from draftsmith.heads import mtp_layout

    with pytest.raises(MtpError, match="ships no MTP layers.*method: eagle3"):
        Mtp(MtpConfig(), tiny_target)
    bare = Target.load(str(build_mtp_target(tmp_path / "bare", "deepseek_v3", write_mtp=False)), "float32", "cpu")
    with pytest.raises(MtpError, match=r"holds no tensor named model\.layers\.2\.\*"):
        Mtp(MtpConfig(), bare)
    directory = build_mtp_target(tmp_path / "broken", "deepseek_v3")
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.2.hnorm.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MtpError, match=r"model\.layers\.2\.hnorm\.weight is missing from .*model\.safetensors"):
        Mtp(MtpConfig(), Target.load(str(directory), "float32", "cpu"))
    tensors["model.layers.2.hnorm.weight"] = torch.ones(3)
    tensors["model.layers.2.self_attn.q_a_proj.weight"] = torch.ones(5, 5)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MtpError, match=r"hnorm\.weight in .*model\.safetensors has shape \[3\]; the target needs \[64\]"):
        Mtp(MtpConfig(), Target.load(str(directory), "float32", "cpu"))
    known = build_mtp_target(tmp_path / "glm", "glm4_moe")
    monkeypatch.setattr(mtp_layout, "MTP_NAMING", {"deepseek_v3": mtp_layout.MTP_NAMING["deepseek_v3"]})
    with pytest.raises(MtpError, match=r"does not know where a glm4_moe checkpoint keeps them; known MTP namings: "
                                       r"deepseek_v3"):
        Mtp(MtpConfig(), Target.load(str(known), "float32", "cpu"))
    with pytest.raises(ValueError, match="draft_vocab_size must be null"):
        MtpConfig(draft_vocab_size=100)


def test_training_moves_the_shipped_layer_to_the_targets_own_data(tmp_path):
    """Fine-tuning in place: held-out agreement of the shipped (random) MTP layer, then after training on the
    target's own replies, every unrolled depth higher; the checkpoint reloads to the same proposals, and only
    MTP tensors were saved (the target's embedding and head are not the drafter's)."""
    import shutil

    from draftsmith.heads.drafter import load_drafter
    from draftsmith.train.loop import fit
    from draftsmith.train.settings import recipe_from_dict

    target_dir = build_mtp_target(tmp_path / "target", "glm4_moe")

    def spec(out, **train):
        return {"method": "mtp", "output_dir": str(out), "seed": 0, "target": {"path": str(target_dir), "dtype": "float32"},
                "data": {"source": str(chats_file(tmp_path / "chats.jsonl", 60)), "max_conversations": None,
                         "batch_size": 8, "max_new_tokens": 32},
                "drafter": {"train_steps": 3},
                "train": {"epochs": 4, "batch_size": 4, "lr": 3e-3, "warmup_steps": 2, "mixed_precision": "no",
                          "heldout_fraction": 0.2, "eval_prompts": 0, **train}}

    shipped = fit(recipe_from_dict(spec(tmp_path / "shipped", lr=1e-12, max_steps=1)), progress=False)
    shutil.copytree(tmp_path / "shipped" / "data", tmp_path / "tuned" / "data")
    tuned = fit(recipe_from_dict(spec(tmp_path / "tuned")), progress=False)
    assert len(tuned.heldout_agreement) == 3
    assert all(after > before + 0.05 for before, after in zip(shipped.heldout_agreement, tuned.heldout_agreement)), \
        (shipped.heldout_agreement, tuned.heldout_agreement)
    target = Target.load(str(target_dir), "float32", "cpu")
    checkpoint = Path(tuned.checkpoint)
    drafter = load_drafter(checkpoint, target).eval()
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["kind"] == "mtp" and config["architecture"]["mtp_prefix"] == "model.layers.2."
    assert not any("embed" in name or "lm_head" in name for name in config["architecture"]["tensors"])
    prompt = list(range(5, 14))
    plain = decode(target, prompt, 16)
    assert decode(target, prompt, 16, drafter).tokens == plain.tokens


def test_export_for_vllm_is_the_checkpoints_own_layer_and_imports_back(mtp_target, tmp_path):
    """`export --to vllm` writes the target's config.json and its MTP layer in the checkpoint's own names (per-expert
    weights, shared_head, embed_tokens): for the warm-started drafter, exactly the tensors the target ships.  After
    a change to the layer, `import --from vllm` gives back the same weights and the same proposals."""
    from safetensors.torch import load_file

    from draftsmith.export import export
    from draftsmith.export.importers import import_drafter
    from draftsmith.heads.drafter import save_drafter

    target_dir = Path(mtp_target.source)
    drafter = Mtp(MtpConfig(), mtp_target).eval()
    save_drafter(drafter, tmp_path / "shipped")
    out = export(tmp_path / "shipped", "vllm", tmp_path / "vllm", dtype="float32")
    written = load_file(str(out / "model.safetensors"))
    prefix = f"model.layers.{mtp_target.num_layers}."
    shipped = {k: v for k, v in load_file(str(target_dir / "model.safetensors")).items() if k.startswith(prefix)}
    assert sorted(written) == sorted(shipped)
    assert all(torch.equal(written[k], shipped[k]) for k in shipped)
    assert json.loads((out / "config.json").read_text()) == json.loads((target_dir / "config.json").read_text())
    assert '"method": "mtp"' in (out / "README.md").read_text()

    with torch.no_grad():
        drafter.layer.eh_proj.weight.mul_(1.5)
        drafter.layer.mtp_block.mlp.experts.gate_up_proj.add_(0.01)
    save_drafter(drafter, tmp_path / "tuned")
    out = export(tmp_path / "tuned", "vllm", tmp_path / "vllm-tuned", dtype="float32")
    back = import_drafter(out, "vllm", mtp_target).eval()
    mine, theirs = drafter.state_dict(), back.state_dict()
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    prompt = list(range(4, 13))
    assert decode(mtp_target, prompt, 12, back).tokens == decode(mtp_target, prompt, 12).tokens


def test_a_proposal_deeper_than_the_depths_trained_is_refused(mtp_target):
    drafter = Mtp(MtpConfig(train_steps=2, tree={"depth": 2, "top_k": 1, "total_tokens": 2}), mtp_target)
    drafter.set_proposal(chain=2)
    with pytest.raises(MtpError, match="3 deep from an MTP layer trained for 2 depths"):
        drafter.set_proposal(chain=3)
    with pytest.raises(ValueError, match="deeper than the 1 depths trained"):
        MtpConfig(train_steps=1)


def test_export_with_the_target_stitches_the_tuned_layer_into_it(mtp_target, tmp_path):
    """`export --to vllm --with-target`: OUT/target is the whole target with the fine-tuned MTP layer in place (one
    more shard in its index), so a stack that reads MTP layers from the target itself finds the tuned one: read back
    from there, the drafter is the tuned drafter."""
    from draftsmith.cli import main
    from draftsmith.heads.drafter import save_drafter

    drafter = Mtp(MtpConfig(), mtp_target).eval()
    with torch.no_grad():
        drafter.layer.hnorm.weight.mul_(0.5)
    save_drafter(drafter, tmp_path / "tuned")
    assert main(["export", str(tmp_path / "tuned"), "--to", "vllm", str(tmp_path / "out"), "--dtype", "float32",
                 "--with-target"]) == 0
    index = json.loads((tmp_path / "out" / "target" / "model.safetensors.index.json").read_text())
    assert index["weight_map"][f"model.layers.{mtp_target.num_layers}.hnorm.weight"] == "model-mtp.safetensors"
    stitched = Target.load(str(tmp_path / "out" / "target"), "float32", "cpu")
    again = Mtp(MtpConfig(), stitched).eval()
    mine, theirs = drafter.state_dict(), again.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
