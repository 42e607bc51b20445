"""The drafter contract: what train/, eval/ and export/ call on a drafter, written down once.

`DrafterContract` (a typing.Protocol) lists every member; `DrafterBase` (the nn.Module each drafter
derives from) gives the optional ones their defaults, so callers call them instead of asking
`hasattr` first.  A new drafter derives from `DrafterBase`, registers itself (`@register("kind")`,
heads/registry.py), sets `title`, `config_class` and, to be exported, `formats` (heads/formats.py),
and writes the members marked "must" below (docs/adding-a-drafter.md walks through it);
tests/test_contract.py checks each registered drafter against this file.

`Proposer` is the smaller contract the verifier needs (anything that drafts: a drafter, the
context-lookup wrapper, a test's fixed proposer).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Proposer(Protocol):
    """What the verifier (heads/decoding/verifier.py) calls while decoding."""

    @property
    def required_layers(self) -> tuple[int, ...]:
        """Target layer ids (hidden_states[i], docs/design.md) whose states `propose` reads."""

    def reset(self) -> None:
        """Forget the previous request (caches, lookup tables)."""

    def propose(self, context) -> Any:
        """A DraftTree after the target's last forward (`context`: heads.drafter.DraftContext)."""

    def observe(self, path: list[int]) -> None:
        """The node indices the target accepted from the last proposal (no-op unless the drafter learns)."""


@runtime_checkable
class DrafterContract(Proposer, Protocol):
    """Everything else train/, eval/ and export/ use.  Must: kind, title, config_class, config, target,
    target_identity, metadata, tree, draft_positions, parameter_layout, loss, loss_counts,
    set_draft_vocabulary, set_proposal; the rest has a default in DrafterBase."""

    kind: ClassVar[str]                  # set by @register (heads/registry.py)
    config_class: ClassVar[type]
    title: ClassVar[str]                 # what the model card calls it ("EAGLE-3 drafter")
    formats: ClassVar[tuple]             # the serving formats it exports to and imports from (heads/formats.py)
    checkpoint_kind: str                 # the kind a checkpoint records (Medusa-2's heads load as Medusa)
    trains_target_adapter: bool          # True: a LoRA on the target trains with the drafter (Medusa-2)
    static_tree: bool                    # True: decodes with fixed tree shapes that default_tree builds (Medusa)
    dynamic_tree: bool                   # True: decodes dynamic trees (EAGLE-2) from config.tree, tuned by eval
    data_is_target_greedy: bool          # set by the loop: every reply token is the target's greedy choice
    metadata: dict
    draft_positions: int                 # positions scored per training step (heads, unrolled steps)

    @staticmethod
    def parameter_layout(config: dict) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every saved tensor, from a checkpoint's config.json alone."""

    def fused_layer_ids(self) -> list[int]:
        """The target layer ids a checkpoint records (and exports write)."""

    def architecture(self) -> dict:
        """Shape fields an export needs without the target ({} when the drafter config says it all)."""

    def loss(self, batch: dict) -> Any:
        """A StepOutput (heads.drafter) for one micro-batch."""

    def loss_counts(self, batch: dict) -> torch.Tensor:
        """Tokens each loss term averages over, from the batch's masks alone."""

    def param_groups(self, lr: float) -> list[dict]:
        """The optimizer's parameter groups."""

    def attach_backbone(self) -> None:
        """Make the target's trainable part (a LoRA) ready before training; no-op for frozen targets."""

    def save_adapter(self, directory: Path) -> str | None:
        """Write the trained target adapter beside the checkpoint; its sha256, or None if there is none."""

    def load_adapter(self, directory: Path) -> None:
        """Restore that adapter when resuming."""

    def topk_hits(self, batch: dict | None, top: int = 10) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-position top-k hit counts for calibrating static trees; None for drafters without them."""

    def set_draft_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """Score only these target ids (ascending)."""

    def vocabulary_changed(self) -> None:
        """Drop what was cached from the previous draft vocabulary (heads/draft_vocab.py calls it)."""

    def set_proposal(self, chain: int | None = None, **shape) -> None:
        """Decode with a chain of `chain` tokens, or a tree."""

    def default_tree(self, size: int) -> Any:
        """A static tree of `size` nodes (static_tree drafters only)."""

    def describe_proposal(self) -> str:
        """The proposal shape set now, in words for reports ("chain of 3", "dynamic tree (...)")."""


class DrafterBase(nn.Module):
    """The defaults of the contract's optional members."""

    kind: ClassVar[str]
    config_class: ClassVar[type]
    formats: ClassVar[tuple] = ()                      # none: served by draftsmith's own engine only
    checkpoint_marker: ClassVar[str | None] = None     # a config.json key that tells this class's checkpoints apart
    checkpoint_files: ClassVar[tuple[str, ...]] = ()   # files it writes beside its weights (pushed with them)
    trains_target_adapter: ClassVar[bool] = False
    warm_starts_from: ClassVar[tuple[str, ...]] = ()   # other kinds drafter.init_from may name (P-EAGLE: eagle3)
    new_on_warm_start: ClassVar[tuple[str, ...]] = ()  # tensors such a checkpoint lacks, kept at their fresh start
    static_tree: ClassVar[bool] = False
    dynamic_tree: ClassVar[bool] = False           # neither: it drafts a chain (set_proposal(chain=...))
    one_forward: ClassVar[bool] = False            # a proposal of any depth is one drafter forward (P-EAGLE, DFlash)
    data_is_target_greedy = False
    gradient_checkpointing = False

    def forward(self, batch: dict):
        """What training calls through the wrapped module (DDP, FSDP, DeepSpeed): the loss."""
        return self.loss(batch)

    def enable_gradient_checkpointing(self) -> bool:
        """Recompute activations in backward instead of keeping them (train.gradient_checkpointing);
        False: this drafter keeps too little for it to matter, and nothing changes."""
        return False

    @property
    def checkpoint_kind(self) -> str:
        return self.kind

    def fused_layer_ids(self) -> list[int]:
        return list(self.required_layers)

    def architecture(self) -> dict:
        return {}

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": [p for p in self.parameters() if p.requires_grad]}]

    def attach_backbone(self) -> None:
        return None

    def save_adapter(self, directory: Path) -> str | None:
        return None

    def load_adapter(self, directory: Path) -> None:
        return None

    def topk_hits(self, batch: dict | None, top: int = 10):
        return None

    def observe(self, path: list[int]) -> None:
        return None

    def vocabulary_changed(self) -> None:
        return None

    def describe_proposal(self) -> str:
        return f"chain of {self.draft_positions}"

    def default_tree(self, size: int):
        raise NotImplementedError(f"a {self.kind} drafter has no static trees (static_tree is False)")
