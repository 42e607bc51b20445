"""EAGLE-1 / EAGLE-2 (arXiv 2401.15077, 2406.16858): feature-level drafting through the target's own head.

Input at position t: fc(cat(embed(token_{t+1}), f_t)), f_t the target's last
hidden state after its final norm (layer N), 2H -> H (no bias, as vLLM's
`EagleLlamaForCausalLM` loads it).  One Llama decoder layer without its input
norm and no final norm; its output is the predicted feature f_{t+1}, read out
by the target's frozen lm_head (restricted to a draft vocabulary if asked).
Loss (EAGLE-1, section 4.2): SmoothL1(predicted f_{t+1}, f_{t+1}) +
0.1 * CE(target distribution at t+1, drafter's), with U(-0.1, 0.1) noise on
the input features during training.  EAGLE-2 is this drafter with a dynamic
tree (heads/decoding/dynamic_tree.py).
Shape notation: b batch, s sequence, H hidden, v (draft) vocabulary.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.contract import DrafterBase
from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.draft_vocab import add_draft_vocabulary, set_draft_map
from draftsmith.heads.drafter import DraftContext, StepOutput, divide, term_denominators
from draftsmith.heads.eagle_decoding import EagleDecoding
from draftsmith.heads.eagle_layer import DraftLayer, Rotary, layer_layout, layer_shape_from_target
from draftsmith.heads.registry import register
from draftsmith.heads.runtime.target import Target
from draftsmith.heads.soft_loss import soft_cross_entropy


@dataclass
class EagleConfig:
    feature_weight: float = 1.0
    """Weight of the SmoothL1 feature-regression loss."""
    token_weight: float = 0.1
    """Weight of the cross-entropy against the target's distribution."""
    noise: float = 0.1
    """Uniform noise U(-noise, noise) on the input features while training."""
    draft_vocab_size: int | None = None
    """Score only this many most frequent reply tokens (rows of the target's lm_head); null = all."""
    tree: dict = field(default_factory=lambda: {"depth": 5, "top_k": 8, "total_tokens": 32})
    """Default dynamic tree (EAGLE-2) for decoding: depth, top_k, total_tokens."""
    init_from: str | None = None
    """Warm start: a draftsmith checkpoint of this kind for this target (e.g. one `draftsmith import`
    made from a published drafter) whose weights training starts from; null = a fresh drafter."""

    def __post_init__(self):
        if self.noise < 0 or self.feature_weight < 0 or self.token_weight < 0:
            raise ValueError(f"drafter noise and loss weights must be >= 0, got {self}")
        TreeSettings(**self.tree)


@register("eagle")
class Eagle(EagleDecoding, DrafterBase):
    title = "EAGLE-1 feature drafter"
    config_class = EagleConfig

    def __init__(self, config: EagleConfig, target: Target):
        super().__init__()
        self.config = config
        self.target = target
        self.target_identity = target.identity
        shape = layer_shape_from_target(target)
        self.shape = shape
        self._head = None                          # the target's head rows for the draft vocabulary, cached
        add_draft_vocabulary(self, config.draft_vocab_size or target.vocab_size, target.vocab_size)
        self.fc = nn.Linear(2 * shape.hidden_size, shape.hidden_size, bias=False)
        self.layer = DraftLayer(shape, fused=False)
        self.rotary = Rotary(shape)
        self.tree = TreeSettings(**config.tree)
        self.metadata: dict = {}

    @staticmethod
    def parameter_layout(config: dict) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every saved tensor, from a checkpoint's config.json alone."""
        shape, d = config["architecture"], config["target"]["hidden_size"]
        return {"fc.weight": (d, 2 * d), "draft_to_target": (shape["draft_vocab_size"],),
                **layer_layout(shape, fused=False, prefix="layer.")}

    def architecture(self) -> dict:
        """The draft layer's shape, so that a checkpoint's layout is known without the target."""
        return {**asdict(self.shape), "draft_vocab_size": int(self.draft_to_target.numel())}

    def enable_gradient_checkpointing(self) -> bool:
        """Each test-time step's draft layer is recomputed in backward (its MLP and attention
        activations, the largest part of a step, are not kept)."""
        self.gradient_checkpointing = True
        return True

    @property
    def required_layers(self) -> tuple[int, ...]:
        return (self.target.num_layers,)

    @property
    def draft_positions(self) -> int:
        return 1

    def set_draft_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        set_draft_map(self, draft_to_target)

    def vocabulary_changed(self) -> None:
        self._head = None

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """Predicted feature [..., H] -> [..., v] through the target's frozen head (draft rows only)."""
        weight = self.target.lm_head.weight.detach()
        if self._head is None or self._head.device != weight.device:
            full = self.draft_to_target.numel() == self.target.vocab_size
            self._head = weight if full else weight[self.draft_to_target.to(weight.device)]
        # computed where the head is (the last device of a spread target), the logits back on the feature's
        return F.linear(feature.to(self._head.device, self._head.dtype), self._head).to(feature.device)

    def _step(self, feature, tokens, positions, cache) -> torch.Tensor:
        """features [1, n, H], tokens [1, n] -> predicted next features [1, n, H]"""
        embeds = self.target.embed_tokens(tokens).to(self.fc.weight.dtype)
        hidden = self.fc(torch.cat([embeds, feature.to(self.fc.weight.dtype)], dim=-1))
        cos, sin = self.rotary(hidden, positions)
        return self.layer.cached(hidden, None, cos, sin, cache)

    def _context_hidden(self, context: DraftContext) -> torch.Tensor:
        return context.hidden[self.target.num_layers]

    def forward(self, batch: dict) -> StepOutput:
        """batch: input_ids, attention_mask, loss_mask [b, s], features {layer id: [b, s, H]} -> the training loss."""
        return self.loss(batch)

    def loss(self, batch: dict) -> StepOutput:
        """SmoothL1 on the next feature + 0.1 * soft CE on the next token, at positions whose token t+2 is a reply."""
        features = batch["features"][self.target.num_layers].to(self.fc.weight.dtype)     # [b, s, H]
        input_ids, attention = batch["input_ids"], batch["attention_mask"].bool()
        b, s, _ = features.shape
        noisy = features + (torch.rand_like(features) * 2 - 1) * self.config.noise if self.training else features
        tokens = F.pad(input_ids[:, 1:], (0, 1))                                        # token t+1 at t
        hidden = self.fc(torch.cat([self.target.embed_tokens(tokens).to(features.dtype), noisy], dim=-1))
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        cos, sin = self.rotary(hidden, positions)
        predicted = self.layer.ttt(hidden, None, cos, sin, [], attention,               # [b, s, H]
                                   checkpointed=self.gradient_checkpointing and self.training)
        scored = self._scored(batch)                                                    # token t+2 is a reply
        denominator = term_denominators(batch, self.loss_counts(batch))[0]
        count = scored.sum().float()[None]
        scored = scored.nonzero(as_tuple=True)          # the micro-batch's one host wait (docs/scale.md)
        wanted = F.pad(features[:, 1:], (0, 0, 0, 1))[scored]                           # f_{t+1}
        mine = predicted[scored]
        feature_loss = divide(F.smooth_l1_loss(mine.float(), wanted.float(), reduction="sum") / mine.shape[-1],
                              denominator)                                              # mean over positions and dims
        with torch.no_grad():
            target_probs = torch.softmax(self.logits(wanted).float(), dim=-1)
        per_position, guess = soft_cross_entropy(self.logits(mine), target_probs)
        token_loss = divide(per_position.sum(), denominator)
        loss = self.config.feature_weight * feature_loss + self.config.token_weight * token_loss
        correct = (guess == target_probs.argmax(-1)).sum().float()[None]
        return StepOutput(loss=loss, correct=correct, counted=count)

    @staticmethod
    def _scored(batch: dict) -> torch.Tensor:
        return F.pad(batch["loss_mask"][:, 2:], (0, 2)).bool() & batch["attention_mask"].bool()

    def loss_counts(self, batch: dict) -> torch.Tensor:
        """[1]: the positions both terms (next feature, next token) average over."""
        return self._scored(batch).sum().float()[None]
