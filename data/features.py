"""The hidden-state cache for offline training.

Per data shard, one safetensors file holds the target's hidden states at
the layers a drafter needs (docs/design.md ids; the final layer N always, since
the target's distribution is recomputed from it rather than stored), in
bf16, for every token of every record: `features` [tokens, layers, d] and
`offsets` [records + 1].  A file is written to a temporary name and renamed,
and carries the sha256 of its feature bytes, the layer ids and the target's
weights hash; a file that fails any of these is named in the error and only
it is rebuilt.

Self-distillation fills the cache for free: generation already runs the
target over every prompt and reply token, so it keeps the hidden states it
computes.  For data that was not generated (or a cache with other layers),
`build_missing` runs one batched forward per shard.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from draftsmith.heads.files import require_free_space, save_tensors_atomic

log = logging.getLogger(__name__)

BYTES_PER_VALUE = 2   # bf16


class CacheError(ValueError):
    """A feature cache that does not fit the data, target or drafter."""


def layers_key(layers) -> str:
    return "L" + "-".join(str(i) for i in sorted(set(layers)))


def cache_dir(data_dir: Path, layers) -> Path:
    return Path(data_dir) / "features" / layers_key(layers)


def existing_superset(data_dir: Path, layers) -> Path | None:
    """A cache directory already holding at least these layers for every shard, if there is one."""
    wanted = set(layers)
    for directory in sorted((Path(data_dir) / "features").glob("L*")):
        have = {int(i) for i in directory.name[1:].split("-") if i}
        if wanted <= have and directory != cache_dir(data_dir, layers):
            shards = len(list((Path(data_dir) / "shards").glob("shard-*.jsonl")))
            if len(list(directory.glob("shard-*.safetensors"))) == shards:
                return directory
    return None


def estimate_bytes(tokens: int, layers, hidden_size: int) -> int:
    return tokens * len(set(layers)) * hidden_size * BYTES_PER_VALUE


def _checksum(features: torch.Tensor) -> str:
    return hashlib.sha256(features.contiguous().view(torch.int16).numpy().tobytes()).hexdigest()


def write_shard(path: Path, per_record: list[torch.Tensor], layers, target_hash: str) -> None:
    """per_record: one [tokens_i, layers, d] tensor per record, in record order."""
    features = torch.cat([f.to(torch.bfloat16).cpu() for f in per_record]) if per_record else torch.zeros(0)
    offsets = torch.tensor([0] + [f.shape[0] for f in per_record]).cumsum(0)
    metadata = {"layers": json.dumps(sorted(set(layers))), "target": target_hash, "sha256": _checksum(features)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors_atomic({"features": features.contiguous(), "offsets": offsets}, path, metadata=metadata)


class ShardReader:
    """Random access to the records of one cache file (memory-mapped); `layers` are the ones it holds."""

    def __init__(self, path: Path, layers, target_hash: str, verify: bool = True):
        self.path = path
        try:
            self.handle = safe_open(str(path), framework="pt")
            meta = self.handle.metadata() or {}
            self.offsets = self.handle.get_tensor("offsets")
        except Exception as err:  # noqa: BLE001 - any unreadable file is a corrupt shard
            raise CacheError(f"feature shard {path} is unreadable ({err}); delete it to rebuild it") from None
        if json.loads(meta.get("layers", "[]")) != sorted(set(layers)):
            raise CacheError(f"feature shard {path} holds layers {meta.get('layers')}, not {sorted(set(layers))}")
        if meta.get("target") != target_hash:
            raise CacheError(f"feature shard {path} was made with target {meta.get('target')}, not {target_hash}: "
                             "the cache belongs to another target; delete it or use another output_dir")
        if verify and _checksum(self.handle.get_tensor("features")) != meta.get("sha256"):
            raise CacheError(f"feature shard {path} is corrupted (checksum mismatch); delete it to rebuild it")
        self.columns = sorted(set(layers))

    def record(self, row: int) -> torch.Tensor:
        """[tokens, layers, d] of record `row`."""
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        return self.handle.get_slice("features")[start:end]


def check_shard(path: Path, layers, target_hash: str) -> str | None:
    """None if the shard is whole, else why not."""
    if not path.is_file():
        return "missing"
    try:
        ShardReader(path, layers, target_hash, verify=True)
    except CacheError as err:
        return str(err)
    return None


@torch.no_grad()
def compute_features(target, records: list[dict], layers, batch_size: int = 8) -> list[torch.Tensor]:
    """One forward per batch of records' input_ids: [tokens_i, layers, d] each."""
    layers = sorted(set(layers))
    out: list[torch.Tensor] = [None] * len(records)
    order = sorted(range(len(records)), key=lambda i: len(records[i]["input_ids"]))
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        longest = max(len(records[i]["input_ids"]) for i in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for j, i in enumerate(chunk):
            n = len(records[i]["input_ids"])
            ids[j, :n] = torch.tensor(records[i]["input_ids"])
            mask[j, :n] = 1
        hidden = target.features(ids.to(target.device), mask.to(target.device), layers)
        stacked = torch.stack([hidden[layer] for layer in layers], dim=2)          # [b, s, layers, d]
        for j, i in enumerate(chunk):
            out[i] = stacked[j, : len(records[i]["input_ids"])].to(torch.bfloat16).cpu()
    return out


def build_missing(target, shards: list[Path], layers, out_dir: Path, progress: bool = True) -> int:
    """Compute the cache files missing or broken for these JSONL data shards; returns how many were built."""
    from tqdm import tqdm

    from .distill import read_shard

    todo = []
    for shard in shards:
        path = out_dir / (shard.stem + ".safetensors")
        problem = check_shard(path, layers, target.identity.weights_sha256)
        if problem is not None:
            if problem != "missing":
                log.warning("%s; rebuilding only this shard", problem)
            todo.append((shard, path))
    if not todo:
        return 0
    tokens = sum(len(r["input_ids"]) for shard, _ in todo for r in read_shard(shard))
    size = estimate_bytes(tokens, layers, target.hidden_size)
    log.info("feature cache: %d shards to compute, about %.1f MB (%d tokens x %d layers x %d x bf16) in %s",
             len(todo), size / 1e6, tokens, len(set(layers)), target.hidden_size, out_dir)
    require_free_space(out_dir, size, f"the feature cache ({tokens} tokens x {len(set(layers))} layers x "
                       f"{target.hidden_size} x bf16; train.features=online needs none)")
    for shard, path in tqdm(todo, desc="feature cache", disable=not progress):
        records = read_shard(shard)
        write_shard(path, compute_features(target, records, layers), layers, target.identity.weights_sha256)
    return len(todo)
