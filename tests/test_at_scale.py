"""Training at its users' scale, rehearsed without a GPU: collectives on the training device (NCCL
refuses CPU tensors), held-out validation that streams, a feature cache that is cut to what training
reads, hashed streaming and once, split over the processes, a disk check from measured lengths."""
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import chats_file, tiny_recipe
from draftsmith.data import features as feature_cache
from draftsmith.data.distill import DataSettings, make_data, plan_batches, shard_paths
from draftsmith.data.space import estimate_lengths
from draftsmith.heads.drafter import StepOutput
from draftsmith.train.batches import Batches, DataNotReady
from draftsmith.train.loop import Window, _log_window, total_tokens
from draftsmith.train.validation import _validate
from draftsmith.train.settings import RecipeError, recipe_from_dict

REPO = Path(__file__).resolve().parents[1]


class StrictAccelerator:
    """An accelerator double on a device that is not the CPU (meta), whose collectives refuse a tensor
    on any other device, as NCCL does ("No backend type associated with device type cpu").  It stands
    for rank 0 of two processes: a reduced tensor comes back as twice what this process sent."""

    def __init__(self, device="meta", processes=2):
        self.device = torch.device(device)
        self.num_processes, self.process_index, self.is_main_process = processes, 0, True
        self.distributed_type = DistributedType.MULTI_GPU
        self.collectives = 0

    def reduce(self, tensor, reduction="sum"):
        self.collectives += 1
        if tensor.device != self.device:
            raise RuntimeError(f"No backend type associated with device type {tensor.device.type} "
                               f"(a collective on {self.device})")
        return torch.full(tensor.shape, 2.0) if tensor.device.type == "meta" else tensor * self.num_processes

    def log(self, *args, **kwargs):
        pass

    def unwrap_model(self, model):
        return model

    def autocast(self):
        import contextlib
        return contextlib.nullcontext()


def test_log_windows_collectives_take_tensors_on_the_training_device(tmp_path):
    """Every tensor `_log_window` and the token total hand to a collective sits on accelerator.device.
    (Today's main before this change passed CPU tensors, and this double refused them.)"""
    accelerator = StrictAccelerator()
    window = Window(accelerator.device)
    device = accelerator.device
    out = StepOutput(loss=torch.ones((), device=device), correct=torch.ones(3, device=device),
                     counted=torch.ones(3, device=device))
    window.add(out, torch.ones((), dtype=torch.long, device=device), 0.5, step=0)
    window.steps = 1
    scheduler = SimpleNamespace(get_last_lr=lambda: [1e-3])
    metrics = _log_window(accelerator, window, {"step": 1, "epoch": 0}, scheduler, tmp_path / "log.jsonl", False)
    assert accelerator.collectives >= 1 and metrics["train/agreement_0"] == 1.0
    assert total_tokens(accelerator, {"tokens": 5}) == 2          # what the double's sum of a meta tensor gives


class CountingBatches(Batches):
    """Held-out batches that count how many collated batches are alive at once."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.alive, self.peak, self.made = 0, 0, 0

    def collate(self, rows):
        batch = super().collate(rows)
        self.alive += 1
        self.made += 1
        self.peak = max(self.peak, self.alive)
        weakref.finalize(batch["input_ids"], self._freed)
        return batch

    def _freed(self):
        self.alive -= 1


class StubDrafter(torch.nn.Module):
    """Scores every loss-mask token of a batch as one position; knows nothing of the target."""
    required_layers = ()
    draft_positions = 1

    def loss(self, batch):
        n = batch["loss_mask"].sum().float().reshape(1)
        return StepOutput(loss=n.sum(), correct=n, counted=n)

    def topk_hits(self, batch):
        return None


def _heldout(rows: int) -> CountingBatches:
    g = torch.Generator().manual_seed(rows)
    ids = [torch.randint(4, 100, (5 + i % 7,), generator=g).tolist() for i in range(rows)]
    columns = {"input_ids": ids, "loss_mask": [[0, 0] + [1] * (len(x) - 2) for x in ids],
               "shard": [""] * rows, "row": list(range(rows))}
    return CountingBatches(columns, 2, 0)


@pytest.mark.parametrize("processes", [1, 2, 3])
def test_heldout_validation_holds_one_batch_at_a_time_whatever_the_heldout_size(tmp_path, processes):
    """Each process collates only its own share, one batch at a time: the peak of collated batches
    alive at once is the same for 10 and for 40 held-out batches (today's main collated them all
    before slicing: a peak of 10 and 40), every process makes the same number of calls, and the
    counts summed over the processes are the whole held-out set's."""
    recipe = SimpleNamespace(train=SimpleNamespace(eval_prompts=0, report_to="none"))
    peaks, totals = [], []
    for rows in (20, 80):
        expected = sum(sum(m) for m in _heldout(rows).rows["loss_mask"])
        counted, calls = 0.0, set()
        for rank in range(processes):
            heldout = _heldout(rows)
            accelerator = StrictAccelerator("cpu", processes)
            accelerator.process_index, accelerator.is_main_process = rank, rank == 0
            accelerator.reduce = lambda t, reduction="sum": t          # this process's own share
            metrics, _ = _validate(recipe, accelerator, SimpleNamespace(device=torch.device("cpu")), StubDrafter(),
                                   heldout, {"step": 0}, calibrate=False)
            counted += metrics["heldout/positions"]
            calls.add(heldout.made)
            peaks.append(heldout.peak)
        assert len(calls) == 1, calls          # equal call counts (ZeRO-3 gathers weights inside each)
        totals.append((counted, expected))
    assert max(peaks) <= 2, peaks
    for counted, expected in totals:
        assert counted == expected


def test_bad_process_group_timeouts_and_cache_checks_are_named(tiny_target_dir, tmp_path):
    raw = tiny_recipe(tmp_path, tiny_target_dir)
    for value, message in ((0, "train.dist_timeout_minutes must be a number of minutes > 0"),
                           (-5, "train.dist_timeout_minutes must be a number of minutes > 0"),
                           ("soon", "'train': 'dist_timeout_minutes' must be a number, got 'soon'")):
        with pytest.raises(RecipeError, match=message):
            recipe_from_dict({**raw, "train": {**raw["train"], "dist_timeout_minutes": value}})
    with pytest.raises(RecipeError, match="train.verify_cache must be first-use, always or never"):
        recipe_from_dict({**raw, "train": {**raw["train"], "verify_cache": "sometimes"}})


@pytest.mark.multiprocess
def test_the_process_group_timeout_reaches_torch_distributed(tiny_target_dir, tmp_path):
    """train.dist_timeout_minutes is the timeout of the process group accelerate makes (2 gloo processes)."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, torch.distributed as dist\n"
        "from draftsmith.train.settings import recipe_from_dict\n"
        "from draftsmith.train.accelerator import make_accelerator\n"
        "import json\n"
        f"raw = json.loads({json.dumps(json.dumps(tiny_recipe(tmp_path, tiny_target_dir, dist_timeout_minutes=37)))})\n"
        "acc = make_accelerator(recipe_from_dict(raw))\n"
        "from torch.distributed.distributed_c10d import _get_default_group\n"
        "group = _get_default_group()\n"
        "timeout = group._get_backend(__import__('torch').device('cpu')).options._timeout\n"
        "sys.stdout.write(f'TIMEOUT {timeout.total_seconds()}\\n'); sys.stdout.flush()\n")   # one write a rank
    import socket
    with socket.socket() as probe:                  # a port nothing else holds now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
                           "recipes/accelerate/ddp.yaml", "--num_processes", "2", "--mixed_precision", "no",
                           "--main_process_port", str(port), str(script)], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("TIMEOUT 2220.0\n") == 2, done.stdout


def test_a_launch_of_several_processes_without_data_is_refused_before_the_target_loads(tiny_target_dir, tmp_path):
    from draftsmith.train.batches import require_data_for_launch

    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_target_dir))
    require_data_for_launch(recipe, 1)                      # one process makes its own data
    with pytest.raises(DataNotReady, match=r"has 2 processes.*`draftsmith data RECIPE output_dir="):
        require_data_for_launch(recipe, 2)


def _cache_run(tiny_target, tmp_path, max_seq_len, count=8):
    settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", count)), max_conversations=None,
                            batch_size=2, max_new_tokens=16, max_seq_len=max_seq_len)
    layers = [1, tiny_target.num_layers]
    make_data(tiny_target, settings, tmp_path / "data", seed=0, progress=False, capture_layers=layers)
    return settings, layers, feature_cache.cache_dir(tmp_path / "data", layers)


def test_the_cache_holds_the_tokens_training_reads_and_a_longer_read_rebuilds_it(tiny_target, tmp_path):
    """Records longer than data.max_seq_len: the cache stores max_seq_len tokens of each (features
    bytes = tokens x layers x d x 2), equal to the first tokens of a whole forward; a run that reads
    more tokens finds the shards too short and rebuilds them, and the training reader refuses a short one."""
    from draftsmith.data.distill import read_shard

    settings, layers, cache = _cache_run(tiny_target, tmp_path, max_seq_len=10)
    records = [r for shard in shard_paths(tmp_path / "data") for r in read_shard(shard)]
    assert max(len(r["input_ids"]) for r in records) > 10                    # the cut matters here
    stored = sum(min(len(r["input_ids"]), 10) for r in records)
    size = sum(feature_cache.ShardReader(p, layers, tiny_target.identity.weights_sha256).offsets[-1].item()
               for p in sorted(cache.glob("shard-*.safetensors")))
    assert size == stored
    first = shard_paths(tmp_path / "data")[0]
    reader = feature_cache.ShardReader(cache / (first.stem + ".safetensors"), layers, tiny_target.identity.weights_sha256)
    whole = feature_cache.compute_features(tiny_target, read_shard(first), layers)
    for row, expected in enumerate(whole):
        got = reader.record(row).float()
        assert got.shape[0] == min(expected.shape[0], 10)
        assert torch.allclose(got[:-1], expected[: got.shape[0] - 1].float(), atol=0.03, rtol=0.02)
    problem = feature_cache.check_shard(cache / (first.stem + ".safetensors"), layers,
                                        tiny_target.identity.weights_sha256, "never", max_tokens=64)
    assert problem and "cut at 10 tokens" in problem
    rebuilt = feature_cache.build_missing(tiny_target, shard_paths(tmp_path / "data"), layers, cache, progress=False,
                                          max_tokens=64, verify="first-use")
    assert rebuilt == len(shard_paths(tmp_path / "data"))


def test_verification_streams_once_per_shard_under_first_use(tiny_target, tmp_path, monkeypatch):
    """first-use: a shard written here carries its stamp and is not hashed again; a changed file loses
    its stamp and is hashed (and a corrupted one rebuilt); always hashes every time; never only reads
    headers.  The streamed digest is the digest of the tensor's bytes."""
    _, layers, cache = _cache_run(tiny_target, tmp_path, max_seq_len=64)
    shards = shard_paths(tmp_path / "data")
    files = sorted(cache.glob("shard-*.safetensors"))
    for path in files:
        meta = feature_cache.safe_open(str(path), framework="pt").metadata()
        assert feature_cache.streamed_checksum(path)[0] == meta["sha256"]
    hashed = []
    real = feature_cache.streamed_checksum
    monkeypatch.setattr(feature_cache, "streamed_checksum", lambda p: hashed.append(p.name) or real(p))
    build = lambda verify: feature_cache.build_missing(tiny_target, shards, layers, cache, progress=False,  # noqa: E731
                                                       max_tokens=64, verify=verify)
    assert build("first-use") == 0 and hashed == []
    assert build("always") == 0 and len(hashed) == len(files)
    hashed.clear()
    assert build("never") == 0 and hashed == []
    victim = files[1]
    data = bytearray(victim.read_bytes())
    data[-7] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert build("never") == 0                      # headers only: not seen
    assert build("first-use") == 1 and hashed == [victim.name]       # changed since its stamp: hashed, rebuilt
    hashed.clear()
    assert build("first-use") == 0 and hashed == []


def test_the_disk_estimate_comes_from_measured_lengths_not_the_maximum(tiny_target, tmp_path):
    """Before any shard: a probe of the source's conversations, said so; after some: the shards' own
    mean length.  Both far below the per-conversation maximum (max_prompt_tokens + max_new_tokens)."""
    settings = DataSettings(source=str(chats_file(tmp_path / "c.jsonl", 16)), max_conversations=None, batch_size=4,
                            max_new_tokens=16, max_prompt_tokens=1024, max_seq_len=2048)
    from draftsmith.data import sources
    from draftsmith.data.distill import columns, read_shard
    convs = list(sources.conversations(settings.source, columns=columns(settings)))
    batches = plan_batches(convs, settings.batch_size, 0)
    probe = estimate_lengths(tiny_target, settings, tmp_path / "data", batches)
    assert "probe of 16 source conversations" in probe.source
    assert probe.tokens < 100 < settings.max_prompt_tokens + settings.max_new_tokens
    make_data(tiny_target, DataSettings(**{**settings.__dict__, "max_conversations": 8}), tmp_path / "data", seed=0,
              progress=False)
    measured = estimate_lengths(tiny_target, settings, tmp_path / "data", batches)
    records = [r for shard in shard_paths(tmp_path / "data") for r in read_shard(shard)]
    assert "measured on the 2 shard(s) made so far (8 conversations)" == measured.source
    assert measured.tokens == pytest.approx(sum(len(r["input_ids"]) for r in records) / 8)


def _grads(drafter, batch):
    torch.manual_seed(5)                    # EAGLE-1's training noise: the same in both runs
    params = [p for p in drafter.parameters() if p.requires_grad]
    loss = drafter.loss(batch).loss
    return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa2"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_target_dir, kind):
    """train.gradient_checkpointing recomputes activations in backward: the loss and every gradient
    equal those of the run that keeps them (EAGLE's draft layer per test-time step, Medusa-2's backbone)."""
    from draftsmith.heads.registry import registry
    from draftsmith.heads.runtime.target import Target
    from draftsmith.train.batches import collate

    target = Target.load(str(tiny_target_dir), "float32")
    config = {"eagle3": {"draft_vocab_size": 64, "ttt_steps": 3}, "eagle": {}, "medusa2": {"num_heads": 2}}[kind]
    cls = registry()[kind]
    from draftsmith.heads.infra.config import config_from_dict
    torch.manual_seed(0)
    drafter = cls(config_from_dict(cls.config_class, config, "drafter"), target)
    drafter.attach_backbone()
    if kind == "medusa2":
        drafter.micro_steps = drafter.joint.heads_only_steps          # the joint stage: the backbone trains
        for name, p in drafter.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)                     # a LoRA that changes the output
    drafter.train()
    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": torch.randint(4, target.vocab_size, (n,), generator=g).tolist(),
             "loss_mask": [0] * 3 + [1] * (n - 3)} for n in (11, 8)]
    batch = collate(rows)
    batch["features"] = target.features(batch["input_ids"], batch["attention_mask"], drafter.required_layers) \
        if drafter.required_layers else {}
    steps = getattr(drafter, "micro_steps", None)
    kept_loss, kept = _grads(drafter, batch)
    if steps is not None:
        drafter.micro_steps = steps
    mlp = {"eagle3": lambda: drafter.midlayer.mlp, "eagle": lambda: drafter.layer.mlp,
           "medusa2": lambda: target.decoder.layers[0].mlp}[kind]()
    calls, forward = [], mlp.forward

    def counted(*args, **kwargs):          # module hooks do not fire in a checkpoint's recomputation
        calls.append(1)
        return forward(*args, **kwargs)
    mlp.forward = counted
    if steps is not None:
        drafter.micro_steps = steps
    _grads(drafter, batch)
    kept_calls = len(calls)
    if steps is not None:
        drafter.micro_steps = steps
    assert drafter.enable_gradient_checkpointing()
    calls.clear()
    loss, grads = _grads(drafter, batch)
    assert len(calls) > kept_calls, "nothing was recomputed in backward"
    assert torch.allclose(loss, kept_loss, rtol=1e-6)
    for a, b in zip(grads, kept):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
