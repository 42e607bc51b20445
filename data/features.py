"""The hidden-state cache for offline training.

Per data shard, one safetensors file holds the target's hidden states at
the layers a drafter needs (docs/design.md ids; the final layer N always, since
the target's distribution is recomputed from it rather than stored), in
bf16, for every token that training reads (each record cut to
data.max_seq_len, recorded as `max_tokens`): `features` [tokens, layers, d]
and `offsets` [records + 1].  A file is written to a temporary name and renamed,
and carries the sha256 of its feature bytes, the layer ids and the target's
weights hash; a file that fails any of these is named in the error and only
it is rebuilt.

Self-distillation fills the cache for free: generation already runs the
target over every prompt and reply token, so it keeps the hidden states it
computes.  For data that was not generated (or a cache with other layers),
`build_missing` runs one batched forward per shard.

Checksums are computed streaming, from the file (a multi-GB shard is never
loaded whole to check it), and a shard checked once gets a stamp beside it
(`shard-N.verified.json`: its size, modification time and checksum), so that
train.verify_cache=first-use hashes each shard once, not on every run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from draftsmith.heads.infra.files import human_size, require_free_space, write_atomic

from .shards import read_shard

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


STREAM_CHUNK = 16 << 20


PIECE = 1 << 20          # the stamp keeps a digest per MiB of the file, for the first-use spot check
SPOT_PIECES = 4          # MiB read per shard per run by first-use: the first piece (header, offsets) and 3 others


class PieceDigests:
    """A digest per PIECE bytes of a stream (the last piece shorter), 16 hex digits each."""

    def __init__(self):
        self.digests: list[str] = []
        self.current, self.filled = hashlib.sha256(), 0

    def update(self, data) -> None:
        data = memoryview(data).cast("B")
        pos = 0
        while pos < len(data):
            take = min(PIECE - self.filled, len(data) - pos)
            self.current.update(data[pos:pos + take])
            self.filled, pos = self.filled + take, pos + take
            if self.filled == PIECE:
                self.digests.append(self.current.hexdigest()[:16])
                self.current, self.filled = hashlib.sha256(), 0

    def finish(self) -> list[str]:
        if self.filled:
            self.digests.append(self.current.hexdigest()[:16])
            self.current, self.filled = hashlib.sha256(), 0
        return self.digests


def streamed_checksum(path: Path) -> tuple[str, list[str]]:
    """The sha256 of the `features` tensor's bytes (the same digest as hashing the tensor's bytes in memory:
    safetensors stores it as its little-endian bytes) and the file's piece digests, from one pass over the
    file in 16 MiB reads (a multi-GB shard is never loaded whole)."""
    digest, pieces = hashlib.sha256(), PieceDigests()
    with open(path, "rb") as f:
        head = f.read(8)
        header_size = int.from_bytes(head, "little")
        raw = f.read(header_size)
        header = json.loads(raw)
        pieces.update(head)
        pieces.update(raw)
        start, end = (8 + header_size + o for o in header["features"]["data_offsets"])
        pos, size = 8 + header_size, path.stat().st_size
        while pos < size:
            block = f.read(min(STREAM_CHUNK, size - pos))
            if not block:
                break
            pieces.update(block)
            lo, hi = max(start, pos), min(end, pos + len(block))
            if lo < hi:
                digest.update(memoryview(block)[lo - pos:hi - pos])
            pos += len(block)
        if pos < end:
            raise CacheError(f"feature shard {path} is truncated; delete it to rebuild it")
    return digest.hexdigest(), pieces.finish()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.stem + ".verified.json")


def _stamp(path: Path, sha256: str, pieces: list[str]) -> None:
    info = path.stat()
    write_atomic(_stamp_path(path), json.dumps({"size": info.st_size, "mtime_ns": info.st_mtime_ns, "sha256": sha256,
                                                "piece": PIECE, "pieces": pieces}))


def _stamped(path: Path, sha256: str | None) -> dict | None:
    """The stamp, when it says this very file (same size and modification time) was checked against `sha256`
    and holds a digest per piece of it; else None."""
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        info = path.stat()
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict) or stamp.get("piece") != PIECE or not isinstance(stamp.get("pieces"), list):
        return None
    same = (stamp.get("size"), stamp.get("mtime_ns"), stamp.get("sha256")) == (info.st_size, info.st_mtime_ns, sha256)
    return stamp if same and len(stamp["pieces"]) == -(-info.st_size // PIECE) else None


def spot_check(path: Path, stamp: dict, count: int = SPOT_PIECES) -> str | None:
    """None if `count` pieces of the file (the first, and others at random: different ones each run) still
    have the digests the stamp kept; else which piece changed.  Catches bytes changed under an unchanged size
    and modification time (bit rot, a bad copy, `touch -r`) with probability about count/pieces per run."""
    pieces = stamp["pieces"]
    chosen = [0, *random.SystemRandom().sample(range(1, len(pieces)), min(count - 1, len(pieces) - 1))]
    with open(path, "rb") as f:
        for index in chosen:
            f.seek(index * PIECE)
            if hashlib.sha256(f.read(PIECE)).hexdigest()[:16] != pieces[index]:
                return (f"feature shard {path} changed since it was verified: MiB {index} of {len(pieces)} differs "
                        "under the same size and modification time (bit rot or a bad copy)")
    return None


def write_shard(path: Path, per_record: list[torch.Tensor], layers, target_hash: str,
                max_tokens: int | None = None) -> None:
    """per_record: one [tokens_i, layers, d] tensor per record, in record order, each stored cut to
    `max_tokens` (what training reads: data.max_seq_len).

    Written as a safetensors file record by record (its header first, from the shapes and a first,
    hashing pass): the shard is never held twice in memory, as a concatenation would."""
    pieces = [_as_bytes_view(f[:max_tokens] if max_tokens is not None else f) for f in per_record]
    if pieces and len({p.shape[1:] for p in pieces}) > 1:
        raise CacheError(f"feature shard {path}: records of different shapes {sorted({p.shape[1:] for p in pieces})}")
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(memoryview(piece.numpy()).cast("B"))
    sha256 = digest.hexdigest()
    rows = sum(p.shape[0] for p in pieces)
    tail = list(pieces[0].shape[1:]) if pieces else []
    offsets = torch.tensor([0] + [p.shape[0] for p in pieces]).cumsum(0)
    feature_bytes = rows * (math.prod(tail) if tail else 0) * BYTES_PER_VALUE
    metadata = {"layers": json.dumps(sorted(set(layers))), "target": target_hash, "sha256": sha256}
    if max_tokens is not None:
        metadata["max_tokens"] = str(max_tokens)
    header = {"__metadata__": metadata,
              "offsets": {"dtype": "I64", "shape": [len(offsets)], "data_offsets": [0, 8 * len(offsets)]},
              "features": {"dtype": "BF16", "shape": [rows, *tail],
                           "data_offsets": [8 * len(offsets), 8 * len(offsets) + feature_bytes]}}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        digests = PieceDigests()
        with open(tmp, "wb") as f:
            for block in (len(encoded).to_bytes(8, "little"), encoded,
                          offsets.to(torch.int64).numpy().tobytes()):     # where safetensors puts offsets: first
                f.write(block)
                digests.update(block)
            for piece in pieces:
                block = memoryview(piece.numpy()).cast("B")
                f.write(block)
                digests.update(block)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _stamp(path, sha256, digests.finish())            # from the bytes in hand: checked by construction


def _as_bytes_view(features: torch.Tensor) -> torch.Tensor:
    """A record's features as contiguous bf16 on the CPU, viewed as int16 (numpy has no bf16)."""
    return features.to(torch.bfloat16).cpu().contiguous().view(torch.int16)


def shard_bytes(records: list[dict]) -> int:
    """What a shard's records take on disk: their features (as stored) and their JSONL lines, roughly."""
    total = 0
    for r in records:
        feats = r.get("features")
        if feats is not None:
            total += feats.numel() * BYTES_PER_VALUE
        total += len(r["input_ids"]) * 40
    return total


class ShardReader:
    """Random access to the records of one cache file (memory-mapped); `layers` are the ones it holds.

    verify: 'always' hashes the features (streaming); 'first-use' only when no stamp says this file was
    hashed already; 'never' (or False) reads the header only; 'on-read' (training, after build_missing
    checked the file) reads the header, then checks each MiB a record touches against the stamp's digest
    the first time it is read (`record`), so a byte changed anywhere since the stamp is never trained on.
    `max_tokens`: what training reads per record (data.max_seq_len); a file cut shorter than that is
    refused."""

    def __init__(self, path: Path, layers, target_hash: str, verify: str | bool = "always",
                 max_tokens: int | None = None):
        self.path = path
        verify = {True: "always", False: "never"}.get(verify, verify)
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
        stored = int(meta["max_tokens"]) if "max_tokens" in meta else None
        if max_tokens is not None and stored is not None and stored < max_tokens:
            raise CacheError(f"feature shard {path} was cut at {stored} tokens per record, and training reads "
                             f"up to {max_tokens} (data.max_seq_len)")
        stamp = _stamped(path, meta.get("sha256")) if verify in ("first-use", "on-read") else None
        self.pieces, self.checked = (stamp["pieces"] if verify == "on-read" and stamp else None), set()
        if self.pieces is not None:
            features = self.handle.get_slice("features")
            with open(path, "rb") as f:
                header_size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(header_size))
            self.data_start = 8 + header_size + int(header["features"]["data_offsets"][0])
            self.row_bytes = math.prod(features.get_shape()[1:]) * BYTES_PER_VALUE
            self._check_pieces(0, self.data_start)           # the header and the record offsets, at once
        if verify == "always" or (verify == "first-use" and stamp is None):
            sha256, pieces = streamed_checksum(path)
            if sha256 != meta.get("sha256"):
                raise CacheError(f"feature shard {path} is corrupted (checksum mismatch); delete it to rebuild it")
            _stamp(path, sha256, pieces)
        elif verify == "first-use" and stamp is not None and (changed := spot_check(path, stamp)):
            raise CacheError(changed)
        self.columns = sorted(set(layers))

    def record(self, row: int) -> torch.Tensor:
        """[tokens, layers, d] of record `row`."""
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        if self.pieces is not None and end > start:
            self._check_pieces(self.data_start + start * self.row_bytes, self.data_start + end * self.row_bytes)
        return self.handle.get_slice("features")[start:end]

    def _check_pieces(self, lo: int, hi: int) -> None:
        """The MiB pieces of bytes [lo, hi) not checked yet in this run, against the stamp's digests."""
        wanted = [i for i in range(lo // PIECE, (hi - 1) // PIECE + 1) if i not in self.checked]
        if not wanted:
            return
        with open(self.path, "rb") as f:
            for index in wanted:
                f.seek(index * PIECE)
                if hashlib.sha256(f.read(PIECE)).hexdigest()[:16] != self.pieces[index]:
                    discard(self.path)
                    raise CacheError(f"feature shard {self.path} changed since it was verified: MiB {index} of "
                                     f"{len(self.pieces)} differs (bit rot or a bad copy), found as training read "
                                     "it; it is deleted, and the same command (with resume=true) rebuilds it")
                self.checked.add(index)


def check_shard(path: Path, layers, target_hash: str, verify: str = "always", max_tokens: int | None = None) -> str | None:
    """None if the shard is whole (as far as `verify` looks), else why not."""
    if not path.is_file():
        return "missing"
    try:
        ShardReader(path, layers, target_hash, verify=verify, max_tokens=max_tokens)
    except CacheError as err:
        return str(err)
    return None


@torch.no_grad()
def compute_features(target, records: list[dict], layers, batch_size: int = 8,
                     max_tokens: int | None = None) -> list[torch.Tensor]:
    """One forward per batch of records' input_ids (cut to `max_tokens`: causal attention makes the
    first tokens' states the same): [min(tokens_i, max_tokens), layers, d] each."""
    layers = sorted(set(layers))
    out: list[torch.Tensor] = [None] * len(records)
    lengths = [min(len(r["input_ids"]), max_tokens or len(r["input_ids"])) for r in records]
    order = sorted(range(len(records)), key=lambda i: lengths[i])
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        longest = max(lengths[i] for i in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        for j, i in enumerate(chunk):
            n = lengths[i]
            ids[j, :n] = torch.tensor(records[i]["input_ids"][:n])
            mask[j, :n] = 1
        hidden = target.features(ids.to(target.device), mask.to(target.device), layers)
        stacked = torch.stack([hidden[layer] for layer in layers], dim=2)          # [b, s, layers, d]
        for j, i in enumerate(chunk):
            out[i] = stacked[j, : lengths[i]].to(torch.bfloat16).cpu()
        del hidden, stacked
    return out


def build_missing(target, shards: list[Path], layers, out_dir: Path, progress: bool = True,
                  max_tokens: int | None = None, verify: str = "always") -> int:
    """Compute the cache files missing or broken for these JSONL data shards (checked as `verify` says:
    train.verify_cache); returns how many were built.  Under a launch, each process passes its own share."""


    todo = []
    start, checked, spotted = time.time(), 0, 0
    for shard in shards:
        path = out_dir / (shard.stem + ".safetensors")
        hashed = verify == "always" or (verify == "first-use" and path.is_file() and not _stamped_file(path))
        problem = check_shard(path, layers, target.identity.weights_sha256, verify, max_tokens)
        if hashed and problem is None:
            checked += path.stat().st_size
        spotted += verify == "first-use" and not hashed and problem is None
        if problem is not None:
            if problem != "missing":      # deleted now: whatever path follows (a whole target loaded, a rerun),
                discard(path)             # the next check finds it missing and builds it; it never trains
                log.warning("%s; deleted, and rebuilt before training", problem)
            todo.append((shard, path))
    if checked:
        seconds = max(time.time() - start, 1e-6)
        log.info("feature cache: %s verified in %.1f s (%.2f GB/s, train.verify_cache=%s)", human_size(checked),
                 seconds, checked / seconds / 1e9, verify)
    if spotted:
        log.info("feature cache: %d verified shards spot-checked (%d MiB each, at places that vary by run) in %.2f s",
                 spotted, SPOT_PIECES, time.time() - start)
    if not todo:
        return 0
    tokens = sum(min(len(r["input_ids"]), max_tokens or len(r["input_ids"])) for shard, _ in todo
                 for r in read_shard(shard))
    size = estimate_bytes(tokens, layers, target.hidden_size)
    log.info("feature cache: %d shards to compute, about %.1f MB (%d tokens x %d layers x %d x bf16) in %s",
             len(todo), size / 1e6, tokens, len(set(layers)), target.hidden_size, out_dir)
    require_free_space(out_dir, size, f"the feature cache ({tokens} tokens x {len(set(layers))} layers x "
                       f"{target.hidden_size} x bf16; train.features=online needs none)")
    for shard, path in tqdm(todo, desc="feature cache", disable=not progress):
        records = read_shard(shard)
        write_shard(path, compute_features(target, records, layers, max_tokens=max_tokens), layers,
                    target.identity.weights_sha256, max_tokens)
    return len(todo)


def discard(path: Path) -> None:
    """A shard judged corrupt goes, with its stamp: nothing can take it for verified again."""
    path.unlink(missing_ok=True)
    _stamp_path(path).unlink(missing_ok=True)


def _stamped_file(path: Path) -> bool:
    """A stamp for this file exists and matches its size and time (the checksum is compared on reading)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            sha = (handle.metadata() or {}).get("sha256")
    except Exception:  # noqa: BLE001 - unreadable: check_shard says so
        return False
    return _stamped(path, sha)
