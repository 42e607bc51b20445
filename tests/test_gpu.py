"""On a CUDA device (marked `gpu`; scripts/gpu_check.sh runs the wider device check): the tiny target
and every shipped drafter on the GPU, speculative greedy output equal to plain greedy output, and the
drafter's tensors on the device.  Without a CUDA device these tests are deselected (pytest reports how
many), never run as passing."""
import pytest
import torch

from conftest import prompts
from draftsmith.heads.decoding.verifier import decode
from draftsmith.heads.registry import registry
from draftsmith.heads.runtime.target import Target

pytestmark = pytest.mark.gpu

SETTINGS = {"medusa": {"num_heads": 3}, "eagle": {}, "eagle3": {"layer_ids": [1, 1, 2], "draft_vocab_size": 40}}


@pytest.fixture(scope="module")
def cuda_target(tiny_target_dir):
    return Target.load(str(tiny_target_dir), dtype="float32", device="cuda")


@pytest.mark.parametrize("kind", sorted(SETTINGS))
def test_a_random_drafter_on_the_gpu_is_lossless(cuda_target, kind):
    torch.manual_seed(0)
    cls = registry()[kind]
    drafter = cls(cls.config_class(**SETTINGS[kind]), cuda_target).to(cuda_target.device).eval()
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.05)
    drafter.set_proposal(chain=3)
    assert all(p.device.type == "cuda" for p in drafter.parameters())
    for prompt in prompts(cuda_target, count=2):
        assert decode(cuda_target, prompt, 24, drafter=drafter).tokens == decode(cuda_target, prompt, 24).tokens
