"""The GPU-shaped tier: what a GPU gives the code, given on the CPU (tests/gpu_shaped.py, docs/gpu.md).

Two devices: a tiny target spread over `cuda:0` and `cuda:1` (`target.device_map`), whose tensors keep
their CPU data but refuse to meet a tensor of the other device, as CUDA does.  Decoding (plain, chain,
static and dynamic trees), batched data generation with captured features, and an MTP drafter's
proposals all run through it, and give the tokens the same target gives on one device.
"""
from __future__ import annotations

import pytest
import torch

from conftest import prompts
from gpu_shaped import CrossDeviceError, TwoDevices
from tiny_models import build_mtp_target, build_tiny_target
from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.tree import TreeShape
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.registry import registry
from draftsmith.heads.runtime.target import Target

pytestmark = pytest.mark.gpu_shaped


def split_map(layers: int, first: int) -> dict:
    """The embedding and the first `first` layers on cuda:0; the rest, the norm and the head on cuda:1."""
    placement = {"model.embed_tokens": "cuda:0", "model.norm": "cuda:1", "model.rotary_emb": "cuda:1",
                 "lm_head": "cuda:1"}
    placement.update({f"model.layers.{i}": "cuda:0" if i < first else "cuda:1" for i in range(layers)})
    return placement


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    """(mode, the tiny target spread over two virtual GPUs, the same target on the CPU)."""
    directory = build_tiny_target(tmp_path_factory.mktemp("spread"), "llama", layers=4)
    mode = TwoDevices()
    with mode:
        target = Target.load(str(directory), "float32", device="cuda:0", device_map=split_map(4, 2))
    return mode, target, Target.load(str(directory), "float32", "cpu")


def test_the_mode_refuses_what_cuda_refuses():
    """The tier's own check: a mixed-device op and a foreign index raise; a move, a CPU index and a slice
    copy do not."""
    with TwoDevices() as mode:
        a, b = torch.ones(3, device="cuda:0"), torch.ones(3, device="cuda:1")
        assert (a.device, b.device, b.to("cuda:0").device, b.device) == (
            torch.device("cuda:0"), torch.device("cuda:1"), torch.device("cuda:0"), torch.device("cuda:1"))
        with pytest.raises(CrossDeviceError):
            a + b
        with pytest.raises(CrossDeviceError):
            b[torch.tensor([0, 1], device="cuda:0")]
        assert b[torch.tensor([0, 1])].device == torch.device("cuda:1")
        a[:2] = b[:2]
        assert (a * torch.tensor(2.0)).device == torch.device("cuda:0")     # a 0-dim CPU tensor joins
        int(a.sum())
        assert mode.host_waits == ["__int__"]


def test_a_spread_target_loads_and_its_logits_come_back_to_the_callers_device(spread):
    """Target.load's self-check compares the engine's logits with the model's own; before the fix the
    engine's stayed on the final norm's device (cuda:1) and the load raised."""
    mode, target, _ = spread
    with mode:
        assert target.device == torch.device("cuda:0")
        assert target.lm_head.weight.device == torch.device("cuda:1")
        cache = target.new_cache(1, 8)
        ids = torch.tensor([[5, 6, 7]], device="cuda:0")
        out = target.forward_block(cache, ids, torch.arange(3, device="cuda:0")[None], layer_ids=(1, 3, 4))
        assert out.logits.device == torch.device("cuda:0")
        assert {h.device for h in out.hidden_states.values()} == {torch.device("cuda:0")}


SETTINGS = {"medusa": ({"num_heads": 3}, {"tree": TreeShape([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])}),
            "eagle3": ({"layer_ids": [1, 2, 3], "draft_vocab_size": 40}, {"tree": TreeSettings(3, 2, 5)}),
            "eagle": ({}, {"chain": 3})}


@pytest.mark.parametrize("kind", sorted(SETTINGS))
def test_speculative_decoding_over_a_spread_target_gives_the_single_device_tokens(spread, kind):
    """Plain, chain and tree decoding over two devices: every index, tree mask and cache compaction on the
    right device, and the tokens those of the same target on one device."""
    mode, target, single = spread
    settings, proposal = SETTINGS[kind]
    cls = registry()[kind]
    torch.manual_seed(0)
    reference = cls(cls.config_class(**settings), single).eval()
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.05)
    reference.set_proposal(**proposal)
    with mode:
        drafter = cls(cls.config_class(**settings), target).eval()
        drafter.load_state_dict(reference.state_dict())
        drafter.to(target.device)
        drafter.set_proposal(**proposal)
        for prompt in prompts(single, count=2):
            plain = decode(target, prompt, 20)
            speculative = decode(target, prompt, 20, drafter=drafter)
            expected = decode(single, prompt, 20, drafter=reference)
            assert plain.tokens == speculative.tokens == expected.tokens
            assert speculative.accepted == expected.accepted


def test_data_generation_over_a_spread_target_keeps_rows_and_features(spread):
    """Batched generation (rows leaving the batch, the stream refilling them) with captured features: the
    same tokens and features as on one device."""
    from draftsmith.data.generate import generate_batch
    from draftsmith.data.stream import generate_stream

    mode, target, single = spread
    batch = [p[: 3 + i] for i, p in enumerate(prompts(single, count=5, length=8))]
    expected = generate_batch(single, batch, 10, capture_layers=(1, 4))
    streamed_expected = generate_stream(single, batch, 10, rows=2, capture_layers=(1, 4))
    with mode:
        got = generate_batch(target, batch, 10, capture_layers=(1, 4))
        streamed = generate_stream(target, batch, 10, rows=2, capture_layers=(1, 4))
        assert {g.features.device for g in got + streamed} == {torch.device("cuda:0")}
    for mine, theirs in zip(got + streamed, expected + streamed_expected):
        assert mine.token_ids == theirs.token_ids
        assert torch.equal(mine.features, theirs.features)


def test_mtp_proposals_over_a_spread_target(tmp_path):
    """The MTP layer sits with the embedding (cuda:0) while the target's rotary embedding and head are on
    cuda:1: its proposals are lossless and equal the single-device ones."""
    from draftsmith.heads.mtp import Mtp, MtpConfig

    directory = build_mtp_target(tmp_path / "mtp", "deepseek_v3")
    single = Target.load(str(directory), "float32", "cpu")
    mode = TwoDevices()
    with mode:
        target = Target.load(str(directory), "float32", device="cuda:0",
                             device_map=split_map(single.num_layers, 1))
        drafter = Mtp(MtpConfig(), target).to(target.device).eval()       # as load_drafter places it
        drafter.set_proposal(chain=3)
        reference = Mtp(MtpConfig(), single).eval()
        reference.set_proposal(chain=3)
        for prompt in prompts(single, count=2, length=7):
            plain = decode(target, prompt, 16)
            speculative = decode(target, prompt, 16, drafter=drafter)
            assert speculative.tokens == plain.tokens == decode(single, prompt, 16).tokens
            assert speculative.accepted == decode(single, prompt, 16, drafter=reference).accepted
