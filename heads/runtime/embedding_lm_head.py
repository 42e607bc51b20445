"""A target without its decoder layers: the embedding and the output head, read straight from the
safetensors files, for work that never runs the target's layers.

Training from the feature cache reads cached hidden states and needs the target only to turn the
final ones into logits (`lm_head`) and, for EAGLE-3, to embed tokens.  An export needs the same two
matrices.  Loading the whole model for that costs its full size in every process; here the model
is built on the meta device and only those two tensors are read and materialised.

The identity is the one `Target.load` computes: `weights_sha256` from the two matrices, and
`layers_sha256` from the same 256 evenly strided values of every parameter, read row by row from
the files (a few hundred small reads per tensor, never a whole layer).  A model whose files do not
name every parameter as the model does (a key mapping, remote code) is not loaded this way: the
caller falls back to `Target.load`.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from draftsmith.heads.runtime.identity import TargetIdentity, text_config, weights_hash

log = logging.getLogger(__name__)


def weight_files(model_dir: Path) -> dict[str, Path] | None:
    """{tensor name: safetensors file} of a model directory, or None if it holds no safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return {k: model_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    single = model_dir / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return {k: single for k in f.keys()}
    return None


def _sampled_values(handle, name: str, shape: tuple[int, ...], samples: int = 256) -> torch.Tensor:
    """flat[::max(1, numel // samples)][:samples] of a stored tensor, reading only the rows it touches."""
    numel = 1
    for s in shape:
        numel *= s
    step = max(1, numel // samples)
    flat_index = torch.arange(0, numel, step)[:samples]
    stored = handle.get_slice(name)
    if len(shape) <= 1:
        return stored[:].reshape(-1)[flat_index]
    row_size = numel // shape[0]
    rows = (flat_index // row_size).tolist()
    values, cached = [], {}
    for i, row in zip(flat_index.tolist(), rows):
        if row not in cached:
            cached = {row: stored[row:row + 1].reshape(-1)}       # rows come in order: keep the last one only
        values.append(cached[row][i - row * row_size])
    return torch.stack(values)


class Loaded(NamedTuple):
    """A causal LM built on the meta device but for its embedding and lm_head, with what Target needs."""

    model: nn.Module
    tokenizer: object
    identity: TargetIdentity


def load_embedding_and_lm_head(model_dir: Path, name: str, dtype: torch.dtype, device: torch.device,
                               trust_remote_code: bool = False) -> Loaded | None:
    """The model with only its embedding and lm_head in memory (the rest on the meta device), its tokenizer
    and identity; or None when its files do not allow it (then load the whole target)."""
    files = weight_files(Path(model_dir))
    if files is None:
        return None
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=dtype)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    params = list(model.named_parameters())                 # the order (and tied-weight dedup) of parameters()
    if any(n not in files for n, _ in params) or head is None:
        log.info("target %s: its files do not name every parameter as the model does; loading it whole", name)
        return None
    handles = {path: safe_open(str(path), "pt") for path in set(files.values())}
    digest = hashlib.sha256()
    for param_name, p in params:
        picked = _sampled_values(handles[files[param_name]], param_name, tuple(p.shape))
        digest.update(picked.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    names = {id(p): n for n, p in params}
    tied = head.weight is embed.weight
    for module in (embed,) if tied else (embed, head):
        stored = handles[files[names[id(module.weight)]]].get_tensor(names[id(module.weight)])
        module.weight = nn.Parameter(stored.to(device=device, dtype=dtype), requires_grad=False)
    if tied:
        head.weight = embed.weight
    if (Path(model_dir) / "generation_config.json").is_file():     # its end-of-turn ids, as from_pretrained reads them
        model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code, local_files_only=True)
    text = text_config(model)
    identity = TargetIdentity(
        name=name, model_type=str(text.model_type), vocab_size=int(head.weight.shape[0]),
        hidden_size=int(text.hidden_size), num_layers=int(text.num_hidden_layers),
        weights_sha256=weights_hash(embed.weight, head.weight), layers_sha256=digest.hexdigest()[:16])
    return Loaded(model, tokenizer, identity)
