"""DSpark: the sequential head drafts from the token before, the confidence head cuts the chain, training
teaches both, lossless decoding, warm start from DFlash, export and import, bad input."""
import json

import pytest
import torch
from conftest import prompts
from test_dflash import context_after
from test_dflash import drafter_for as dflash_for
from test_eagle3 import assert_exact_with_accepted_drafts, overfit

from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.drafter import load_drafter, save_drafter, warm_start
from draftsmith.heads.dspark import DSpark, DSparkConfig


def dspark_for(target, seed=0, vocab=None, **config):
    torch.manual_seed(seed)
    settings = {"draft_vocab_size": vocab or target.vocab_size, "layer_ids": [1, 2], "num_layers": 2,
                "markov_rank": 8, **config}
    drafter = DSpark(DSparkConfig(**settings), target)
    for layer in drafter.layers:
        for name, p in layer.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, std=0.3)
    return drafter


def test_each_draft_adds_the_bias_of_the_token_drafted_before_it(tiny_target):
    """The chain by hand: the block's states through lm_head, plus markov_w2 @ markov_w1[prev], prev the next
    token for the first draft and each draft's own token after; the anchor slot drafts (sample_from_anchor)."""
    drafter = dspark_for(tiny_target, block_size=4, confidence_threshold=None)
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=3.0)      # a bias that changes the argmax
    torch.nn.init.normal_(drafter.markov_head.markov_w1.weight, std=3.0)
    assert drafter.drafts == 4 and drafter.tree.depth == 4
    context = context_after(tiny_target, drafter, prompts(tiny_target, count=1, length=9)[0])
    with torch.no_grad():
        drafter.reset()
        proposed = drafter.propose(context)
        drafter.reset()
        states = drafter.draft_states(context)
        base = drafter.lm_head(states)
        prev, expected, unbiased = context.next_token, [], base.argmax(-1).tolist()
        for d in range(4):
            w2, w1 = drafter.markov_head.markov_w2.weight, drafter.markov_head.markov_w1.weight
            prev = int((base[d] + w2 @ w1[prev]).argmax())
            expected.append(prev)
    assert proposed.tokens.tolist() == expected
    assert proposed.parents.tolist() == [-1, 0, 1, 2]
    assert expected != unbiased                               # the sequential head changed what was drafted


def test_the_confidence_head_cuts_the_chain_where_the_product_falls_below_the_threshold(tiny_target):
    drafter = dspark_for(tiny_target, block_size=4)
    head = drafter.confidence_head.proj
    torch.nn.init.zeros_(head.weight)
    head.bias.data.fill_(float(torch.logit(torch.tensor(0.6))))               # every draft: 0.6
    context = context_after(tiny_target, drafter, prompts(tiny_target, count=1, length=9)[0])
    submitted = {}
    for threshold in (None, 0.2, 0.3, 0.5, 0.9):
        drafter.confidence_threshold = threshold
        drafter.reset()
        submitted[threshold] = drafter.propose(context).size
        assert drafter.last_confidences[0] == pytest.approx(0.6)
    assert submitted == {None: 4, 0.2: 3, 0.3: 2, 0.5: 1, 0.9: 1}          # 0.6, 0.36, 0.216: at least one


def test_training_teaches_the_sequential_head_and_the_confidence_head(tiny_target):
    """On the target's own greedy continuations: the loss falls, markov_w2 leaves zero, and the confidences
    move toward the drafts' measured acceptance (higher where the drafts are right)."""
    drafter = dspark_for(tiny_target, block_size=4)
    cases = prompts(tiny_target)
    sequences = [p + decode(tiny_target, p, 40).tokens[:34] for p in cases]
    ids = torch.tensor(sequences)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)
    drafter.eval()                                            # the same anchors every time
    first = drafter.loss(batch)
    before = confidence_errors(drafter, batch)
    drafter.train()
    overfit(tiny_target, drafter, sequences)
    drafter.eval()
    out = drafter.loss(batch)
    print("loss", first.loss.item(), "->", out.loss.item(), "top-1 agreement", (first.correct / first.counted).tolist(),
          "->", (out.correct / out.counted).tolist())
    assert out.loss < first.loss and (out.correct / out.counted).mean() > (first.correct / first.counted).mean() + 0.2
    assert drafter.markov_head.markov_w2.weight.abs().max() > 0
    after = confidence_errors(drafter, batch)
    print("confidence's mean error against the drafts' acceptance (1 - TV)", before, "->", after)
    assert after < 0.5 * before and after < 0.1


def confidence_errors(drafter, batch) -> float:
    """Mean |confidence - acceptance| over the teacher-forced drafts of the validation anchors, acceptance
    the overlap of the drafter's distribution with the target's, sum_v min(p_v, q_v)."""
    ids, target = batch["input_ids"], drafter.target
    with torch.no_grad():
        anchors, real = drafter.sample_anchors(batch)
        states = drafter.block_states(batch, anchors, real)[:, :, drafter.first_slot:]
        at = anchors[..., None] + torch.arange(drafter.drafts)                       # draft d follows x_{a+d}
        inside = real[..., None] & (at + 1 < ids.shape[1])
        at = at.clamp(max=ids.shape[1] - 2)
        prev = ids.gather(1, at.flatten(1)).view_as(at)
        embedded, bias = drafter.markov(prev)
        q = torch.softmax(drafter.lm_head(states) + bias, dim=-1)
        rows = torch.arange(ids.shape[0])[:, None, None].expand_as(at)
        p = torch.softmax(target.compute_logits(batch["features"][target.num_layers][rows, at]), dim=-1)
        accept = torch.minimum(p[..., drafter.draft_to_target], q).sum(-1)
        confidence = torch.sigmoid(drafter.confidence_logits(states, embedded))
    return (confidence - accept).abs()[inside].mean().item()


@pytest.mark.parametrize("threshold", [None, 0.3])
def test_greedy_is_lossless(tiny_target, threshold):
    drafter = dspark_for(tiny_target, confidence_threshold=threshold)
    cases = prompts(tiny_target)
    overfit(tiny_target, drafter, [p + decode(tiny_target, p, 40).tokens[:34] for p in cases])
    drafter.set_proposal(chain=5)
    assert "DSpark chain of up to 5" in drafter.describe_proposal()
    assert_exact_with_accepted_drafts(tiny_target, drafter, cases)


def test_a_warm_start_from_dflash_drafts_what_the_dflash_drafted(tiny_target, tmp_path):
    """markov_w2 starts at zero, so DSpark on DFlash's alignment (sample_from_anchor: false) warm-started from
    a DFlash checkpoint proposes the DFlash's chain; the two heads are the only new tensors."""
    dflash = dflash_for(tiny_target, block_size=4, tree={"depth": 3, "top_k": 1, "total_tokens": 3})
    save_drafter(dflash, tmp_path / "dflash")
    dspark = dspark_for(tiny_target, seed=5, block_size=4, sample_from_anchor=False, confidence_threshold=None)
    warm_start(dspark, tmp_path / "dflash")
    for prompt in prompts(tiny_target, count=3, length=8):
        context = context_after(tiny_target, dflash, prompt)
        with torch.no_grad():
            dflash.reset()
            dspark.reset()
            assert dspark.propose(context).tokens.tolist() == dflash.propose(context).tokens.tolist()
    other = dspark_for(tiny_target, block_size=4, sample_from_anchor=False, num_layers=1)
    with pytest.raises(ValueError, match="does not fit this recipe's drafter"):
        warm_start(other, tmp_path / "dflash")
    other = dspark_for(tiny_target, block_size=4, sample_from_anchor=False, layer_ids=[0, 2])
    with pytest.raises(ValueError, match=r"reads target layers \[1, 2\], this recipe's drafter \[0, 2\]"):
        warm_start(other, tmp_path / "dflash")
    from draftsmith.heads.p_eagle import PEagle, PEagleConfig
    with pytest.raises(ValueError, match="holds a dflash drafter; this recipe trains a p_eagle"):
        warm_start(PEagle(PEagleConfig(layer_ids=[1, 1, 2], draft_vocab_size=40), tiny_target), tmp_path / "dflash")
    save_drafter(dspark, tmp_path / "dspark")
    loaded = load_drafter(tmp_path / "dspark", tiny_target)
    assert isinstance(loaded, DSpark) and loaded.config.sample_from_anchor is False


def test_export_import_round_trip_and_the_served_k(tiny_target, tmp_path):
    from draftsmith.export import export
    from draftsmith.export.importers import import_drafter

    drafter = dspark_for(tiny_target, vocab=40, block_size=4)
    drafter.set_draft_vocabulary(torch.arange(40) * 2)
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight)
    save_drafter(drafter, tmp_path / "ckpt")
    cases = prompts(tiny_target, count=2)
    for fmt in ("vllm", "speculators"):
        out = export(tmp_path / "ckpt", fmt, tmp_path / fmt, dtype="float32")
        config = json.loads((out / "config.json").read_text())
        assert config["markov_rank"] == 8 and config["block_size"] == 4 and config["sample_from_anchor"] is True
        assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
        if fmt == "vllm":
            assert config["architectures"] == ["Qwen3DSparkModel"] and config["num_speculative_tokens"] == 4
            assert config["dflash_config"]["target_layer_ids"] == [0, 1]
            assert '"method": "dspark"' in (out / "README.md").read_text()
        else:
            assert config["speculators_model_type"] == "dspark"
            assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert "num_speculative_tokens = 4 and no other" in (out / "README.md").read_text()
        back = import_drafter(out, fmt, tiny_target)
        assert isinstance(back, DSpark)
        mine, theirs = drafter.state_dict(), back.state_dict()
        assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
        for prompt in cases:
            assert (decode(tiny_target, prompt, 16, drafter=back).accepted
                    == decode(tiny_target, prompt, 16, drafter=drafter).accepted)
    from draftsmith.eval.bench import require_serving_k
    from draftsmith.eval.bench_settings import BenchError
    from draftsmith.heads.drafter import read_config

    config = read_config(tmp_path / "ckpt")
    require_serving_k(config, 4)
    with pytest.raises(BenchError, match="--num-speculative-tokens 3 does not match this dspark drafter's block"):
        require_serving_k(config, 3)
    require_serving_k(read_config(tmp_path / "ckpt") | {"kind": "dflash"}, 3)       # DFlash serves any K


def test_bad_settings_and_exports_are_named(tiny_target, tmp_path):
    from draftsmith.export import export
    from draftsmith.export.importers import import_drafter
    from draftsmith.heads.formats import ImportFormatError

    with pytest.raises(ValueError, match="DSpark drafts a chain"):
        DSparkConfig(tree={"depth": 3, "top_k": 2, "total_tokens": 5})
    with pytest.raises(ValueError, match="'gated' is not implemented"):
        DSparkConfig(markov_head_type="gated")
    with pytest.raises(ValueError, match="markov_rank is 0"):
        DSparkConfig(markov_rank=0)
    with pytest.raises(ValueError, match=r"confidence_threshold must be in \[0, 1\)"):
        DSparkConfig(confidence_threshold=1.5)
    with pytest.raises(ValueError, match=r"more than the 5 drafts of a block \(drafter.block_size with"):
        DSparkConfig(block_size=5, tree={"depth": 6, "top_k": 1, "total_tokens": 6})
    assert DSparkConfig(block_size=5, sample_from_anchor=False).tree["depth"] == 4
    drafter = dspark_for(tiny_target, block_size=3)
    with pytest.raises(ValueError, match="no tree of alternatives"):
        drafter.set_proposal(tree=TreeSettings(depth=3, top_k=2, total_tokens=5))
    save_drafter(drafter, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "speculators", tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "sample_from_anchor"}))
    with pytest.raises(ImportFormatError, match="does not say sample_from_anchor"):
        import_drafter(out, "speculators", tiny_target)
    (out / "config.json").write_text(json.dumps(config | {"markov_head_type": "rnn"}))
    with pytest.raises(ImportFormatError, match="'rnn'"):
        import_drafter(out, "speculators", tiny_target)
    (out / "config.json").write_text(json.dumps(config))
    assert isinstance(import_drafter(out, "speculators", tiny_target), DSpark)
