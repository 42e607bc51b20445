"""Tensor names in each format, derived from the drafter's own declared layout.

A drafter declares the tensors it saves once, `parameter_layout(config)` (heads/medusa.py,
heads/eagle3.py), with their shapes.  A format here is only a list of renaming rules over those
names.  Writers map ours -> theirs with `names(config, fmt)`; importers invert the same map, so the
two directions cannot drift apart, and a new drafter or format is a layout plus a few rules.

The draft vocabulary (`draft_to_target`) is left out: each format stores it its own way (vLLM's
Medusa `token_map`, EAGLE-3's `d2t`/`t2d`), and the writers and importers convert it.
"""
from __future__ import annotations

import re

from draftsmith.heads.drafter import registry

VOCABULARY = "draft_to_target"

# (kind, format) -> [(pattern over draftsmith's name, replacement)], applied in order.
# {num_layers}: the Medusa residual layers per head (FasterDecoding puts each head's projection after them).
RULES: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("medusa", "vllm"): [(r"^blocks\.(\d+)\.(\d+)\.linear\.", r"blocks.\1.layers.\2.")],
    ("medusa", "medusa-original"): [(r"^blocks\.(\d+)\.(\d+)\.linear\.", r"\1.\2.linear."),
                                    (r"^lm_heads\.(\d+)\.weight$", r"\1.{num_layers}.weight")],
    ("eagle3", "vllm"): [],
    ("eagle3", "sglang"): [],
    ("eagle3", "trtllm"): [],
    ("eagle3", "eagle"): [],
    ("eagle3", "speculators"): [(r"^midlayer\.", "layers.0.")],
}


def layout(config: dict) -> dict[str, tuple[int, ...]]:
    """What a checkpoint of this config holds: name -> shape, as its drafter class declares it."""
    kinds = registry()
    if config["kind"] not in kinds:
        raise ValueError(f"unknown drafter kind '{config['kind']}'; known: {', '.join(sorted(kinds))}")
    return kinds[config["kind"]].parameter_layout(config)


def names(config: dict, fmt: str) -> dict[str, str]:
    """draftsmith's tensor name -> the format's, for every tensor but the vocabulary map."""
    key = (config["kind"], fmt)
    if key not in RULES:
        raise ValueError(f"no {fmt} layout for a {config['kind']} drafter")
    fields = {"num_layers": config["drafter"].get("num_layers")}
    out = {}
    for name in layout(config):
        if name == VOCABULARY:
            continue
        theirs = name
        for pattern, replacement in RULES[key]:
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
