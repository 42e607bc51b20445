"""The GPU-shaped tier: what a GPU gives the code, given on the CPU (tests/gpu_shaped.py, docs/gpu.md).

Two devices: a tiny target spread over `cuda:0` and `cuda:1` (`target.device_map`), whose tensors keep
their CPU data but refuse to meet a tensor of the other device, as CUDA does.  Decoding (plain, chain,
static and dynamic trees), batched data generation with captured features, and an MTP drafter's
proposals all run through it, and give the tokens the same target gives on one device.
"""
from __future__ import annotations

import json
from pathlib import Path

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
            "eagle": ({}, {"chain": 3}),
            "dspark": ({"layer_ids": [1, 2], "draft_vocab_size": 40, "markov_rank": 8, "block_size": 4}, {"chain": 4})}


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


def test_random_draws_on_a_gpu_take_that_gpus_generator(spread):
    """A CUDA generator in the tier: a draw on cuda:0 refuses a CPU generator (as CUDA does) and takes
    torch.Generator("cuda:0").  Sampled speculative decoding over the spread target, seeded by a generator of
    the target's device, gives the tokens of the same seed on the CPU; DFlash's and DSpark's held-out
    validation draws its fixed anchors from a generator of the batch's device.  Before the stand-in
    torch.Generator("cuda:0") raised on this machine, so none of these paths could run here."""
    mode, target, single = spread
    with mode:
        with pytest.raises(CrossDeviceError, match="Expected a 'cuda' device type for generator but found 'cpu'"):
            torch.rand(3, device="cuda:0", generator=torch.Generator().manual_seed(0))
        assert torch.rand(3, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(0)).device.type == "cuda"
    for kind, settings, proposal in (("eagle3", {"layer_ids": [1, 2, 3], "draft_vocab_size": 40}, {"chain": 3}),
                                     ("dspark", {"layer_ids": [1, 2], "draft_vocab_size": 40, "markov_rank": 8,
                                                 "block_size": 4}, {"chain": 4})):
        cls = registry()[kind]
        torch.manual_seed(0)
        reference = cls(cls.config_class(**settings), single).eval()
        reference.set_proposal(**proposal)
        expected = decode(single, [5, 6, 7, 8], 12, drafter=reference, temperature=1.0,
                          generator=torch.Generator().manual_seed(3)).tokens
        with mode:
            drafter = cls(cls.config_class(**settings), target).eval()
            drafter.load_state_dict(reference.state_dict())
            drafter.to(target.device).set_proposal(**proposal)
            got = decode(target, [5, 6, 7, 8], 12, drafter=drafter, temperature=1.0,
                         generator=torch.Generator(device=target.device).manual_seed(3)).tokens
        assert got == expected, kind
    with mode:
        for kind in ("dflash", "dspark"):
            cls = registry()[kind]
            drafter = cls(cls.config_class(layer_ids=[1, 2], draft_vocab_size=40, num_layers=1), target)
            drafter = drafter.to(target.device).eval()
            ids = torch.randint(3, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
            ids = ids.to("cuda:0")
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
            batch["features"] = target.features(ids, batch["attention_mask"], drafter.required_layers)
            first, again = drafter.sample_anchors(batch)[0], drafter.sample_anchors(batch)[0]
            assert first.device.type == "cuda" and torch.equal(first, again)
            assert torch.isfinite(drafter.loss(batch).loss)


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


# -- vLLM on one card ------------------------------------------------------------------------------------------

STUB_VLLM = '''"""A stand-in for vLLM (tests/test_gpu_shaped.py): records each LLM(**kwargs), serves nothing."""
import json
from pathlib import Path
import os

__version__ = "stub"
if os.environ.get("STUB_VLLM_GPU_BYTES"):          # the worker asks torch about its device after importing vLLM
    import torch
    total = int(os.environ["STUB_VLLM_GPU_BYTES"])
    torch.cuda.is_available = lambda: True
    torch.cuda.mem_get_info = lambda device=None: (total, total)
    torch.cuda.get_device_name = lambda device=None: "stub GPU"


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class LLM:
    def __init__(self, **kwargs):
        with open(os.environ["STUB_VLLM_RECORD"], "a") as f:
            f.write(json.dumps(kwargs, default=str) + "\\n")

    def generate(self, *args, **kwargs):
        return []
'''


def start_stub_engines(tmp_path, monkeypatch, target_dir, card_bytes: int | None) -> list[dict]:
    """Start the two engines bench keeps alive (the plain one and a speculative one) as bench starts them,
    against the stub vLLM; what each asked LLM() for."""
    import sys

    from draftsmith.eval.bench_vllm import Worker, engine_argv

    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text(STUB_VLLM)
    record = tmp_path / "llm.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "stub"))
    monkeypatch.setenv("STUB_VLLM_RECORD", str(record))
    if card_bytes:
        monkeypatch.setenv("STUB_VLLM_GPU_BYTES", str(card_bytes))
    argv = engine_argv(target_dir, "bfloat16", 16, 4096)
    workers = []
    try:
        workers.append(Worker(sys.executable, argv, tmp_path / "plain.log"))
        workers.append(Worker(sys.executable, argv + ["--method", "ngram", "--k", "3"], tmp_path / "spec.log"))
    finally:
        for worker in workers:
            worker.close()
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_two_vllm_engines_share_one_gpu_with_cuda_graphs_on(tmp_path, monkeypatch, tiny_target_dir):
    """On an 80 GiB card the two engines bench keeps alive ask for shares that fit together (vLLM refuses a
    second engine whose share is not free), each sized to its weights, KV cache and overhead, with CUDA
    graphs on.  Before: no share was passed (vLLM's default 0.9 each) and enforce_eager was always on."""
    calls = start_stub_engines(tmp_path, monkeypatch, tiny_target_dir, card_bytes=80 << 30)
    assert len(calls) == 2
    shares = [call["gpu_memory_utilization"] for call in calls]
    assert sum(shares) <= 0.9 and all(0 < s < 0.45 for s in shares), shares
    assert not any(call["enforce_eager"] for call in calls)


def test_an_engine_that_cannot_fit_beside_another_is_refused_by_name(tmp_path, monkeypatch, tiny_target_dir):
    """A 3 GiB card cannot hold two engines of 2 GiB overhead each: the worker says so, with the numbers."""
    from draftsmith.eval.bench_settings import BenchError

    with pytest.raises(BenchError, match=r"2 vLLM engines share this GPU \(3 GiB\).*lower --concurrency"):
        start_stub_engines(tmp_path, monkeypatch, tiny_target_dir, card_bytes=3 << 30)


def test_on_a_cpu_vllm_engines_run_eager_without_a_gpu_share(tmp_path, monkeypatch, tiny_target_dir):
    calls = start_stub_engines(tmp_path, monkeypatch, tiny_target_dir, card_bytes=None)
    assert [call["enforce_eager"] for call in calls] == [True, True]
    assert not any("gpu_memory_utilization" in call for call in calls)


# -- dtypes: fp32 master weights and fp32 rotary frequencies under every cast ------------------------------

AUDITED = {"medusa": {"num_heads": 2}, "medusa2": {"num_heads": 2}, "eagle": {},
           "eagle3": {"layer_ids": [1, 1, 2], "draft_vocab_size": 40},
           "p_eagle": {"layer_ids": [1, 1, 2], "draft_vocab_size": 40},
           "dflash": {"layer_ids": [1, 2], "draft_vocab_size": 40, "num_layers": 2},
           "dspark": {"layer_ids": [1, 2], "draft_vocab_size": 40, "num_layers": 2, "markov_rank": 8}}


def floating_buffers(module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers() if b.is_floating_point()}


@pytest.fixture(scope="module")
def bf16_target(tiny_target_dir):
    return Target.load(str(tiny_target_dir), "bfloat16", "cpu")


@pytest.mark.parametrize("kind", sorted(AUDITED))
@pytest.mark.parametrize("cast", ["to(bfloat16)", "bfloat16()"])
def test_every_drafter_keeps_fp32_weights_and_rotary_buffers(bf16_target, kind, cast):
    """Beside a bf16 target every drafter's trainable parameters are fp32 (the master weights), and after
    eval's `.to(target.dtype)` or DeepSpeed's `module.bfloat16()` its floating buffers (rotary inv_freq)
    keep their dtype and values.  Before: inv_freq became bf16 (EAGLE, EAGLE-3, P-EAGLE, DFlash)."""
    cls = registry()[kind]
    drafter = cls(cls.config_class(**AUDITED[kind]), bf16_target)
    trainable = {n: p.dtype for n, p in drafter.named_parameters() if p.requires_grad}
    assert trainable and set(trainable.values()) == {torch.float32}, trainable
    before = floating_buffers(drafter)
    drafter = drafter.to(torch.bfloat16) if cast == "to(bfloat16)" else drafter.bfloat16()
    after = floating_buffers(drafter)
    assert before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), name


def test_mtp_trains_fp32_master_weights_that_an_adamw_step_at_the_recipes_lr_changes(tmp_path):
    """The MTP layer beside a bf16 target, one AdamW step at the shipped GLM-4.5-Air recipe's lr (5e-5) under
    bf16 autocast, as the training loop runs it: nearly every element with a gradient moves.  Before: the
    layer was bf16 with bf16 moments, and most updates rounded away."""
    from draftsmith.heads.mtp import Mtp, MtpConfig
    from draftsmith.train.settings import load_recipe

    lr = load_recipe(Path(__file__).parents[1] / "recipes" / "mtp-glm-4.5-air.yaml").train.lr
    target = Target.load(str(build_mtp_target(tmp_path / "mtp", "deepseek_v3")), "bfloat16", "cpu")
    drafter = Mtp(MtpConfig(), target).train()
    ids = torch.randint(3, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = target.features(ids, batch["attention_mask"], drafter.required_layers)
    before = {n: p.detach().clone() for n, p in drafter.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = drafter.loss(batch).loss
    loss.backward()
    with_grad = {n for n, p in drafter.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    optimizer.step()
    moved = sum(int((p.detach() != before[n]).sum()) for n, p in drafter.named_parameters() if n in with_grad)
    total = sum(before[n].numel() for n in with_grad)
    assert total and moved / total > 0.95, f"{moved} of {total} elements moved"
    assert {p.dtype for p in drafter.parameters() if p.requires_grad} == {torch.float32}


# -- exact resume: every device's CUDA generator -----------------------------------------------------------

def test_resume_state_saves_and_restores_every_cuda_generator(tmp_path):
    """The rank state a checkpoint writes holds each CUDA device's generator, and resuming puts each back (on a
    mocked two-GPU torch.cuda).  Before: only torch.get_rng_state() was saved, so EAGLE-1's feature noise and
    DFlash's anchors drew differently after a resume on a GPU."""
    from draftsmith.train.checkpointing import load_state_file, rank_rng_state, restore_rank_rng

    with TwoDevices() as mode:
        for device, seed in ((0, 11), (1, 12)):
            torch.cuda.set_rng_state(torch.Generator().manual_seed(seed).get_state(), device)
        torch.save(rank_rng_state(), tmp_path / "rng-0.pt")
        saved = [mode.rng_states[i].clone() for i in (0, 1)]
        torch.cuda.set_rng_state_all([torch.Generator().manual_seed(99).get_state()] * 2)    # drawn on after saving
        restore_rank_rng(load_state_file(tmp_path / "rng-0.pt"))
        assert all(torch.equal(mode.rng_states[i], saved[i]) for i in (0, 1))
        assert not torch.equal(saved[0], saved[1])


# -- training attention in a form a fused CUDA kernel takes ------------------------------------------------

@pytest.mark.parametrize("kind", ["eagle3", "p_eagle", "dflash", "dspark"])
def test_masked_training_attention_takes_a_fused_kernel_form_under_the_cuda_rule(tiny_target, monkeypatch, kind):
    """Under the CUDA rule (forced on the CPU) every masked SDPA call of the training-time test (EAGLE-3,
    P-EAGLE) and of DFlash's block has as many key heads as query heads and no enable_gqa (flash refuses a
    mask, the memory-efficient kernel refuses enable_gqa: with both SDPA falls back to the math kernel), and
    the loss and gradients are the CPU rule's.  Before: enable_gqa with a mask on every device."""
    import torch.nn.functional as F

    from draftsmith.heads import eagle_layer

    cls = registry()[kind]
    settings = {"eagle3": {"layer_ids": [1, 1, 2], "draft_vocab_size": 40},
                "p_eagle": {"layer_ids": [1, 1, 2], "draft_vocab_size": 40},
                "dflash": {"layer_ids": [1, 2], "draft_vocab_size": 40, "num_layers": 2},
                "dspark": AUDITED["dspark"]}[kind]
    torch.manual_seed(0)
    drafter = cls(cls.config_class(**settings), tiny_target)
    assert tiny_target.config.num_key_value_heads < tiny_target.config.num_attention_heads   # grouped heads
    ids = torch.randint(3, tiny_target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch["features"] = tiny_target.features(ids, batch["attention_mask"], drafter.required_layers)

    def loss_and_grads():
        drafter.zero_grad()
        torch.manual_seed(1)                      # DFlash draws its anchors
        loss = drafter.loss(batch).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters() if p.grad is not None]

    cpu_loss, cpu_grads = loss_and_grads()
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[1], k.shape[1], attn_mask is not None, kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(eagle_layer, "KERNEL_DEVICE", "cuda")
    cuda_loss, cuda_grads = loss_and_grads()
    masked = [c for c in calls if c[2]]
    assert masked and all(q_heads == k_heads and not gqa for q_heads, k_heads, _, gqa in masked), calls
    assert torch.allclose(cuda_loss, cpu_loss, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(cuda_grads, cpu_grads))


# -- data at scale: the wait for the slowest rank -------------------------------------------------------------

def test_the_data_ranks_wait_for_the_slowest_while_it_lives_and_name_a_dead_one(tmp_path, monkeypatch):
    """Rank 0 has finished; rank 1 still works (its heartbeat fresh) and finishes later: rank 0 waits however
    long that takes (the gloo barrier gave up after dist_timeout_minutes).  A rank whose heartbeat went stale
    is named in the error."""
    import threading
    import time

    from draftsmith.data.progress import Launch, Progress

    first = Progress(tmp_path, 10, 0, Launch(rank=0, world=2), None, False, "data")
    second = Progress(tmp_path, 10, 0, Launch(rank=1, world=2), None, False, "data")
    first.close({"generated_tokens": 5})
    threading.Timer(1.0, second.close, args=({"generated_tokens": 7},)).start()
    began = time.time()
    first.wait_for_ranks(stale_minutes=1, poll=0.05)
    assert time.time() - began >= 0.9 and first.totals() == {"generated_tokens": 12}

    dead = Progress(tmp_path / "again", 10, 0, Launch(rank=1, world=2), None, False, "data")
    dead._beating.set()                                                    # the rank's process is gone
    time.sleep(0.2)
    waiter = Progress(tmp_path / "again", 10, 0, Launch(rank=0, world=2), None, False, "data")
    waiter.close({})
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] gave no sign of life"):
        waiter.wait_for_ranks(stale_minutes=0.1 / 60, poll=0.05)


def test_a_target_loads_straight_onto_its_gpu(tiny_target_dir, monkeypatch):
    """On a (virtual) GPU the weights go from the files to the device (device_map {"": device}), never whole
    in host memory first: 8 ranks of an 8B target built on the host held about 128 GB at once."""
    from transformers import AutoModelForCausalLM

    asked = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        asked.append(kwargs.get("device_map"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    with TwoDevices():
        target = Target.load(str(tiny_target_dir), "float32", "cuda:1")
        assert {p.device for p in target.model.parameters()} == {torch.device("cuda:1")}
    assert asked == [{"": "cuda:1"}]


def test_the_vllm_data_engine_computes_in_the_gpus_dtype(tiny_target_dir, monkeypatch):
    """data.backend=vllm holds the target's embedding and lm_head on the CPU beside the engine; with
    target.dtype auto, the engine on a GPU computes in bf16 (the GPU's choice), not in the host CPU's dtype."""
    import sys
    import types

    from draftsmith.data.settings import DataSettings
    from draftsmith.data.vllm_backend import Engine

    asked = {}
    stub = types.ModuleType("vllm")
    stub.LLM = lambda **kwargs: asked.update(kwargs)
    monkeypatch.setitem(sys.modules, "vllm", stub)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)   # a host CPU without bf16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    with TwoDevices():
        target = Target.load(str(tiny_target_dir), "auto", "cpu", layers=False)
        Engine(target, DataSettings(backend="vllm", max_new_tokens=8))
    assert target.device.type == "cpu" and asked["dtype"] == "bfloat16" and asked["enforce_eager"] is False


# -- host waits per micro-batch, as docs/scale.md counts them -----------------------------------------------

def documented_waits() -> dict[str, str]:
    """docs/scale.md's table: drafter -> host waits per micro-batch ('2', 'K + 2', 'train_steps')."""
    import re
    text = (Path(__file__).parents[1] / "docs" / "scale.md").read_text()
    return dict(re.findall(r"^\s*\| `(\w+)` \| ([^|]+?) \|", text, flags=re.M))


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "p_eagle", "dflash", "dspark", "mtp"])
def test_a_drafters_loss_waits_on_the_device_as_often_as_docs_scale_says(tmp_path, kind):
    """One micro-batch's loss and backward on a virtual CUDA device: the host's waits (`.item()`, `int()`,
    `nonzero`, a boolean mask index, ...) are counted and must be what docs/scale.md's table says.  Before:
    each boolean mask index waited too (Medusa 12, DFlash 22 at K = 4)."""
    documented = documented_waits()
    if kind == "mtp":
        directory, cls, settings = build_mtp_target(tmp_path / "mtp", "deepseek_v3"), registry()["mtp"], {}
    else:
        directory = build_tiny_target(tmp_path / "tiny", "llama")
        cls, settings = registry()[kind], AUDITED[kind]
    mode = TwoDevices()
    with mode:
        target = Target.load(str(directory), "float32", "cuda:0")
        drafter = cls(cls.config_class(**settings), target).to(target.device).train()
        ids = torch.randint(3, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)).to("cuda:0")
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
        batch["features"] = target.features(ids, batch["attention_mask"], drafter.required_layers)
        mode.host_waits.clear()
        drafter.loss(batch).loss.backward()
        waits = list(mode.host_waits)
    expected = documented[kind].replace("D", str(getattr(drafter, "drafts", 0))).replace(
        "K", str(getattr(drafter, "K", 0))).replace(
        "train_steps", str(getattr(drafter.config, "train_steps", 0)))
    assert len(waits) == sum(int(term) for term in expected.split("+")), (kind, waits, documented[kind])


def test_muon_orthogonalises_in_bf16_on_a_gpu_and_in_fp32_on_a_cpu():
    """Muon's device branch (train/optimizers.py): a step of a parameter on a virtual cuda:0 equals the same
    step with the Newton-Schulz iterations in bf16, and stays an fp32 parameter on cuda:0; on the CPU the
    iterations run in fp32 (torch.optim.Muon's bf16 is ~90x slower on a CPU without bf16 arithmetic)."""
    from draftsmith.train.optimizers import MUON, Muon, orthogonalize

    torch.manual_seed(0)
    start, grad = torch.randn(16, 8), torch.randn(16, 8)
    expected = {}
    for dtype in (torch.bfloat16, torch.float32):
        update = orthogonalize(grad * (1 - MUON["momentum"]) * MUON["momentum"] + grad * (1 - MUON["momentum"]),
                               MUON["ns_steps"], dtype)
        expected[dtype] = start * (1 - 0.01 * MUON["weight_decay"]) - 0.01 * 0.2 * 16 ** 0.5 * update
    cpu = torch.nn.Parameter(start.clone())
    cpu.grad = grad.clone()
    Muon([cpu], lr=0.01, **MUON).step()
    torch.testing.assert_close(cpu.detach(), expected[torch.float32])
    with TwoDevices():
        gpu = torch.nn.Parameter(start.clone().to("cuda:0"))
        gpu.grad = grad.clone().to("cuda:0")
        Muon([gpu], lr=0.01, **MUON).step()
        assert gpu.device == torch.device("cuda:0") and gpu.dtype == torch.float32
        got = gpu.detach().cpu()
    torch.testing.assert_close(got, expected[torch.bfloat16])
    assert not torch.allclose(expected[torch.bfloat16], expected[torch.float32], rtol=0, atol=1e-6)
