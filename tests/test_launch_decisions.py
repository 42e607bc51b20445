"""The decisions behind a launch that only a GPU or a cluster shows whole, tested one by one on the CPU:
vLLM's start method, the devices each engine takes, the vLLM path's shard size, the loss denominators
under FSDP's mixed precision, and the launch's one clock."""
import os
from types import SimpleNamespace

import pytest
import torch
from draftsmith.data.vllm_backend import use_spawn, visible_devices
from draftsmith.heads.drafter import term_denominators
from draftsmith.train.schedule import LaunchClock, warmup_cosine
from conftest import chats_file, tiny_recipe


def test_the_vllm_data_path_sets_spawn_before_anything_touches_cuda(tiny_target_dir, tmp_path, monkeypatch):
    """`draftsmith data`: when the device is first resolved (the first question to torch about CUDA, in the
    recipe's own checks), vLLM's start method is already spawn; a method the user set is kept.  (The
    variable is read by vLLM only: the transformers backend has it too, unused.)"""
    import yaml

    from draftsmith.cli import main
    from draftsmith.heads.infra import device as device_module

    seen = []

    class Stop(Exception):
        pass

    def resolve(value):
        seen.append(os.environ.get("VLLM_WORKER_MULTIPROC_METHOD"))
        raise Stop

    monkeypatch.setattr(device_module, "resolve_device", resolve)
    raw = tiny_recipe(tmp_path, tiny_target_dir)
    for backend, preset in (("vllm", None), ("vllm", "fork"), ("transformers", None)):
        monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
        if preset:
            monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", preset)
        raw["data"]["backend"] = backend
        raw["output_dir"] = str(tmp_path / f"{backend}-{preset}")
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(raw))
        assert main(["data", str(path)]) != 0          # stopped at the device, as planned
    assert seen == ["spawn", "fork", "spawn"]
    env = {}
    assert use_spawn(env) == "spawn" and env == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def test_each_engine_takes_the_devices_its_local_indices_name_in_the_visible_list():
    assert visible_devices([0], "4,5,6,7") == "4"
    assert visible_devices([2, 3], "4,5,6,7") == "6,7"
    assert visible_devices([1], "GPU-aa, GPU-bb") == "GPU-bb"
    assert visible_devices([0, 1], None) == "0,1" and visible_devices([1], "") == "1"
    with pytest.raises(ValueError, match=r"needs local GPU\(s\) \[2\], but CUDA_VISIBLE_DEVICES=4,5 makes 2 visible"):
        visible_devices([2], "4,5")


def test_the_vllm_paths_features_are_bounded_by_shard_mb(tiny_target, tmp_path):
    """The vLLM path writes its shards before their features exist (the feature pass computes them after
    the engine is gone, one file per shard or part): the split counts the features to come, so no
    feature file, nor what the pass holds for it, passes data.shard_mb."""
    from safetensors import safe_open

    from draftsmith.data import features as feature_cache
    from draftsmith.data.distill import write_shard
    from draftsmith.data.shards import shard_paths

    layers = [1, tiny_target.num_layers]
    g = torch.Generator().manual_seed(0)
    records = [{"id": f"c{i}", "input_ids": torch.randint(6, tiny_target.vocab_size, (40,), generator=g).tolist(),
                "loss_mask": [0] * 10 + [1] * 30} for i in range(24)]
    out = tmp_path / "data"
    (out / "shards").mkdir(parents=True)
    features_dir = feature_cache.cache_dir(out, layers)
    limit_mb = 0.05
    write_shard(tiny_target, out, 0, [dict(r) for r in records], (), features_dir, max_tokens=64, shard_mb=limit_mb,
                pending_feature_values=len(layers) * tiny_target.hidden_size)
    shards = shard_paths(out)
    assert len(shards) > 2 and any(".part" in s.name for s in shards)
    feature_cache.build_missing(tiny_target, shards, layers, features_dir, progress=False, max_tokens=64)
    files = list(features_dir.glob("*.safetensors"))
    assert len(files) == len(shards)
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            shape = handle.get_slice("features").get_shape()
        assert shape[0] * len(layers) * tiny_target.hidden_size * 2 <= limit_mb * 1e6, (f, shape)


def test_loss_denominators_stay_exact_under_fsdp_mixed_precision(tmp_path, monkeypatch):
    """FSDP2's mixed precision casts every floating-point tensor of a forward's inputs to bf16 (accelerate
    leaves cast_forward_inputs on): a token count of 1,001 would reach the loss as 1,000.  The loop hands
    the counts over as integers (step_denominators) with the share beside them, so the loss divides by
    the exact count, the same as in one process."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from draftsmith.train.batches import step_denominators

    class Counter(torch.nn.Module):
        loss_counts = staticmethod(lambda batch: batch["counts"].float())

    sampler = SimpleNamespace(groups=[[0], [1]], batches=SimpleNamespace(
        _rows=lambda group: [{"input_ids": [1], "loss_mask": [1], "shard": "", "row": group[0]}]))
    monkeypatch.setattr("draftsmith.train.batches.collate",
                        lambda rows: {"counts": torch.tensor([500.0 + rows[0]["row"], 499.0])})
    counts = step_denominators(Counter(), sampler, 0, grad_accum=2)
    assert counts.dtype == torch.int64 and counts.tolist() == [1001, 998]

    seen = {}

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(4, 4)

        def forward(self, batch):
            seen["denominators"] = term_denominators(batch, torch.zeros(2))
            return self.w(batch["x"]).sum()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        probe = fully_shard(Probe(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                    cast_forward_inputs=True))
        probe({"x": torch.ones(1, 4), "loss_denominators": counts, "loss_share": 4})
    finally:
        dist.destroy_process_group()
    assert seen["denominators"].dtype == torch.float32
    assert seen["denominators"].tolist() == [1001 / 4, 998 / 4]


def test_the_launch_clock_is_rank_zeros_and_moves_only_when_shared(monkeypatch):
    """Between two shares every process reads the same elapsed time, whatever its own clock says; the
    learning rate under train.max_minutes follows that value only.  One process reads its clock each step."""
    import draftsmith.train.schedule as schedule

    now = [1000.0]
    monkeypatch.setattr(schedule.time, "time", lambda: now[0])
    clock = LaunchClock(limit_seconds=100.0)
    factor = warmup_cosine(0, 10 ** 6, clock)
    broadcasts = []
    monkeypatch.setattr(torch.distributed, "broadcast",
                        lambda tensor, src: broadcasts.append(src) or tensor.fill_(50.0))   # rank 0 says 50 s
    two = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
    now[0] += 80.0                                  # this process's own clock says 80 s
    assert not clock.due(3, 10, 2) and clock.due(10, 10, 2) and clock.due(3, 10, 1)
    assert factor(5) == pytest.approx(1.0)          # nothing shared yet: elapsed 0
    assert clock.sync(two) == 50.0 and broadcasts == [0]
    assert factor(5) == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi * 0.5)).item()))
    one = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    assert clock.sync(one) == 80.0 and broadcasts == [0]
