"""The shards a data run leaves in DATA_DIR/shards: one JSONL file per finished batch (and the parts of
a shard written at a time cap), read back by training, the feature cache and the space estimates."""
from __future__ import annotations

import json
from pathlib import Path

from .sources import DataError


def read_shard(path: Path) -> list[dict]:
    """The records of one finished shard; a damaged file is an error that names it and the fix."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    records.append(json.loads(line))
                    if not {"input_ids", "loss_mask"} <= set(records[-1]):
                        raise ValueError("a record without input_ids or loss_mask")
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"damaged data shard {path} (line {number}: {err}): delete it and run the same "
                                "command again; that shard is made again and the others are kept") from None
    return records



def shard_paths(data_dir: Path) -> list[Path]:
    return sorted((Path(data_dir) / "shards").glob("shard-*.jsonl"))


def shard_parts(out_dir: Path, index: int) -> list[Path]:
    """Parts of shard `index` written at a time cap (`shard-00003.part0.jsonl`, ...): each holds finished
    conversations of the shard; the shard itself, written later, holds the rest."""
    return sorted((Path(out_dir) / "shards").glob(f"shard-{index:05d}.part*.jsonl"))
