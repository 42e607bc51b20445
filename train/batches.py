"""Training data for the loop: the held-out split, length-grouped batches, padding.

Batches are a pure function of (seed, epoch): shuffled, then sorted by length
inside windows of 32 batches so a batch pads little.  That makes the data
position of a run two integers (epoch, batches consumed), which is all that
exact resume needs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import datasets
import pyarrow.compute as pc
import torch

from draftsmith.data import features as feature_cache
from draftsmith.data.distill import check_same_data, make_data, read_manifest, shard_paths
from draftsmith.data.features import CacheError, ShardReader
from draftsmith.data.health import require_healthy
from draftsmith.heads.registry import drafter_class, registry
from draftsmith.heads.runtime.target import Target, TargetIdentity

from .accelerator import whole_target

log = logging.getLogger(__name__)

WINDOW = 32


def feature_layers(recipe, target: Target) -> tuple[int, ...]:
    """The target layers the recipe's drafter reads (its loss included)."""

    return tuple(registry()[recipe.method](recipe.drafter, target).required_layers)


def make_recipe_data(recipe, target: Target, progress: bool = True, launch=None, full_target=None):
    """The recipe's data step: self-distillation that also fills the feature cache its drafter will read
    (launch, full_target: data/distill.py make_data)."""
    layers = feature_layers(recipe, target) if recipe.train.features == "cache" else ()
    return make_data(target, recipe.data, recipe.out / "data", recipe.seed, progress=progress, capture_layers=layers,
                     launch=launch, full_target=full_target)


@dataclass
class TrainingData:
    train: dict                        # columns: id, input_ids, loss_mask, shard, row
    heldout: dict
    features: FeatureSource | None   # the cache, when train.features is 'cache'


class DataNotReady(ValueError):
    """A multi-process launch that finds no data: making it in one process would leave the others waiting."""


def require_data_for_launch(recipe, processes: int) -> None:
    """Refuse, before any model loads, a launch of several processes that would have to make its data."""
    data_dir = recipe.out / "data"
    if processes > 1 and not (data_dir / "tokenized").is_dir():
        raise DataNotReady(
            f"{data_dir} holds no data yet, and this launch has {processes} processes: one making it while "
            f"the others wait would outlast the process group's timeout at scale. Make it first, in one "
            f"process: `draftsmith data RECIPE output_dir={recipe.out}` (it fills the feature cache too), "
            "then launch training again")


def load_training_data(recipe, target: Target, layers=(), accelerator=None) -> TrainingData:
    """output_dir/data (made first if missing, in a one-process run), split into train and held-out
    columns, and the feature cache for `layers` when train.features is 'cache'.

    Under a launch of P processes nothing is done by one process while the others wait: data must exist
    already (DataNotReady says how to make it), and the cache's shards are checked (train.verify_cache)
    and, where missing or broken, built by the processes together, process r taking shards r, r + P, ..."""
    data_dir = recipe.out / "data"
    use_cache = recipe.train.features == "cache" and bool(layers)
    processes = accelerator.num_processes if accelerator is not None else 1
    if not (data_dir / "tokenized").is_dir():
        require_data_for_launch(recipe, processes)
        log.info("no data in %s yet: making it first", data_dir)
        make_recipe_data(recipe, target)
    manifest = read_manifest(data_dir)
    TargetIdentity.from_dict(manifest["target"]).require_same(target.identity, f"the data in {data_dir}")
    check_same_data(data_dir, recipe.data, recipe.seed, target)     # trains on what the recipe describes
    require_healthy(data_dir, recipe.data)      # junk data is not trained on (data.allow_degenerate overrides)
    source = None
    if use_cache:
        superset = feature_cache.existing_superset(data_dir, layers)
        if superset is not None:          # a cache made for another drafter holds these layers too
            stored = [int(i) for i in superset.name[1:].split("-")]
            cache, layers_stored = superset, stored
        else:
            cache, layers_stored = feature_cache.cache_dir(data_dir, layers), layers
        shards = shard_paths(data_dir)
        rank = accelerator.process_index if accelerator is not None else 0
        feature_cache.build_missing(target, shards[rank::processes], layers_stored, cache,
                                    max_tokens=recipe.data.max_seq_len, verify=recipe.train.verify_cache)
        if accelerator is not None and processes > 1:
            accelerator.wait_for_everyone()                   # every share checked and built
        source = FeatureSource(cache, layers_stored, target.identity.weights_sha256,
                               wanted=layers if superset is not None else None,
                               verify_reads=recipe.train.verify_cache == "first-use")
    arrow = datasets.load_from_disk(str(data_dir / "tokenized")).data.table       # memory-mapped
    columns = {k: arrow.column(k).to_pylist() for k in ("id", "shard", "row")}      # a few bytes a row
    heldout = [_is_heldout(i, recipe.seed, recipe.train.heldout_fraction) for i in columns["id"]]
    if len(columns["id"]) > 1 and all(heldout):
        heldout[0] = False
    split = {False: [i for i, h in enumerate(heldout) if not h], True: [i for i, h in enumerate(heldout) if h]}
    train, held = ({**{k: [vals[i] for i in split[side]] for k, vals in columns.items()},
                    **{k: TokenColumn(arrow.column(k), split[side]) for k in ("input_ids", "loss_mask")}}
                   for side in (False, True))
    if not train["id"]:
        raise ValueError(f"no training conversations in {data_dir}: make more data (data.max_conversations)")
    return TrainingData(train, held, source)


class TokenColumn(Sequence):
    """The token ids (or loss masks) of some rows of the tokenized table, read from its memory-mapped
    Arrow file when a row is asked for: a process holds no Python copy of them (as lists they cost
    about 44 bytes a token: 6 GB for 90k conversations of 1.5k tokens, in every process)."""

    def __init__(self, column, rows: list[int]):
        self.column, self.rows = column, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.column[self.rows[index]].as_py()

    def lengths(self) -> list[int]:
        """Every row's length, from the Arrow offsets (nothing is decoded)."""
        every = pc.list_value_length(self.column).to_numpy()
        return [int(every[i]) for i in self.rows]


class FeatureSource:
    """Cached hidden states by (shard, row), memory-mapped.  The files' checksums were checked (or not,
    as train.verify_cache says) by `build_missing` just before: here their headers are read, and under
    first-use (`verify_reads`) each MiB a record touches is checked against its stamped digest the first
    time training reads it (a first-use spot check reads 4 MiB of a shard; this covers the rest)."""

    def __init__(self, directory, layers, target_hash: str, wanted=None, verify_reads: bool = False):
        self.directory = directory
        self.layers = sorted(set(layers))                          # stored in the files
        self.wanted = sorted(set(wanted)) if wanted else self.layers  # handed to the drafter
        self.readers = {}
        for path in sorted(directory.glob("shard-*.safetensors")):
            self.readers[path.stem] = ShardReader(path, self.layers, target_hash,
                                                  verify="on-read" if verify_reads else "never")

    def batch(self, rows: list[dict], longest: int) -> dict[int, torch.Tensor]:
        """{layer: [b, s, d]} for these rows, zero-padded to `longest`."""
        first = None
        parts = []
        for r in rows:
            feats = self.readers[r["shard"]].record(r["row"])[: len(r["input_ids"])]        # [tokens, L, d]
            if feats.shape[0] < len(r["input_ids"]):
                raise CacheError(f"feature shard {self.readers[r['shard']].path} holds {feats.shape[0]} tokens of "
                                 f"record {r['row']}, which has {len(r['input_ids'])}: the cache was cut shorter "
                                 "than data.max_seq_len; delete it to rebuild it")
            parts.append(feats)
            first = feats if first is None else first
        out = first.new_zeros(len(rows), longest, len(self.layers), first.shape[-1])
        for i, feats in enumerate(parts):
            out[i, : feats.shape[0]] = feats
        return {layer: out[:, :, self.layers.index(layer)] for layer in self.wanted}


def _is_heldout(row_id: str, seed: int, fraction: float) -> bool:
    """By conversation: the extra rows of one conversation ("ID#turnN", data/chat.py) go with it."""
    conv_id = row_id.split("#turn")[0]
    digest = hashlib.sha256(f"{seed}:{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < fraction


class Batches:
    """Micro-batches of row indices for each epoch."""

    def __init__(self, rows: dict, batch_size: int, seed: int, features: FeatureSource | None = None):
        self.rows = rows
        self.features = features
        ids = rows["input_ids"]
        self.lengths = ids.lengths() if isinstance(ids, TokenColumn) else [len(x) for x in ids]
        self.batch_size = batch_size
        self.seed = seed

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size

    def _rows(self, indices: list[int]) -> list[dict]:
        return [{key: self.rows[key][i] for key in ("input_ids", "loss_mask", "shard", "row")} for i in indices]

    def epoch(self, epoch: int) -> EpochSampler:
        order = list(range(len(self.lengths)))
        random.Random(self.seed * 1009 + epoch).shuffle(order)
        window = WINDOW * self.batch_size
        groups = []
        for start in range(0, len(order), window):
            chunk = sorted(order[start:start + window], key=lambda i: self.lengths[i])
            groups.extend(chunk[i:i + self.batch_size] for i in range(0, len(chunk), self.batch_size))
        # Only full batches: a short last batch would leave some processes without rows (and a DDP step
        # waiting for them).  Which rows sit out changes with each epoch's shuffle.
        groups = [g for g in groups if len(g) == self.batch_size]
        if not groups:
            raise ValueError(f"{len(self.lengths)} training conversations do not fill one batch of "
                             f"{self.batch_size} (train.batch_size x processes); lower train.batch_size or make more data")
        random.Random(self.seed * 1013 + epoch).shuffle(groups)
        return EpochSampler(groups, self)

    def batch_count(self) -> int:
        """Batches in data order (held-out evaluation), the last one possibly short."""
        return -(-len(self.lengths) // self.batch_size)

    def batch(self, index: int) -> dict:
        """Batch `index` in data order, collated only now: held-out evaluation holds one at a time."""
        start = index * self.batch_size
        return self.collate(self._rows(list(range(start, min(start + self.batch_size, len(self.lengths))))))

    def collate(self, rows: list[dict]) -> dict:
        batch = collate(rows)
        if self.features is not None:
            batch["features"] = self.features.batch(rows, batch["input_ids"].shape[1])
        return batch


class EpochSampler(torch.utils.data.Dataset):
    """One epoch: a map-style dataset of rows and, in `loader()`, a batch sampler over it (accelerate shards it)."""

    def __init__(self, groups: list[list[int]], batches: Batches):
        self.groups = groups
        self.batches = batches
        self.batch_size = batches.batch_size
        self.drop_last = False

    def __getitem__(self, index: int) -> dict:
        return self.batches._rows([index])[0]

    def __len__(self) -> int:
        return len(self.batches.lengths)

    def loader(self, workers: int = 0, pin_memory: bool = False):
        """Worker processes gather and pad the batches (features included) while the device trains; pinned
        batches are copied to a GPU without the host waiting (accelerate's non_blocking)."""
        return torch.utils.data.DataLoader(self, batch_sampler=_GroupSampler(self.groups, self.batch_size),
                                           collate_fn=self.batches.collate, num_workers=workers,
                                           pin_memory=pin_memory, persistent_workers=False,
                                           prefetch_factor=2 if workers else None)


class _GroupSampler(torch.utils.data.Sampler):
    def __init__(self, groups, batch_size):
        self.groups = groups
        self.batch_size = batch_size
        self.drop_last = False

    def __iter__(self):
        return iter(self.groups)

    def __len__(self):
        return len(self.groups)


def collate(rows: list[dict]) -> dict:
    """Right-pad to the longest row: input_ids, attention_mask, loss_mask, all [b, s]."""
    longest = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.zeros(len(rows), longest, dtype=torch.long)
    attention = torch.zeros(len(rows), longest, dtype=torch.long)
    loss_mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.as_tensor(r["input_ids"])
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.as_tensor(r["loss_mask"])
    return {"input_ids": input_ids, "attention_mask": attention, "loss_mask": loss_mask}


def step_denominators(drafter, sampler, first: int, grad_accum: int) -> torch.Tensor:
    """Each loss term's token count over the optimizer step whose first micro-batch is `first`: all its
    global batches (every process's slice), counted from the masks alone, as integers ([terms] int64).
    The loss divides them by processes x grad_accum (`batch["loss_share"]`), because accelerate (and
    DeepSpeed) divides each micro-batch's loss by grad_accum and the processes' gradients are averaged:
    what is applied is then the gradient of the mean over the step's tokens, the same however the step
    is split (heads/drafter.py, term_denominators)."""
    counts = [drafter.loss_counts(collate(sampler.batches._rows(group)))
              for group in sampler.groups[first: first + grad_accum]]
    return torch.stack(counts).sum(0).round().long()


def training_target(recipe, accelerator) -> Target:
    """The whole target, or only its embedding and lm_head when nothing in this process runs its layers:
    training from a feature cache that is all there, no held-out decoding in this process (eval_prompts
    0, or not the main process), and a drafter that neither trains part of the target (Medusa-2) nor
    copies its layers (init_from_target).  A 70B target then costs each process two matrices."""
    decodes_here = recipe.train.eval_prompts > 0 and accelerator.is_main_process
    trains_target = drafter_class(recipe.method).trains_target_adapter
    light = (recipe.train.features == "cache" and not decodes_here and not trains_target
             and not getattr(recipe.drafter, "init_from_target", False) and not recipe.target.adapter
             and (recipe.out / "data" / "tokenized").is_dir())

    with whole_target(accelerator):
        if light:
            target = recipe.target.load(accelerator.device, layers=False)
            if target.layers_loaded:        # its files did not allow it: loaded whole already
                return target
            data_dir = recipe.out / "data"
            layers = feature_layers(recipe, target)
            shards = len(list((data_dir / "shards").glob("shard-*.jsonl")))
            cache = feature_cache.existing_superset(data_dir, layers) or feature_cache.cache_dir(data_dir, layers)
            if len(list(cache.glob("shard-*.safetensors"))) == shards:
                log.info("training from the feature cache: target %s loaded with its embedding and lm_head only",
                         target.name)
                return target
        return recipe.target.load(accelerator.device)
