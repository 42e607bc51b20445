"""Medusa heads (FasterDecoding/Medusa, arXiv 2401.10774).

K heads read the target's final hidden state h_t.  The target's own lm_head
predicts token t+1; head k (k = 0..K-1) predicts token t+2+k.  A head is
`num_layers` residual blocks x + SiLU(W x + b), W zero-initialised so the
head starts as the target's own next-token predictor shifted by k+1, then
a vocabulary projection: the target's frozen lm_head ("shared") or a
trainable copy of it per head ("own").  Every block is its own module (the
upstream `[Block(H)] * n` shares one module n times).

With `draft_vocab_size` the projection scores only the most frequent tokens
of the training replies (see heads/draft_vocab.py; vLLM's `token_map`).  On a small
target the projection is most of a head's cost, in training and decoding.

Shape notation: b batch, s sequence, d hidden, v draft vocabulary, k heads,
m selected positions, r candidates per head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.contract import DrafterBase
from draftsmith.heads.decoding.tree import DraftTree, TreeShape
from draftsmith.heads.draft_vocab import add_draft_vocabulary, set_draft_map
from draftsmith.heads.drafter import DraftContext, StepOutput, divide, term_denominators
from draftsmith.heads.formats import ExportFormat, ImportFormatError, fill
from draftsmith.heads.medusa_layout import (serve_original, serve_vllm, shared_head, vllm_refuses, write_original,
                                            write_vllm)
from draftsmith.heads.registry import register
from draftsmith.heads.runtime.cpu_linear import PackedLinear
from draftsmith.heads.runtime.target import Target
from draftsmith.heads.soft_loss import hard_cross_entropy

CONDITIONING = ("none", "root", "path")


@dataclass
class MedusaConfig:
    num_heads: int = 4
    """Draft positions: head k predicts the token k+2 places after the current one."""
    num_layers: int = 1
    """Residual blocks per head (1 in every published recipe)."""
    lm_head: str = "shared"
    """'shared': all heads use the target's frozen lm_head; 'own': each head trains a copy of it."""
    draft_vocab_size: int | None = None
    """Score only this many most frequent reply tokens; null = the target's whole vocabulary."""
    loss_decay: float = 0.8
    """Head k's loss weight is loss_decay ** k (Medusa paper)."""
    labels: str = "target"
    """'target': the target's own greedy next tokens (self-distillation); 'data': the tokens in the data."""
    conditioning: str = "none"
    """What the heads read besides h_t.  'none': nothing (Medusa).  'root': the embedding of the token the
    target just chose (the root, token t+1), so head k predicts token t+2+k knowing it.  'path': head k
    also reads the tokens drafted before it on its tree path (t+2 .. t+1+k), as Hydra's sequentially
    dependent heads do (arXiv 2402.05109); the tree is then drafted one level at a time.  Each token
    enters through a d x d projection per offset that starts at zero, so training starts from plain
    Medusa.  vLLM's and FasterDecoding's Medusa formats hold neither: such heads do not export there."""
    init_from: str | None = None
    """Warm start: a draftsmith checkpoint of this kind for this target (e.g. one `draftsmith import`
    made from a published drafter) whose weights training starts from; null = a fresh drafter."""

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"medusa needs num_heads >= 1 and num_layers >= 1, got {self.num_heads}, {self.num_layers}")
        if self.num_heads > MAX_HEADS or self.num_layers > MAX_HEADS:
            raise ValueError(f"drafter.num_heads and drafter.num_layers are at most {MAX_HEADS} (a head per position "
                             f"drafted; Medusa uses 4-5, each with 1 layer), got {self.num_heads} and {self.num_layers}")
        if self.lm_head not in ("shared", "own"):
            raise ValueError(f"drafter.lm_head must be 'shared' or 'own', got '{self.lm_head}'")
        if self.conditioning not in CONDITIONING:
            raise ValueError(f"drafter.conditioning must be one of {', '.join(CONDITIONING)}, got '{self.conditioning}'")
        if self.labels not in ("target", "data"):
            raise ValueError(f"drafter.labels must be 'target' or 'data', got '{self.labels}'")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"drafter.draft_vocab_size must be >= 1 or null, got {self.draft_vocab_size}")


MAX_HEADS = 64      # far past any useful depth: the acceptance of head k falls off geometrically


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)   # starts as the identity (the bias keeps its default init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., d] -> [..., d]"""
        return x + F.silu(self.linear(x))


@register("medusa")
class Medusa(DrafterBase):
    title = "Medusa heads"
    static_tree = True            # decodes with fixed trees (default_tree), calibrated in training
    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig, target: Target):
        super().__init__()
        self.config = config
        self.target = target                       # not a submodule: never trained, never saved
        self.target_identity = target.identity
        self.data_is_target_greedy = False
        """Set by training when every reply token in the data is the target's own greedy choice (greedy
        regeneration): labels='target' then reads them from the data instead of recomputing the target's
        argmax over its whole vocabulary at every position (the data's token is the exact one; the cached
        bf16 features can flip a near-tie)."""
        d = target.hidden_size
        self._shared_weight = None                 # caches built from the draft vocabulary (vocabulary_changed)
        self.__dict__["_packed_head"] = None       # outside the module tree: never in the state dict
        add_draft_vocabulary(self, config.draft_vocab_size or target.vocab_size, target.vocab_size)
        vocab = self.draft_to_target.numel()
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResidualBlock(d) for _ in range(config.num_layers)]) for _ in range(config.num_heads))
        offsets = {"none": 0, "root": 1, "path": config.num_heads}[config.conditioning]
        self.token_proj = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(offsets))
        for proj in self.token_proj:
            nn.init.zeros_(proj.weight)               # starts as plain Medusa
        if config.lm_head == "own":
            self.lm_heads = nn.ModuleList(nn.Linear(d, vocab, bias=False) for _ in range(config.num_heads))
        self.set_draft_vocabulary(self.draft_to_target)
        self.tree = TreeShape.chain(config.num_heads)
        self.metadata: dict = {}

    @staticmethod
    def parameter_layout(config: dict) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every saved tensor, from a checkpoint's config.json alone."""
        arch, d = config["drafter"], config["target"]["hidden_size"]
        heads, draft = arch["num_heads"], arch.get("draft_vocab_size") or config["target"]["vocab_size"]
        layout: dict[str, tuple[int, ...]] = {"draft_to_target": (draft,)}
        for h in range(heads):
            for l in range(arch["num_layers"]):
                layout |= {f"blocks.{h}.{l}.linear.weight": (d, d), f"blocks.{h}.{l}.linear.bias": (d,)}
            if arch["lm_head"] == "own":
                layout[f"lm_heads.{h}.weight"] = (draft, d)
        offsets = {"root": 1, "path": heads}.get(arch.get("conditioning", "none"), 0)
        return layout | {f"token_proj.{j}.weight": (d, d) for j in range(offsets)}

    @property
    def required_layers(self) -> tuple[int, ...]:
        return (self.target.num_layers,)

    @property
    def draft_positions(self) -> int:
        return len(self.blocks)

    def forward(self, batch: dict) -> StepOutput:
        return self.loss(batch)

    def set_draft_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """Choose the scored tokens (ascending target ids); own heads restart from the target's rows."""
        set_draft_map(self, draft_to_target)
        if self.config.lm_head == "own":
            rows = self.target.lm_head.weight.detach()[self.draft_to_target].float()
            for head in self.lm_heads:
                head.weight.data.copy_(rows)

    def vocabulary_changed(self) -> None:
        self._shared_weight = None
        self.__dict__["_packed_head"] = None

    def _projection(self, head: int) -> torch.Tensor:
        """Vocabulary projection of head `head`: [v, d]."""
        if self.config.lm_head == "own":
            return self.lm_heads[head].weight
        if self._shared_weight is None:
            weight = self.target.lm_head.weight.detach()
            full = self.draft_to_target.numel() == self.target.vocab_size
            self._shared_weight = weight if full else weight[self.draft_to_target]
        return self._shared_weight

    def _decoding_head(self):
        """Beside a CPU target with packed fp16 weights, the shared projection packed the same way, for
        decoding (k heads x 1 position is a small block: heads/runtime/cpu_linear.py); else None."""
        if (self.config.lm_head != "shared" or torch.is_grad_enabled()
                or not isinstance(self.target.lm_head, PackedLinear)):
            return None
        if self.__dict__.get("_packed_head") is None:
            weight = self._projection(0)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight = nn.Parameter(weight, requires_grad=False)
            self.__dict__["_packed_head"] = PackedLinear(linear)
        return self.__dict__["_packed_head"]

    def _project(self, states: torch.Tensor, head: int = 0) -> torch.Tensor:
        """[..., d] outputs of head `head` (of every head, for a shared lm_head) -> [..., v] draft logits."""
        if self.config.lm_head == "own":
            return self.lm_heads[head](states)      # called as a module: ZeRO-3 gathers its weight for the call
        packed = self._decoding_head()
        if packed is not None:
            return packed(states)
        weight = self._projection(0)                 # the target's head: the last device of a spread target
        return torch.matmul(states.to(weight.device, weight.dtype), weight.t()).to(states.device)

    def _inputs(self, hidden: torch.Tensor, following: torch.Tensor | None) -> torch.Tensor:
        """[k, m, d]: head k's input, h_t plus the projected embeddings of the tokens it is conditioned on
        (following [m, >= offsets]: tokens t+1, t+2, ... after each position)."""
        k_heads, offsets = len(self.blocks), len(self.token_proj)
        if not offsets:
            return hidden.expand(k_heads, *hidden.shape)
        if following is None:
            raise ValueError(f"'{self.config.conditioning}'-conditioned heads need the tokens after every position")
        embedded = self.target.embed_tokens(following[:, :offsets]).detach().to(hidden.dtype)     # [m, J, d]
        terms = torch.stack([proj(embedded[:, j]) for j, proj in enumerate(self.token_proj)])     # [J, m, d]
        return (hidden + terms.cumsum(0))[torch.arange(k_heads, device=hidden.device).clamp(max=offsets - 1)]

    def head_logits(self, hidden: torch.Tensor, following: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [m, d] final target hidden states, following: [m, k] the tokens after each (conditioned
        heads only; teacher-forced) -> [k, m, v] draft-vocabulary logits."""
        hidden = hidden.to(self.blocks[0][0].linear.weight.dtype)
        inputs = self._inputs(hidden, following)                                         # [k, m, d]
        states = torch.stack([block(x) for block, x in zip(self.blocks, inputs)])         # [k, m, d]
        if self.config.lm_head == "shared":
            return self._project(states)                                                 # one weight read for all heads
        return torch.stack([self._project(states[k], k) for k in range(len(self.blocks))])

    # -- training ----------------------------------------------------------------
    def _next_tokens(self, batch: dict) -> torch.Tensor:
        """[b, s] the token that follows each position: the target's greedy choice, or the data's."""
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        following = F.pad(input_ids[:, 1:], (0, 1))
        if self.config.labels == "data" or self.data_is_target_greedy:
            return following
        hidden = batch["features"][self.target.num_layers]
        needed = F.pad(loss_mask[:, 1:], (0, 1)).bool()           # positions whose next token is trained on
        chosen = following.clone()
        with torch.no_grad():
            needed = needed.nonzero(as_tuple=True)                    # a host wait (docs/scale.md)
            rows = hidden[needed]                                     # [m, d]
            # max(-1).indices: argmax (the first of tied maxima) at a quarter of its time on bf16 logits
            picks = [self.target.compute_logits(chunk).max(-1).indices for chunk in rows.split(2048)]
            chosen[needed] = torch.cat(picks) if picks else chosen[needed]
        return chosen

    def _following(self, next_tokens: torch.Tensor, span: int) -> torch.Tensor:
        """[b, span, k]: the k tokens after each position (next_tokens [b, >= span + k]: the token after each)."""
        return torch.stack([next_tokens[:, j: j + span] for j in range(len(self.blocks))], dim=-1)

    def _label_masks(self, loss_mask: torch.Tensor):
        """selected: the (row, position) index of the m positions whose head 0 has a label (token t+2 is a
        reply token), and valid(k) [m]: which of those head k scores (token t+2+k is one too).  Index
        tensors, not a boolean mask: the one nonzero here is the micro-batch's one host wait (docs/scale.md)."""
        k_heads = len(self.blocks)
        span = loss_mask.shape[1] - 2
        selected = loss_mask[:, 2:].nonzero(as_tuple=True)
        label_mask = F.pad(loss_mask, (0, k_heads + 2))
        return selected, lambda k: label_mask[:, 2 + k: 2 + k + span][selected]

    def loss_counts(self, batch: dict) -> torch.Tensor:
        """[k]: the tokens head k's cross-entropy averages over (from the loss mask alone)."""
        return self._head_counts(batch)

    def _head_counts(self, batch: dict) -> torch.Tensor:
        """[k]: the positions head k scores, counted on the masks (no host wait)."""
        loss_mask = batch["loss_mask"].bool()
        span = loss_mask.shape[1] - 2
        label_mask = F.pad(loss_mask, (0, len(self.blocks) + 2))
        return torch.stack([(loss_mask[:, 2:] & label_mask[:, 2 + k: 2 + k + span]).sum()
                            for k in range(len(self.blocks))]).float()

    def loss(self, batch: dict) -> StepOutput:
        """Medusa-1 loss: sum_k decay^k * CE(head k at t, token t+2+k) over assistant tokens."""
        hidden = batch["features"][self.target.num_layers]          # [b, s, d]
        k_heads = len(self.blocks)
        span = hidden.shape[1] - 2
        next_tokens = F.pad(self._next_tokens(batch), (0, k_heads + 2))          # [b, s + k + 2]
        selected, valid_for = self._label_masks(batch["loss_mask"].bool())      # ([m], [m]) head 0 has a label
        states = hidden[:, :span][selected]                                      # [m, d]
        logits = self.head_logits(states, self._following(next_tokens, span)[selected])   # [k, m, v]
        total = hidden.new_zeros((), dtype=torch.float32)
        correct = torch.zeros(k_heads, device=hidden.device)
        counted = self._head_counts(batch)                                       # [k] this micro-batch's
        denominators = term_denominators(batch, counted)                         # [k] the step's, in training
        for k in range(k_heads):
            labels = next_tokens[:, 1 + k: 1 + k + span][selected]             # target ids, [m]
            draft_labels = self.target_to_draft[labels]
            scored = valid_for(k) & (draft_labels >= 0)
            # fused, in row chunks (heads/soft_loss.py): no fp32 [m, v] copy of a head's logits is kept.
            # Computed even when nothing is scored: the loss stays connected to every weight (a process
            # whose slice of the step holds no reply token still takes part in the gradient exchange)
            per_row, guess = hard_cross_entropy(logits[k], draft_labels.clamp(min=0), scored)
            total = total + (self.config.loss_decay ** k) * divide(per_row.sum(), denominators[k])
            correct[k] = ((guess == draft_labels) & scored).sum()
        return StepOutput(loss=total, correct=correct, counted=counted)

    @torch.no_grad()
    def topk_hits(self, batch: dict | None, top: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out calibration for trees: hits [k, top] (rank-r candidate of head k was right), counted [k].

        Without a batch (a process whose share of the held-out set is empty) both are zeros, so every
        process takes part in the sum across processes."""
        if batch is None:
            return torch.zeros(len(self.blocks), min(top, len(self.draft_to_target))), torch.zeros(len(self.blocks))
        hidden = batch["features"][self.target.num_layers]
        loss_mask = batch["loss_mask"].bool()
        k_heads = len(self.blocks)
        s = hidden.shape[1]
        next_tokens = F.pad(self._next_tokens(batch), (0, k_heads + 2))
        label_mask = F.pad(loss_mask, (0, k_heads + 2))
        selected = loss_mask[:, 2:]
        logits = self.head_logits(hidden[:, : s - 2][selected], self._following(next_tokens, s - 2)[selected])
        ranked = logits.topk(min(top, logits.shape[-1]), dim=-1).indices                # [k, m, top]
        hits = torch.zeros(k_heads, ranked.shape[-1])
        counted = torch.zeros(k_heads)
        for k in range(k_heads):
            labels = self.target_to_draft[next_tokens[:, 1 + k: 1 + k + s - 2][selected]]
            valid = label_mask[:, 2 + k: 2 + k + s - 2][selected]
            hits[k] = ((ranked[k] == labels[:, None]) & valid[:, None]).sum(0).float().cpu()
            counted[k] = valid.sum().float().cpu()
        return hits, counted

    # -- decoding ----------------------------------------------------------------
    def set_proposal(self, chain: int | None = None, tree: TreeShape | None = None) -> None:
        """Propose a chain of `chain` tokens, or the given static tree (depth <= num_heads)."""
        shape = tree if tree is not None else TreeShape.chain(chain or len(self.blocks))
        if shape.max_depth > len(self.blocks):
            raise ValueError(f"a Medusa drafter with {len(self.blocks)} heads proposes at most {len(self.blocks)} "
                             f"tokens deep; asked for depth {shape.max_depth}")
        self.tree = shape

    def describe_proposal(self) -> str:
        if self.tree.size == self.tree.max_depth:
            return f"chain of {self.tree.size}"
        return f"static tree of {self.tree.size} (depth {self.tree.max_depth})"

    def default_tree(self, size: int) -> TreeShape:
        """The sparse tree of `size` nodes with the best expected acceptance, from held-out top-k rates."""
        rates = self.metadata.get("topk_accuracy")
        if not rates:
            # no calibration: a guess that decays with depth and rank
            rates = [[0.6 ** (k + 1) / (r + 1) for r in range(10)] for k in range(len(self.blocks))]
        return TreeShape.best(rates, size)

    def reset(self) -> None:
        pass   # Medusa keeps no state between steps

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        hidden = context.hidden[self.target.num_layers][-1:]                   # [1, d] at the last committed token
        root = torch.tensor([[context.next_token]], device=hidden.device)
        if self.config.conditioning == "path":
            return self._propose_by_level(hidden, root)
        logits = self.head_logits(hidden, root)[:, 0]                           # [k, v]
        candidates = logits.topk(self.tree.max_rank, dim=-1).indices            # [k, r]
        candidates = self.draft_to_target[candidates]
        tokens = candidates[self.tree.depths - 1, self.tree.ranks]              # [n]
        return DraftTree(tokens=tokens, parents=self.tree.parents)

    def _propose_by_level(self, hidden: torch.Tensor, root: torch.Tensor) -> DraftTree:
        """Path-conditioned heads: head L drafts the children of every depth-L node (the root is depth 0)
        from h_t plus the projected embeddings of the tokens on the node's path."""
        shape, dtype = self.tree, self.blocks[0][0].linear.weight.dtype
        embed = self.target.embed_tokens
        tokens = torch.zeros(shape.size, dtype=torch.long, device=hidden.device)
        inputs = {-1: hidden[0].to(dtype) + self.token_proj[0](embed(root[0]).to(dtype))[0]}   # node -> [d]
        for depth in range(1, shape.max_depth + 1):
            nodes = (shape.depths == depth).nonzero().flatten().tolist()
            parents = sorted({int(shape.parents[n]) for n in nodes})
            states = self.blocks[depth - 1](torch.stack([inputs[p] for p in parents]))          # [m, d]
            ranks = int(shape.ranks[nodes].max()) + 1
            ranked = self.draft_to_target[self._project(states, depth - 1).topk(ranks, dim=-1).indices]  # [m, r]
            row = {p: i for i, p in enumerate(parents)}
            for n in nodes:
                tokens[n] = ranked[row[int(shape.parents[n])], int(shape.ranks[n])]
            if depth < shape.max_depth:
                added = self.token_proj[depth](embed(tokens[nodes]).to(dtype))                  # [len(nodes), d]
                inputs.update({n: inputs[int(shape.parents[n])] + added[i] for i, n in enumerate(nodes)})
        return DraftTree(tokens=tokens, parents=shape.parents)


# -- serving formats (heads/formats.py): vLLM's Medusa and FasterDecoding's, written by heads/medusa_layout.py

def _read_original(config: dict, weights: dict, target: Target, confirmed: bool = False):
    heads, layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    drafter = Medusa(MedusaConfig(num_heads=heads, num_layers=layers, lm_head="own"), target)
    fill(drafter, weights, "medusa-original", torch.arange(target.vocab_size))
    return drafter


def _read_vllm(config: dict, weights: dict, target: Target, confirmed: bool = False):
    heads, layers = int(config["num_heads"]), int(config["num_hidden_layers"])
    shared = bool(config.get("original_lm_head"))
    draft = weights.get("token_map", torch.arange(target.vocab_size)).long()
    if draft.numel() != int(config.get("truncated_vocab_size") or draft.numel()):
        raise ImportFormatError(f"token_map holds {draft.numel()} ids but truncated_vocab_size is "
                                f"{config['truncated_vocab_size']}")
    if int(draft.max()) >= target.vocab_size:
        raise ImportFormatError(f"token_map names token {int(draft.max())}, beyond the target's vocabulary "
                                f"({target.vocab_size})")
    drafter = Medusa(MedusaConfig(num_heads=heads, num_layers=layers, lm_head="shared" if shared else "own",
                                  draft_vocab_size=None if draft.numel() == target.vocab_size else draft.numel()), target)
    if shared:                  # the one shared head is the target's own: it must be this target's
        written = weights["lm_heads.0.weight"]
        own = target.lm_head.weight.detach().float().cpu()[draft]
        if written.shape != own.shape or not torch.allclose(written, own, atol=1e-2, rtol=1e-2):
            raise ImportFormatError("the export's shared head is not this target's lm_head: import it against the "
                                    "target it was made for (--target)")
    fill(drafter, weights, "vllm", draft, skip={"token_map", "lm_heads.0.weight"} if shared else {"token_map"})
    return drafter


Medusa.formats = (
    ExportFormat("vllm", write_vllm, serve_vllm,
                 rules=((r"^blocks\.(\d+)\.(\d+)\.linear\.", r"blocks.\1.layers.\2."),),
                 read=_read_vllm, recognizes=lambda c: c.get("model_type") == "medusa", needs_target=shared_head,
                 method="medusa", refuses=vllm_refuses, whole_depth=True),
    ExportFormat("medusa-original", write_original, serve_original,
                 rules=((r"^blocks\.(\d+)\.(\d+)\.linear\.", r"\1.\2.linear."),
                        (r"^lm_heads\.(\d+)\.weight$", r"\1.{num_layers}.weight")),
                 read=_read_original, recognizes=lambda c: "medusa_num_heads" in c, needs_target=shared_head,
                 weights_file="medusa_lm_head.safetensors"),
)
