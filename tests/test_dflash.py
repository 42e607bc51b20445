"""DFlash: the block forward equals a position-by-position reference, training scores what decoding
computes, lossless chains and trees, export and import, bad input."""
import json

import pytest
import torch
from conftest import prompts
from test_eagle3 import assert_exact_with_accepted_drafts, overfit

from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.dflash import DFlash, DFlashConfig, default_layer_ids
from draftsmith.heads.drafter import DraftContext, load_drafter, save_drafter


def drafter_for(target, seed=0, vocab=None, **config):
    torch.manual_seed(seed)
    settings = {"draft_vocab_size": vocab or target.vocab_size, "layer_ids": [1, 2], "num_layers": 2, **config}
    drafter = DFlash(DFlashConfig(**settings), target)
    for layer in drafter.layers:
        for name, p in layer.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, std=0.3)
    return drafter


def context_after(target, drafter, prompt):
    cache = target.new_cache(1, 64)
    out = target.forward_block(cache, torch.tensor([prompt]), torch.arange(len(prompt))[None],
                               layer_ids=drafter.required_layers, logits="last")
    return DraftContext(torch.tensor(prompt), {i: h[0] for i, h in out.hidden_states.items()},
                        int(out.logits[0, -1].argmax()), len(prompt))


def reference_block(drafter, context: DraftContext) -> torch.Tensor:
    """The block written out one position and one query at a time, softmax by hand: logits [K, v]."""
    from draftsmith.heads.eagle_layer import rotate

    K, n, m, d = drafter.K, drafter.K + 1, context.tokens.shape[0], drafter.shape.head_dim
    group = drafter.shape.num_heads // drafter.shape.num_kv_heads
    feats = torch.cat([context.hidden[i] for i in drafter.layer_ids], dim=-1)          # [m, len(ids) * T]
    c = [drafter.hidden_norm(drafter.fc(feats[p])) for p in range(m)]                   # one position at a time
    tokens = [context.next_token] + [drafter.mask_token_id] * K
    h = [drafter.embed(torch.tensor([t]))[0] for t in tokens]

    def rope(x, position):                                                              # x [heads, d]
        cos, sin = drafter.rotary(x[None], torch.tensor([[position]]))
        return rotate(x[None, :, None], x[None, :, None], cos, sin)[0][0, :, 0]

    for layer in drafter.layers:
        att = layer.self_attn
        heads = lambda x: x.view(-1, d)                                                # noqa: E731
        ctx_k = [rope(att.k_norm(heads(att.k_proj(c[p]))), p) for p in range(m)]
        ctx_v = [heads(att.v_proj(c[p])) for p in range(m)]
        x = [layer.input_layernorm(h[i]) for i in range(n)]
        q = [rope(att.q_norm(heads(att.q_proj(x[i]))), context.position + i) for i in range(n)]
        k = [rope(att.k_norm(heads(att.k_proj(x[i]))), context.position + i) for i in range(n)]
        v = [heads(att.v_proj(x[i])) for i in range(n)]
        keys, values = ctx_k + k, ctx_v + v                                           # every key visible
        out = []
        for i in range(n):
            per_head = []
            for head in range(drafter.shape.num_heads):
                kv_head = head // group
                scores = torch.stack([q[i][head] @ key[kv_head] for key in keys]) / d ** 0.5
                weights = torch.exp(scores - scores.max())
                weights = weights / weights.sum()
                per_head.append(sum(w * value[kv_head] for w, value in zip(weights, values)))
            out.append(att.o_proj(torch.cat(per_head)))
        h = [h[i] + out[i] for i in range(n)]
        h = [h[i] + layer.mlp(layer.post_attention_layernorm(h[i])) for i in range(n)]
    return torch.stack([drafter.lm_head(drafter.norm(h[i])) for i in range(1, n)])


def test_the_block_equals_a_position_by_position_reference(tiny_target):
    drafter = drafter_for(tiny_target, block_size=4, tree={"depth": 3, "top_k": 1, "total_tokens": 3})
    prompt = prompts(tiny_target, count=1, length=9)[0]
    context = context_after(tiny_target, drafter, prompt)
    drafter.reset()
    with torch.no_grad():
        block = drafter.draft_logits(context)                                   # one forward: [3, v]
        reference = reference_block(drafter, context)
    assert block.shape == reference.shape
    assert torch.allclose(block, reference, atol=1e-4)


def test_training_scores_what_decoding_computes(tiny_target):
    """The training block of anchor a (context < a, its own block) gives the logits decoding gives after
    the target's forward over positions < a with x_a as the next token; two anchors in one query batch
    do not see each other."""
    drafter = drafter_for(tiny_target, block_size=4, tree={"depth": 3, "top_k": 1, "total_tokens": 3})
    prompt = prompts(tiny_target, count=1, length=10)[0]
    ids = torch.tensor([prompt + [7, 8, 9]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)
    anchors, real = torch.tensor([[6, 9]]), torch.tensor([[True, True]])
    with torch.no_grad():
        trained = drafter.block_logits(batch, anchors, real)                     # [1, 2, 4, v]
        for column, a in enumerate((6, 9)):
            context = context_after(tiny_target, drafter, prompt[:a])
            context.next_token = prompt[a]
            drafter.reset()
            decoded = drafter.draft_logits(context)
            assert torch.allclose(trained[0, column, 1:], decoded, atol=1e-4)


def test_anchors_are_random_inside_the_reply_and_counts_follow_the_masks(tiny_target):
    drafter = drafter_for(tiny_target, anchors=3)
    ids = torch.randint(6, tiny_target.vocab_size, (2, 12))
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 5:] = 1
    loss_mask[1, 9:] = 1                                     # anchors 8..10: only 3 candidates
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    draws = set()
    for _ in range(20):
        anchors, real = drafter.sample_anchors(batch)
        assert real.all() and anchors.shape == (2, 3)
        assert ((anchors[0] >= 4) & (anchors[0] <= 10)).all() and set(anchors[1].tolist()) == {8, 9, 10}
        draws.add(tuple(sorted(anchors[0].tolist())))
    assert len(draws) > 1                                     # random, not fixed
    drafter.eval()                                            # held-out validation: the same blocks every time
    assert torch.equal(drafter.sample_anchors(batch)[0], drafter.sample_anchors(batch)[0])
    drafter.train()
    assert drafter.loss_counts(batch).tolist() == [6.0] * drafter.K
    batch["features"] = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)
    out = drafter.loss(batch)
    assert torch.isfinite(out.loss) and out.counted[0] == 6 and (out.counted <= 6).all()


@pytest.mark.parametrize("proposal", ["chain", "tree"])
def test_greedy_is_lossless(tiny_target, proposal):
    drafter = drafter_for(tiny_target)
    cases = prompts(tiny_target)
    overfit(tiny_target, drafter, [p + decode(tiny_target, p, 40).tokens[:34] for p in cases])
    if proposal == "chain":
        drafter.set_proposal(chain=4)
    else:
        drafter.set_proposal(tree=TreeSettings(depth=4, top_k=3, total_tokens=9))
    assert "one drafter forward" in drafter.describe_proposal()
    assert_exact_with_accepted_drafts(tiny_target, drafter, cases)


def test_default_layers_spread_over_the_depth():
    assert default_layer_ids(30) == [2, 8, 15, 22, 28]
    assert default_layer_ids(36) == [2, 10, 18, 26, 34]
    assert default_layer_ids(2) == [2]


def test_checkpoint_export_import_round_trip(tiny_target, tmp_path):
    from draftsmith.export import export
    from draftsmith.export.importers import import_drafter

    drafter = drafter_for(tiny_target, vocab=40)
    drafter.set_draft_vocabulary(torch.arange(40) * 2)
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt", tiny_target)
    assert loaded.mask_token_id == drafter.mask_token_id and loaded.layer_ids == drafter.layer_ids
    cases = prompts(tiny_target, count=2)
    for fmt in ("vllm", "speculators"):
        out = export(tmp_path / "ckpt", fmt, tmp_path / fmt, dtype="float32")
        config = json.loads((out / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"]
        if fmt == "vllm":
            assert config["dflash_config"] == {"mask_token_id": drafter.mask_token_id, "target_layer_ids": [0, 1],
                                               "causal": False}
            assert config["num_hidden_layers"] == 2 and config["model_type"] == "qwen3"
        else:
            assert config["speculators_model_type"] == "dflash" and config["aux_hidden_state_layer_ids"] == [1, 2]
        back = import_drafter(out, fmt, tiny_target)
        assert isinstance(back, DFlash)
        mine, theirs = drafter.state_dict(), back.state_dict()
        assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
        for prompt in cases:
            assert (decode(tiny_target, prompt, 16, drafter=back).accepted
                    == decode(tiny_target, prompt, 16, drafter=drafter).accepted)


def test_bad_block_and_mask_settings_are_named(tiny_target):
    from draftsmith.train.settings import RecipeError, recipe_from_dict

    with pytest.raises(ValueError, match="block_size is DFlash's query block"):
        DFlashConfig(block_size=1)
    with pytest.raises(ValueError, match=r"more than the 3 drafts of a block \(drafter.block_size - 1 masks\)"):
        DFlashConfig(block_size=4, tree={"depth": 4, "top_k": 1, "total_tokens": 4})
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        DFlash(DFlashConfig(draft_vocab_size=40, layer_ids=[1, 2], mask_token_id=10 ** 6), tiny_target)
    with pytest.raises(RecipeError, match=r"longer than the training sequences \(data.max_seq_len 8\)"):
        recipe_from_dict({"method": "dflash", "data": {"max_seq_len": 8},
                          "drafter": {"block_size": 9, "tree": {"depth": 4, "top_k": 1, "total_tokens": 4}}})


def test_an_export_of_layer_zero_and_another_target_are_refused(tiny_target, tmp_path):
    from conftest import build_tiny_target
    from draftsmith.export import export
    from draftsmith.export.importers import ImportError_, import_drafter
    from draftsmith.heads.formats import ExportError
    from draftsmith.heads.runtime.target import Target

    save_drafter(drafter_for(tiny_target, layer_ids=[0, 2]), tmp_path / "zero")
    with pytest.raises(ExportError, match="layer id 0"):
        export(tmp_path / "zero", "vllm", tmp_path / "zero-vllm", dtype="float32")
    save_drafter(drafter_for(tiny_target), tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "vllm", tmp_path / "vllm", dtype="float32")
    other = Target.load(str(build_tiny_target(tmp_path / "other", seed=5)), dtype="float32")
    with pytest.raises(ImportError_, match="made for target") as err:
        import_drafter(out, "vllm", other)
    assert tiny_target.name in str(err.value) and other.name in str(err.value)
