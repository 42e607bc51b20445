"""EAGLE-3.1's norm options on draftsmith's EAGLE-3 (norm_before_fc, fc_norm, norm_output, and speculators'
norm_before_residual): each changes what the drafter computes, decoding stays lossless, every export writes
the flags and import reads them back, and what import cannot read is refused by name.  The comparison with
drafters the real speculators library makes is in tests/test_serving.py (it needs speculators' environment)."""
import json

import pytest
import torch
from conftest import prompts
from safetensors.torch import load_file, save_file
from test_eagle3 import assert_exact_with_accepted_drafts, overfit

from draftsmith.export import export
from draftsmith.heads.decoding.verifier import decode
from draftsmith.export.importers import import_drafter
from draftsmith.heads.drafter import save_drafter
from draftsmith.heads.eagle3 import NORM_OPTIONS, Eagle3, Eagle3Config
from draftsmith.heads.formats import ImportFormatError
from draftsmith.heads.p_eagle import PEagle, PEagleConfig

SPECULATORS_DEFAULTS = {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True}
ONE_AT_A_TIME = [{name: True} for name in NORM_OPTIONS]


def drafter_with(target, seed=0, whole_vocabulary=False, layer_ids=(1, 1, 2), **options) -> Eagle3:
    """Random weights everywhere (norm weights around 1, so every norm changes the result); a draft
    vocabulary of 40 tokens unless whole_vocabulary."""
    torch.manual_seed(seed)
    vocab = target.vocab_size if whole_vocabulary else 40
    drafter = Eagle3(Eagle3Config(layer_ids=list(layer_ids), draft_vocab_size=vocab, **options), target)
    if not whole_vocabulary:
        drafter.set_draft_vocabulary(torch.arange(40) * 3)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() == 2:
                p.normal_(0, 0.3)
    return drafter


def unrolled_logits(drafter, batch, steps=3) -> list[torch.Tensor]:
    with torch.no_grad():
        return [drafter.logits(hidden) for hidden, _ in zip(drafter.unroll(batch), range(steps))]


def sequence_batch(target, drafter, length=10):
    ids = torch.tensor([prompts(target, count=1, length=length)[0]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = target.features(ids, batch["attention_mask"], drafter.required_layers)
    return batch


@pytest.mark.parametrize("option", ONE_AT_A_TIME, ids=NORM_OPTIONS)
def test_each_option_changes_what_the_drafter_computes(tiny_target, option):
    """The same weights with the option off give other logits: at the first step for the feature norms and
    norm_before_residual, from the second step on for norm_output (it changes only what the next step reads)."""
    drafter = drafter_with(tiny_target, **option)
    plain = Eagle3(Eagle3Config(layer_ids=[1, 1, 2], draft_vocab_size=40), tiny_target)
    plain.set_draft_vocabulary(torch.arange(40) * 3)
    plain.load_state_dict({k: v for k, v in drafter.state_dict().items() if k in plain.state_dict()})
    batch = sequence_batch(tiny_target, drafter)
    mine, theirs = unrolled_logits(drafter, batch), unrolled_logits(plain, batch)
    first_differs = not torch.allclose(mine[0], theirs[0], atol=1e-4)
    assert first_differs == ("norm_output" not in option), option
    assert not torch.allclose(mine[1], theirs[1], atol=1e-4)


@pytest.mark.parametrize("proposal", ["chain", "tree"])
def test_decoding_with_the_speculators_defaults_is_lossless(tiny_target, proposal):
    drafter = drafter_with(tiny_target, whole_vocabulary=True, **SPECULATORS_DEFAULTS)
    cases = prompts(tiny_target)
    overfit(tiny_target, drafter, [p + decode(tiny_target, p, 40).tokens[:34] for p in cases])   # some drafts right
    drafter.set_proposal(chain=4) if proposal == "chain" else drafter.set_proposal(tree_size=10)
    assert_exact_with_accepted_drafts(tiny_target, drafter, cases)


@pytest.mark.parametrize("options", [SPECULATORS_DEFAULTS, {"fc_norm": True, "norm_output": True}],
                         ids=["speculators-defaults", "fc_norm"])
def test_every_export_writes_the_flags_and_import_reads_them_back(tiny_target, options, tmp_path):
    drafter = drafter_with(tiny_target, **options)
    save_drafter(drafter, tmp_path / "ckpt")
    batch = sequence_batch(tiny_target, drafter)
    expected = unrolled_logits(drafter, batch)
    for fmt in ("vllm", "speculators", "sglang", "trtllm"):
        out = export(tmp_path / "ckpt", fmt, tmp_path / fmt, dtype="float32")
        config = json.loads((out / "config.json").read_text())
        assert {name: config[name] for name in NORM_OPTIONS} == {name: options.get(name, False)
                                                                for name in NORM_OPTIONS}, fmt
        if fmt == "speculators":          # [1, 1, 2] repeat a layer: vLLM serves it, the speculators library does not
            assert "the speculators library refuses to load it" in (out / "README.md").read_text()
        tensors = load_file(out / "model.safetensors")
        assert ("input_norm.weight" in tensors) == bool(options.get("norm_before_fc")), fmt
        assert ("fc_norm.2.weight" in tensors) == bool(options.get("fc_norm")), fmt
        back = import_drafter(out, fmt, tiny_target)
        assert {name: getattr(back.config, name) for name in NORM_OPTIONS} == {
            name: options.get(name, False) for name in NORM_OPTIONS}, fmt
        mine, theirs = drafter.state_dict(), back.state_dict()
        assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine), fmt
        for a, b in zip(expected, unrolled_logits(back, batch)):
            torch.testing.assert_close(a, b)


def test_bad_options_and_flags_are_refused_by_name(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="norm_before_fc and drafter.fc_norm exclude each other"):
        Eagle3Config(norm_before_fc=True, fc_norm=True)
    with pytest.raises(ValueError, match="norm_output: P-EAGLE drafts every position in one forward"):
        PEagleConfig(norm_output=True)
    drafter = drafter_with(tiny_target)
    save_drafter(drafter, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "speculators", tmp_path / "spec", dtype="float32")
    written = json.loads((out / "config.json").read_text())

    def import_with(**changes):
        (out / "config.json").write_text(json.dumps({**written, **changes}))
        return import_drafter(out, "speculators", tiny_target)

    with pytest.raises(ImportFormatError, match="norm_before_fc: true but it has no input_norm.weight"):
        import_with(norm_before_fc=True)           # a checkpoint trained without the norm the config claims
    with pytest.raises(ImportFormatError, match="fc_norm: true but it has no fc_norm.0.weight"):
        import_with(fc_norm=True)
    with pytest.raises(ImportFormatError, match="norm_after_mlp: true"):
        import_with(norm_after_mlp=True)           # a flag draftsmith does not read is never dropped
    layer = dict(written["transformer_layer_config"], attention_bias=True)
    with pytest.raises(ImportFormatError, match="transformer_layer_config.attention_bias: true"):
        import_with(transformer_layer_config=layer)
    with pytest.raises(ImportFormatError, match="exclude each other"):
        import_with(norm_before_fc=True, fc_norm=True)
    with pytest.raises(ImportFormatError, match="must be true or false"):
        import_with(norm_output="yes")
    assert isinstance(import_with(), Eagle3)      # the file as written still imports


P_EAGLE_NORMS = [{"norm_before_fc": True}, {"fc_norm": True}, {"norm_before_residual": True},
                 {"norm_before_fc": True, "norm_before_residual": True}]


def p_eagle_with(target, seed=0, layer_ids=(1, 1, 2), **options) -> PEagle:
    torch.manual_seed(seed)
    drafter = PEagle(PEagleConfig(layer_ids=list(layer_ids), draft_vocab_size=40, ttt_steps=3,
                                  tree={"depth": 3, "top_k": 1, "total_tokens": 3}, **options), target)
    drafter.set_draft_vocabulary(torch.arange(40) * 3)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() == 2 and name != "mask_hidden":
                p.normal_(0, 0.3)
    return drafter


@pytest.mark.parametrize("options", P_EAGLE_NORMS, ids=["+".join(o) for o in P_EAGLE_NORMS])
def test_p_eagle_takes_the_norms_and_round_trips_them(tiny_target, tmp_path, options):
    """P-EAGLE with speculators' P-EAGLE norms: the feature norms act on the mask slots' input as on the real
    one's (mask_state changes with them), the option changes the drafts' logits, decoding stays lossless, and
    both exports write the flags and import back to the same drafter and logits."""
    drafter = p_eagle_with(tiny_target, **options)
    plain = PEagle(PEagleConfig(layer_ids=[1, 1, 2], draft_vocab_size=40, ttt_steps=3,
                                tree={"depth": 3, "top_k": 1, "total_tokens": 3}), tiny_target)
    plain.load_state_dict(drafter.state_dict(), strict=False)
    if "norm_before_fc" in options or "fc_norm" in options:
        assert not torch.allclose(drafter.mask_state(), plain.mask_state())
    batch = sequence_batch(tiny_target, drafter)
    with torch.no_grad():
        mine = [drafter.logits(h) for h, _ in zip(drafter.unroll(batch), range(3))]
        without = [plain.logits(h) for h, _ in zip(plain.unroll(batch), range(3))]
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(mine, without))
    cases = prompts(tiny_target, count=2)
    if len(options) > 1:                     # lossless with drafts accepted: once, with two norms at a time
        from test_p_eagle import drafter_for
        fitted, trained = drafter_for(tiny_target, **options), prompts(tiny_target)
        overfit(tiny_target, fitted, [p + decode(tiny_target, p, 40).tokens[:34] for p in trained])
        assert_exact_with_accepted_drafts(tiny_target, fitted, trained)
    save_drafter(drafter, tmp_path / "ckpt")
    for fmt in ("vllm", "speculators"):
        out = export(tmp_path / "ckpt", fmt, tmp_path / fmt, dtype="float32")
        written = json.loads((out / "config.json").read_text())
        assert {name: written[name] for name in NORM_OPTIONS} == {name: options.get(name, False)
                                                                  for name in NORM_OPTIONS}, fmt
        back = import_drafter(out, fmt, tiny_target)
        assert isinstance(back, PEagle)
        assert all(getattr(back.config, name) == options.get(name, False) for name in NORM_OPTIONS)
        theirs = back.state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in drafter.state_dict().items()), fmt
        for prompt in cases:
            assert (decode(tiny_target, prompt, 16, drafter=back).accepted
                    == decode(tiny_target, prompt, 16, drafter=drafter).accepted)


def test_a_p_eagle_export_with_norm_output_imports_without_it(tiny_target, tmp_path, caplog):
    """norm_output changes nothing in a one-forward drafter (speculators' P-EAGLE ignores it): an export
    that sets it imports, with a warning saying so; a feature norm without its tensors is refused by name."""
    drafter = p_eagle_with(tiny_target)
    save_drafter(drafter, tmp_path / "ckpt")
    out = export(tmp_path / "ckpt", "speculators", tmp_path / "spec", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    back = import_drafter(out, "speculators", tiny_target)
    assert isinstance(back, PEagle) and back.config.norm_output is False
    assert "norm_output: true, which changes nothing" in caplog.text
    (out / "config.json").write_text(json.dumps({**config, "norm_before_fc": True}))
    with pytest.raises(ImportFormatError, match="norm_before_fc: true but it has no input_norm.weight"):
        import_drafter(out, "speculators", tiny_target)


def speculators_inputs_to_batch(inputs: dict, drafter) -> dict:
    """speculators' training forward (step s at position t reads token t+s, features at t) as draftsmith's
    batch (step s at t reads token t+1+s): the tokens shifted right by one, the features split per layer."""
    hidden, ids = inputs["hidden_states"], inputs["input_ids"]
    T = drafter.target.hidden_size
    shifted = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)
    features = {layer: hidden[..., i * T:(i + 1) * T] for i, layer in enumerate(drafter.layer_ids)}
    ones = torch.ones_like(shifted)
    return {"input_ids": shifted, "attention_mask": ones, "loss_mask": ones, "features": features}


def compare_with_speculators(drafter, logits_file) -> list[float]:
    """The largest logit difference at each step, over the positions both compute alike (step s: t <= L-2-s)."""
    inputs = load_file(logits_file)
    theirs = [inputs[f"logits.{s}"] for s in range(sum(k.startswith("logits.") for k in inputs))]
    mine = unrolled_logits(drafter, speculators_inputs_to_batch(inputs, drafter), steps=len(theirs))
    length = inputs["input_ids"].shape[1]
    return [float((m[0, :length - 1 - s] - t[0, :length - 1 - s]).abs().max()) for s, (m, t) in
            enumerate(zip(mine, theirs))]


def test_the_speculators_comparison_sees_a_dropped_flag(tiny_target, tmp_path):
    """The check tests/test_serving.py runs against speculators' own drafters, run here on draftsmith's own
    drafter as speculators would compute it: equal when the flags are read, unequal when norm_output is lost."""
    drafter = drafter_with(tiny_target, norm_output=True)
    torch.manual_seed(3)
    L, T = 10, tiny_target.hidden_size
    ids = torch.randint(0, tiny_target.vocab_size, (1, L))
    inputs = {"hidden_states": torch.randn(1, L, 3 * T), "input_ids": ids}
    logits = unrolled_logits(drafter, speculators_inputs_to_batch(inputs, drafter))
    save_file({**inputs, **{f"logits.{s}": x.contiguous() for s, x in enumerate(logits)}}, str(tmp_path / "l.st"))
    assert max(compare_with_speculators(drafter, tmp_path / "l.st")) == 0
    drafter.config.norm_output = False                 # what an import that drops the flag would build
    differences = compare_with_speculators(drafter, tmp_path / "l.st")
    assert differences[0] == 0 and min(differences[1:]) > 1e-3


def test_a_whole_vocabulary_drafter_exports_without_a_map_and_imports_back(tiny_target, tmp_path):
    """A draft vocabulary that is the target's whole vocabulary (a Llama-2 target at the default 32000) has no
    d2t/t2d in any export: vLLM refuses a d2t it has no draft vocabulary for (found serving one, tests/test_serving.py)."""
    drafter = drafter_with(tiny_target, whole_vocabulary=True, **SPECULATORS_DEFAULTS)
    save_drafter(drafter, tmp_path / "ckpt")
    for fmt in ("vllm", "speculators", "sglang", "trtllm"):
        out = export(tmp_path / "ckpt", fmt, tmp_path / fmt, dtype="float32")
        assert not {"d2t", "t2d"} & set(load_file(out / "model.safetensors")), fmt
        back = import_drafter(out, fmt, tiny_target)
        assert torch.equal(back.draft_to_target, drafter.draft_to_target), fmt


def test_p_eagle_warm_starts_from_an_eagle31_checkpoint_with_its_feature_norms(tiny_target, tmp_path):
    """The shipped EAGLE-3 recipe trains speculators' three norms: a P-EAGLE with norm_before_fc and
    norm_before_residual starts from that checkpoint (norm_output has no tensor); one without them is
    refused naming the norm's tensor."""
    from draftsmith.heads.drafter import warm_start

    source = drafter_with(tiny_target, **SPECULATORS_DEFAULTS)
    save_drafter(source, tmp_path / "eagle31")
    fitted = p_eagle_with(tiny_target, norm_before_fc=True, norm_before_residual=True)
    warm_start(fitted, tmp_path / "eagle31")
    assert torch.equal(fitted.input_norm.weight, source.input_norm.weight)
    with pytest.raises(ValueError, match="input_norm.weight"):
        warm_start(p_eagle_with(tiny_target), tmp_path / "eagle31")
