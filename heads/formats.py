"""What a drafter declares about the serving stacks' formats, and the little every format shares.

A drafter class lists its formats (`formats = (ExportFormat(...), ...)`, heads/contract.py).  Each
format is
- `rules`: renaming rules over the drafter's declared tensor names (`parameter_layout`), applied in
  order; writers map ours -> theirs with `names(config, fmt)` and readers invert the same map, so
  the two directions cannot drift apart;
- `write(config, weights, target, dtype, checkpoint) -> ({file: {name: tensor}}, {file: text | JSON})`;
- `serve(config) -> str`: the command that serves the export (THIS_DIR, TARGET_DIR);
- `read(export_config, weights, target, confirmed) -> drafter` and `recognizes(export_config)`:
  the import back (None: this format is written, not read);
- `needs_target(config)`: whether writing it reads the target's matrices (a carried lm_head);
- `method` and `refuses(config, version)`: how `bench --engine vllm` serves it, and why a stack version
  cannot.

The draft vocabulary (`draft_to_target`) is left out of the renaming: each format stores it its own
way (vLLM's Medusa `token_map`, EAGLE-3's `d2t`/`t2d`), and the writers and readers convert it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from draftsmith.heads.drafter import describe
from draftsmith.heads.registry import drafter_class, registry

VOCABULARY = "draft_to_target"


class ExportError(ValueError):
    """A checkpoint that cannot be written in the asked format."""


class ImportFormatError(ValueError):
    """An export that cannot be read as a draftsmith drafter for this target."""


def _never(config: dict) -> bool:
    return False


@dataclass(frozen=True)
class ExportFormat:
    name: str
    write: Callable | None                   # None: a format draftsmith reads and never writes
    serve: Callable[[dict], str] | None
    rules: tuple[tuple[str, str], ...] = ()
    read: Callable | None = None
    recognizes: Callable[[dict], bool] = _never
    needs_target: Callable[[dict], bool] = _never
    method: str = ""               # the stack's speculative method name (`bench --engine vllm` serves it)
    refuses: Callable[[dict, str], str | None] = lambda config, version: None   # why a stack version cannot
    weights_file: str = ""         # the one file a reader takes ("": every .safetensors of the export)
    parallel_drafting: bool = False  # vLLM's speculative_config needs parallel_drafting: true (P-EAGLE)
    whole_depth: bool = False        # the stack drafts every position the drafter has, whatever K it is given
    #                                  (vLLM's Medusa: one token per head), so it serves K = the drafter's depth only
    serving_k: Callable[[dict], int] | None = None   # the one num_speculative_tokens the stack must be given (DSpark:
    #                                  the block it was trained on); bench refuses another
    stitch: Callable | None = None   # stitch(tensors {file: {name: tensor}}, target_dir): put the drafter into
    #                                  the target `export --with-target` wrote (a layer the target itself carries)


def formats_of(kind: str) -> dict[str, ExportFormat]:
    """The formats a checkpoint of `kind` exports to, by name."""
    return {f.name: f for f in drafter_class(kind).formats}


def export_formats() -> list[str]:
    """Every format some registered drafter writes."""
    return sorted({f.name for cls in registry().values() for f in cls.formats if f.write is not None})


def import_formats() -> list[str]:
    """Every format some registered drafter reads back."""
    return sorted({f.name for cls in registry().values() for f in cls.formats if f.read is not None})


def layout(config: dict) -> dict[str, tuple[int, ...]]:
    """What a checkpoint of this config holds: name -> shape, as its drafter class declares it."""
    return drafter_class(config["kind"]).parameter_layout(config)


def names(config: dict, fmt: str) -> dict[str, str]:
    """draftsmith's tensor name -> the format's, for every tensor but the vocabulary map."""
    declared = formats_of(config["kind"])
    if fmt not in declared:
        raise ValueError(f"no {fmt} layout for a {config['kind']} drafter")
    fields = {"num_layers": config["drafter"].get("num_layers")}
    out = {}
    for name in layout(config):
        if name == VOCABULARY:
            continue
        theirs = name
        for pattern, replacement in declared[fmt].rules:
            theirs = re.sub(pattern, replacement.format(**fields), theirs)
        out[name] = theirs
    if len(set(out.values())) != len(out):
        raise AssertionError(f"the {fmt} rules map two {config['kind']} tensors to one name")
    return out


def check_shapes(weights: dict, expected: dict[str, tuple[int, ...]]) -> str | None:
    """What is wrong with `weights` against `expected` (name -> shape), or None."""
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    wrong = [f"{k}: {tuple(weights[k].shape)} != {tuple(expected[k])}" for k in sorted(set(expected) & set(weights))
             if tuple(weights[k].shape) != tuple(expected[k])]
    if missing or extra or wrong:
        return f"missing {missing[:6]}, extra {extra[:6]}, wrong shapes {wrong[:6]}"
    return None


def renamed(config: dict, weights: dict, fmt: str) -> dict:
    """The checkpoint's tensors under the format's names (the vocabulary map left out)."""
    return {theirs: weights[ours] for ours, theirs in names(config, fmt).items()}


def cast(tensors: dict, dtype: torch.dtype) -> dict:
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in tensors.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def rope_fields(rope_parameters: dict) -> dict:
    """The rope settings in every spelling a serving stack reads: `rope_parameters` (transformers 5),
    the legacy `rope_scaling` (the scaling alone, null for plain rope: what transformers 4, vLLM's older
    config readers and TensorRT-LLM read) and `rope_theta`.  transformers 5 prefers `rope_scaling` when a
    config has both, so the two are written from the same dict and cannot disagree."""
    rope = dict(rope_parameters)
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    plain = scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}
    return {"rope_parameters": rope, "rope_scaling": None if plain else scaling, "rope_theta": rope.get("rope_theta")}


README = """# {title}

Exported by draftsmith {version} from `{checkpoint}` (a {kind} drafter for `{target}`).

Serve it:

```bash
{command}
```

{notes}
"""


def readme(config: dict, checkpoint, title: str, command: str, notes: str = "") -> str:
    """The README.md every export carries: what it is, and the command that serves it."""
    return README.format(title=title, version=config.get("draftsmith_version", "?"), checkpoint=checkpoint,
                         kind=config["kind"], target=config["target"]["name"], command=command.strip(),
                         notes=notes.strip())


def output_convention(layer_ids: list[int], stack: str) -> list[int]:
    """SGLang and TensorRT-LLM read "output of layer i" = hidden_states[i + 1]: draftsmith's ids minus one."""
    if min(layer_ids) < 1:
        raise ExportError(f"{stack} names fused layers by the decoder layer whose OUTPUT it takes; layer id 0 "
                          "(the embeddings) has no such name. Retrain with drafter.layer_ids >= 1")
    return [i - 1 for i in layer_ids]


def fill(drafter, weights: dict, fmt: str, vocabulary: torch.Tensor, skip: set = frozenset()) -> None:
    """Load `weights` (the format's names) into `drafter` through the layout's renaming rules."""
    theirs_of = names(describe(drafter), fmt)
    state = {ours: weights[theirs] for ours, theirs in theirs_of.items() if theirs in weights}
    missing = sorted(theirs for theirs in theirs_of.values() if theirs not in weights)
    unknown = sorted(set(weights) - set(theirs_of.values()) - set(skip))
    own = drafter.state_dict()
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in state if state[k].shape != own[k].shape]
    if missing or unknown or wrong:
        raise ImportFormatError(f"the export does not fit a {drafter.kind} drafter for this target: missing "
                                f"{missing[:4]}, unexpected {unknown[:4]}, shapes {wrong[:4]}")
    drafter.load_state_dict({**state, VOCABULARY: vocabulary}, strict=True)
