"""P-EAGLE: one drafter forward equals a position-by-position reference, lossless chains and trees,
the training unroll is what decoding runs, warm start from EAGLE-3, export and import, bad input."""
import json

import pytest
import torch
from conftest import prompts
from test_eagle3 import assert_exact_with_accepted_drafts, overfit

from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import DraftContext, load_drafter, save_drafter, warm_start
from draftsmith.heads.eagle3 import Eagle3, Eagle3Config
from draftsmith.heads.decoding.parallel import parallel_tree
from draftsmith.heads.p_eagle import PEagle, PEagleConfig


def drafter_for(target, seed=0, vocab=None, **config):
    torch.manual_seed(seed)
    drafter = PEagle(PEagleConfig(draft_vocab_size=vocab or target.vocab_size, layer_ids=[0, 1, 2], **config), target)
    for p in drafter.midlayer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return drafter


def context_after(target, drafter, prompt):
    cache = target.new_cache(1, 64)
    out = target.forward_block(cache, torch.tensor([prompt]), torch.arange(len(prompt))[None],
                               layer_ids=drafter.required_layers, logits="last")
    return DraftContext(torch.tensor(prompt), {i: h[0] for i, h in out.hidden_states.items()},
                        int(out.logits[0, -1].argmax()), len(prompt))


def test_one_forward_equals_position_by_position_reference(tiny_target):
    drafter = drafter_for(tiny_target, ttt_steps=4, tree={"depth": 4, "top_k": 1, "total_tokens": 4})
    prompt = prompts(tiny_target, count=1, length=9)[0]
    context = context_after(tiny_target, drafter, prompt)
    drafter.reset()
    with torch.no_grad():
        parallel = drafter.draft_logits(context)                         # [4, v], one forward
        assert drafter.cache.length == len(prompt)                       # the mask slots left the cache
        # reference: the real pairs one at a time, then each mask slot alone, through the same cache
        drafter.reset()
        hidden = drafter._context_hidden(context)
        following = torch.cat([context.tokens[1:], torch.tensor([context.next_token])])
        outs = [drafter._feed(hidden[i:i + 1], following[i:i + 1], torch.tensor([i])) for i in range(len(prompt))]
        reference = [drafter.logits(outs[-1][0])]
        for j in range(1, 4):
            out = drafter._feed(drafter.mask_state(), torch.tensor([drafter.mask_token_id]),
                                torch.tensor([len(prompt) - 1 + j]))
            reference.append(drafter.logits(out[0]))
    assert torch.allclose(parallel, torch.stack(reference), atol=1e-5)


def test_training_unroll_scores_what_decoding_computes(tiny_target):
    """Step s of the unroll at column t is mask slot s of anchor t: the same logits the decoding forward gives."""
    drafter = drafter_for(tiny_target, ttt_steps=3, tree={"depth": 3, "top_k": 1, "total_tokens": 3})
    prompt = prompts(tiny_target, count=1, length=8)[0]
    context = context_after(tiny_target, drafter, prompt)
    ids = torch.tensor([prompt + [context.next_token]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    batch["features"] = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)
    t = len(prompt) - 1                                                  # the anchor decoding drafts from
    with torch.no_grad():
        trained = torch.stack([drafter.logits(h[0, t]) for h in drafter.unroll(batch)])
        drafter.reset()
        decoded = drafter.draft_logits(context)
    assert torch.allclose(trained, decoded, atol=1e-4)


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


def test_parallel_tree_is_closed_under_parents():
    logprobs = torch.log_softmax(torch.randn(4, 30), dim=-1)
    tree = parallel_tree(logprobs, TreeSettings(depth=4, top_k=3, total_tokens=7), torch.arange(30))
    assert tree.size == 7
    parents = tree.parents.tolist()
    assert all(p < i for i, p in enumerate(parents))
    chain = [int(logprobs[d].argmax()) for d in range(4)]
    assert tree.tokens[0] == chain[0]                                    # the chain is there first
    depth_one = [i for i, p in enumerate(parents) if p == -1]
    assert set(tree.tokens[depth_one].tolist()) <= set(logprobs[0].topk(3).indices.tolist())


def test_a_deeper_proposal_than_k_is_clamped_and_config_checked(tiny_target):
    drafter = drafter_for(tiny_target, ttt_steps=3, tree={"depth": 3, "top_k": 1, "total_tokens": 3})
    drafter.set_proposal(tree=TreeSettings(depth=6, top_k=2, total_tokens=12))
    assert drafter.tree.depth == 3
    with pytest.raises(ValueError, match="more than the 3 tokens"):
        PEagleConfig(ttt_steps=3, tree={"depth": 5, "top_k": 1, "total_tokens": 5})
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        PEagle(PEagleConfig(draft_vocab_size=40, layer_ids=[0, 1, 2], mask_token_id=10**6), tiny_target)


def test_warm_start_from_an_eagle3_checkpoint(tiny_target, tmp_path):
    torch.manual_seed(1)
    eagle3 = Eagle3(Eagle3Config(draft_vocab_size=40, layer_ids=[0, 1, 2]), tiny_target)
    save_drafter(eagle3, tmp_path / "e3")
    drafter = PEagle(PEagleConfig(draft_vocab_size=40, layer_ids=[0, 1, 2]), tiny_target)
    fresh_mask = drafter.mask_hidden.detach().clone()
    warm_start(drafter, tmp_path / "e3")
    assert torch.equal(drafter.fc.weight, eagle3.fc.weight)
    assert torch.equal(drafter.midlayer.self_attn.q_proj.weight, eagle3.midlayer.self_attn.q_proj.weight)
    assert torch.equal(drafter.mask_hidden, fresh_mask)                 # the one tensor EAGLE-3 lacks


def test_checkpoint_export_import_round_trip(tiny_target, tiny_target_dir, tmp_path):
    from draftsmith.export import export
    from draftsmith.export.importers import import_drafter

    drafter = drafter_for(tiny_target, vocab=40)
    drafter.set_draft_vocabulary(torch.arange(40) * 2)
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt", tiny_target)
    assert torch.equal(loaded.mask_hidden, drafter.mask_hidden) and loaded.mask_token_id == drafter.mask_token_id
    cases = prompts(tiny_target, count=2)
    for fmt in ("vllm", "speculators"):
        out = export(tmp_path / "ckpt", fmt, tmp_path / fmt, dtype="float32")
        config = json.loads((out / "config.json").read_text())
        if fmt == "vllm":
            assert config["parallel_drafting"] is True and config["mask_token_id"] == drafter.mask_token_id
            assert "Eagle3" in config["architectures"][0]
        else:
            assert config["speculators_model_type"] == "peagle"
        back = import_drafter(out, fmt, tiny_target)
        assert isinstance(back, PEagle)
        mine, theirs = drafter.state_dict(), back.state_dict()
        assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
        for prompt in cases:
            assert (decode(tiny_target, prompt, 16, drafter=back).accepted
                    == decode(tiny_target, prompt, 16, drafter=drafter).accepted)


def test_parallel_export_without_mask_hidden_is_refused(tiny_target, tmp_path):
    from draftsmith.heads.drafter import read_config, read_weights
    from draftsmith.heads.formats import ExportError

    save_drafter(drafter_for(tiny_target), tmp_path / "ckpt")
    config, weights = read_config(tmp_path / "ckpt"), read_weights(tmp_path / "ckpt")
    weights.pop("mask_hidden")                        # a drafter never trained for parallel drafting
    for fmt in PEagle.formats:
        with pytest.raises(ExportError, match="no mask_hidden: it was not trained for parallel drafting"):
            fmt.write(config, weights, tiny_target, torch.float32, tmp_path / "ckpt")


def test_import_for_another_target_is_refused_naming_both(tiny_target, tmp_path):
    from conftest import build_tiny_target
    from draftsmith.export import export
    from draftsmith.export.importers import ImportError_, import_drafter
    from draftsmith.heads.runtime.target import Target

    drafter = drafter_for(tiny_target)
    save_drafter(drafter, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "vllm", tmp_path / "vllm", dtype="float32")
    other = Target.load(str(build_tiny_target(tmp_path / "other", seed=5)), dtype="float32")
    with pytest.raises(ImportError_, match="made for target") as err:
        import_drafter(out, "vllm", other)
    assert tiny_target.name in str(err.value) and other.name in str(err.value)
