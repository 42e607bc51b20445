"""DFlash (block diffusion drafting): a few drafter layers denoise a block of masked tokens in one forward.

After the target's forward at positions .. P, the drafter's query block is the
target's next token x_{P+1} (the "bonus" token, at position P+1) followed by
K = block_size - 1 mask tokens at positions P+2 .. P+1+K; the output at mask
slot j is the draft for its own position.  Attention is non-causal inside the
block.  The context is the target's: the fused layers' features
c = hidden_norm(fc(cat(layer features))) at every committed position feed
each drafter layer's keys and values (k_norm(k_proj(c)), rotated at the
context's positions, and v_proj(c)); the block's own keys and values come
from the block's hidden states as in any decoder layer.  The layers are
Qwen3's (per-head q_norm and k_norm, pre-norm residuals, SwiGLU MLP), then
the drafter's own `norm` and `lm_head` over a draft vocabulary; the token
embedding is the target's, frozen.  This is vLLM's `DFlashDraftModel`
(model_executor/models/qwen3_dflash.py, v1/spec_decode/dflash.py).

Training (the method's recipe): random anchor positions a per sequence, each
a block [x_a, mask x K] at positions a .. a+K seeing the context features at
positions < a and its whole own block; slot j predicts x_{a+j}, distilled
from the target's distribution at a+j-1, weighted loss_decay ** (j-1).  The
anchors of a sequence are one query batch over its context: one target
forward trains many blocks.

Decoding: the drafter keeps each layer's context keys and values for the
committed tokens (never a drafted one), so a step projects only the newly
committed tokens and runs the K+1 block tokens through the layers.  A chain of
up to K drafts, or the parallel tree (heads/decoding/parallel.py).

Shape notation: b batch, s sequence, A anchors, n = K+1 block tokens, H hidden, T target hidden,
d head dim, h heads, hk key/value heads, v draft vocabulary.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.contract import DrafterBase
from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.parallel import clamp_depth, parallel_tree, resolve_mask_token
from draftsmith.heads.draft_vocab import add_draft_vocabulary, set_draft_map
from draftsmith.heads.drafter import DraftContext, StepOutput, divide, term_denominators
from draftsmith.heads.dflash_export import serve_command, write_speculators, write_vllm
from draftsmith.heads.dflash_layer import BlockLayer, dflash_layout
from draftsmith.heads.eagle_layer import RMSNorm, Rotary, layer_shape_from_target
from draftsmith.heads.formats import ExportFormat, ImportFormatError, fill
from draftsmith.heads.registry import register
from draftsmith.heads.runtime.target import Target
from draftsmith.heads.soft_loss import LOSSES, acceptance_loss


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """`count` target layers spread evenly from shallow to deep, hidden_states ids 2 .. N-2 (the DFlash
    release's rule, which names them by decoder-layer output: 1 .. N-3), clamped for shallow targets."""
    low, high = min(2, num_layers), max(min(2, num_layers), num_layers - 2)
    return sorted({round(low + i * (high - low) / max(count - 1, 1)) for i in range(count)})


@dataclass
class DFlashConfig:
    layer_ids: list[int] | None = None
    """Fused target layers (hidden_states ids, at least 1: vLLM names them by the layer whose output they
    are); default five spread evenly over the target's depth."""
    num_layers: int = 1
    """Drafter decoder layers (the DFlash releases use 5 for 8B targets; each costs one layer's step)."""
    block_size: int = 5
    """Tokens in the query block: the target's next token and block_size - 1 masks, the drafts K."""
    anchors: int = 64
    """Random anchor positions (blocks) trained per sequence and step."""
    loss_decay: float = 0.8
    """Mask slot j's loss weight is loss_decay ** (j - 1)."""
    draft_vocab_size: int | None = 32000
    """Tokens the drafter scores (the most frequent reply tokens); capped at the target vocabulary."""
    intermediate_size: int | None = None
    """The drafter layers' MLP width; default the target's."""
    mask_token_id: int | None = None
    """The token id the mask slots read; default: the tokenizer's mask token, else its pad token when that
    is not end-of-text, else the last id of the vocabulary."""
    loss: str = "soft_ce"
    """soft_ce, tv or lk against the target's distribution (heads/soft_loss.py)."""
    tree: dict = field(default_factory=lambda: {"depth": 4, "top_k": 1, "total_tokens": 4})
    """Decoding: depth (at most block_size - 1), top_k (alternatives per depth; 1 = a chain), total_tokens."""
    init_from: str | None = None
    """Warm start: a draftsmith dflash checkpoint for this target whose weights training starts from."""

    def __post_init__(self):
        if not 2 <= self.block_size <= 64:
            raise ValueError(f"drafter.block_size is DFlash's query block (the target's next token and "
                             f"block_size - 1 masks): it must be in [2, 64], got {self.block_size}")
        if not 1 <= self.num_layers <= 32:
            raise ValueError(f"drafter.num_layers must be in [1, 32], got {self.num_layers}")
        if self.anchors < 1:
            raise ValueError(f"drafter.anchors (blocks trained per sequence) must be at least 1, got {self.anchors}")
        if self.layer_ids is not None and not self.layer_ids:
            raise ValueError("drafter.layer_ids must name at least one target layer (or be null for the default)")
        if self.loss not in LOSSES:
            raise ValueError(f"drafter.loss must be one of {', '.join(LOSSES)}, got '{self.loss}'")
        TreeSettings(**self.tree)
        if self.tree["depth"] > self.drafts():
            raise ValueError(f"drafter.tree.depth {self.tree['depth']} is more than the {self.drafts()} drafts of a "
                             f"block ({self.drafts_rule}): lower it or train a larger block")

    drafts_rule = "drafter.block_size - 1 masks"

    def drafts(self) -> int:
        """Tokens one block drafts: the slots after the target's next token."""
        return self.block_size - 1

    def check_recipe(self, recipe) -> None:
        """What needs the rest of the recipe: the block must fit the training sequences."""
        if self.block_size > recipe.data.max_seq_len:
            raise ValueError(f"drafter.block_size {self.block_size} is longer than the training sequences "
                             f"(data.max_seq_len {recipe.data.max_seq_len}): no anchor's block would fit; "
                             "lower block_size or raise data.max_seq_len")


@register("dflash")
class DFlash(DrafterBase):
    title = "DFlash drafter (block diffusion)"
    config_class = DFlashConfig
    dynamic_tree = True            # a parallel tree (config.tree), tuned by eval like EAGLE-2's
    one_forward = True             # every depth of a proposal comes from one drafter forward
    first_slot = 1                 # the block slot that drafts x_{a+1}: the first mask (slot 0 holds x_a)

    def __init__(self, config: DFlashConfig, target: Target):
        super().__init__()
        self.config = config
        self.target = target                       # frozen; its embedding is never saved here
        self.target_identity = target.identity
        self.layer_ids = target.check_layer_ids(config.layer_ids or default_layer_ids(target.num_layers),
                                                "drafter.layer_ids")
        self.mask_token_id = resolve_mask_token(target, config.mask_token_id)
        self.shape = layer_shape_from_target(target, intermediate_size=config.intermediate_size)
        H = self.shape.hidden_size
        add_draft_vocabulary(self, config.draft_vocab_size or target.vocab_size, target.vocab_size)
        self.fc = nn.Linear(len(self.layer_ids) * target.hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, self.shape.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(self.shape) for _ in range(config.num_layers))
        self.norm = RMSNorm(H, self.shape.rms_norm_eps)
        self.lm_head = nn.Linear(H, self.draft_to_target.numel(), bias=False)
        self.rotary = Rotary(self.shape)
        self.tree = TreeSettings(**config.tree)
        self.metadata: dict = {}
        self.context_kv: list | None = None
        self.set_draft_vocabulary(self.draft_to_target)

    @property
    def K(self) -> int:
        return self.config.block_size - 1

    @property
    def required_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.layer_ids) | {self.target.num_layers}))

    @staticmethod
    def parameter_layout(config: dict) -> dict[str, tuple[int, ...]]:
        return dflash_layout(config)

    def fused_layer_ids(self) -> list[int]:
        return list(self.layer_ids)

    def architecture(self) -> dict:
        eos = self.target.eos_token_ids
        return {**asdict(self.shape), "draft_vocab_size": int(self.draft_to_target.numel()),
                "num_fused_layers": len(self.layer_ids), "mask_token_id": self.mask_token_id, "bos_token_id": getattr(self.target.config, "bos_token_id", None),
                "eos_token_id": eos[0] if len(eos) == 1 else eos}

    @property
    def drafts(self) -> int:
        """Tokens a block drafts (slots first_slot .. K): draft d is x_{a+d+1}."""
        return self.config.block_size - self.first_slot

    @property
    def draft_positions(self) -> int:
        return self.drafts

    def set_draft_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """Scored tokens (ascending target ids); the lm_head restarts from the target's rows for them."""
        set_draft_map(self, draft_to_target)
        head = self.target.lm_head.weight.detach()              # on the last device of a spread target
        rows = head[self.draft_to_target.to(head.device)]
        self.lm_head.weight.data.copy_(rows.float().to(self.lm_head.weight.device))

    # -- the forward both paths share -------------------------------------------------------
    def fused_context(self, features: dict) -> torch.Tensor:
        """{layer: [..., T]} -> hidden_norm(fc(cat)) [..., H], what every layer's context keys read."""
        stacked = torch.cat([features[i] for i in self.layer_ids], dim=-1)
        return self.hidden_norm(self.fc(stacked.to(self.fc.weight.dtype)))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed_tokens(tokens).to(self.fc.weight.dtype)

    def context_keys(self, c: torch.Tensor, positions: torch.Tensor) -> list:
        """c [b, m, H] at positions [b, m] -> each layer's (keys, values)."""
        cos, sin = self.rotary(c, positions)
        return [layer.self_attn.context(c, cos, sin) for layer in self.layers]

    def run_block(self, tokens: torch.Tensor, positions: torch.Tensor, context_kv: list, mask) -> torch.Tensor:
        """tokens, positions [b, n] -> the block's final states norm(h) [b, n, H] (slot 0's included), what
        lm_head reads."""
        h = self.embed(tokens)
        cos, sin = self.rotary(h, positions)
        for layer, kv in zip(self.layers, context_kv):
            h = layer(h, cos, sin, kv, mask)
        return self.norm(h)

    def block_tokens(self, first: torch.Tensor) -> torch.Tensor:
        """first [...] -> [..., K+1]: each block, the given token then K masks."""
        masks = first.new_full((*first.shape, self.K), self.mask_token_id)
        return torch.cat([first[..., None], masks], dim=-1)

    # -- training -----------------------------------------------------------------------------
    def anchor_candidates(self, batch: dict) -> torch.Tensor:
        """[b, s] bool: positions a >= 1 whose block's first draft (token a+1) is a reply token."""
        reply = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        ok = F.pad(reply[:, 1:], (0, 1))
        ok[:, 0] = False
        return ok

    def loss_counts(self, batch: dict) -> torch.Tensor:
        """[drafts]: the anchors a step trains (per sequence, min(anchors, candidates)); every slot's mean is
        over them, a slot past the reply scoring zero (so the count follows from the masks alone)."""
        per_row = self.anchor_candidates(batch).sum(1).clamp(max=self.config.anchors)
        return per_row.sum().float().expand(self.drafts).clone()

    def sample_anchors(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Random anchors per sequence: positions [b, A] and which are real [b, A] (fewer candidates: padded).
        Out of training mode (held-out validation) the draw is seeded, so every validation scores the same
        blocks and leaves the training's random stream alone."""
        candidates = self.anchor_candidates(batch)
        b = candidates.shape[0]
        A = int(candidates.sum(1).clamp(max=self.config.anchors).max()) if b else 0
        A = max(A, 1)
        generator = None if self.training else torch.Generator(candidates.device).manual_seed(0)
        scores = torch.rand(candidates.shape, device=candidates.device, generator=generator)
        scores = scores.masked_fill(~candidates, -1.0)
        top = scores.topk(min(A, candidates.shape[1]), dim=1)
        return top.indices, top.values >= 0

    @torch.no_grad()
    def _target_probs(self, batch: dict, rows: torch.Tensor, positions: torch.Tensor):
        """The target's distribution over the draft vocabulary at (row, position) pairs [m]: probs [m, v],
        its argmax [m] and whether the target's own argmax is in the draft vocabulary [m]."""
        final = batch["features"][self.target.num_layers][rows, positions]          # [m, T]
        probs, top, ok = [], [], []
        for chunk in final.split(1024):
            logits = self.target.compute_logits(chunk)
            ok.append(self.target_to_draft[logits.max(-1).indices] >= 0)
            draft = torch.softmax(logits[:, self.draft_to_target].float(), dim=-1)
            probs.append(draft)
            top.append(draft.argmax(-1))
        v = self.draft_to_target.numel()
        if not probs:
            return final.new_zeros(0, v, dtype=torch.float32), rows.new_zeros(0), rows.new_zeros(0, dtype=torch.bool)
        return torch.cat(probs), torch.cat(top), torch.cat(ok)

    def block_logits(self, batch: dict, anchors: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Every anchor's block -> logits [b, A, K+1, v] (block_states through lm_head)."""
        return self.lm_head(self.block_states(batch, anchors, real))

    def block_states(self, batch: dict, anchors: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """Every anchor's block in one query batch per sequence -> final states [b, A, K+1, H].  Block a sees
        the context at positions < a (inside the sequence) and its own K+1 tokens, nothing else."""
        input_ids, valid = batch["input_ids"], batch["attention_mask"].bool()
        b, s = input_ids.shape
        A, n = anchors.shape[1], self.K + 1
        positions = torch.arange(s, device=input_ids.device)[None].expand(b, s)
        context_kv = self.context_keys(self.fused_context(batch["features"]), positions)
        tokens = self.block_tokens(input_ids.gather(1, anchors)).reshape(b, A * n)
        block_positions = (anchors[..., None] + torch.arange(n, device=anchors.device)).reshape(b, A * n)
        sees_context = (positions[:, None, :] < anchors[..., None]) & valid[:, None, :]                # [b, A, s]
        own = torch.eye(A, dtype=torch.bool, device=anchors.device)                                      # [A, A]
        sees_block = own[:, None, :, None].expand(A, n, A, n).reshape(A * n, A * n)
        mask = torch.cat([sees_context.repeat_interleave(n, dim=1), sees_block.expand(b, -1, -1)], dim=-1)
        mask = mask | ~real.repeat_interleave(n, dim=1)[..., None]     # a padded anchor sees all (its loss is 0)
        return self.run_block(tokens, block_positions, context_kv, mask[:, None]).reshape(b, A, n, -1)

    def loss(self, batch: dict) -> StepOutput:
        """Sum over drafts d of decay^d * loss(target at a+d, draft d of anchor a), over the anchors."""
        anchors, real = self.sample_anchors(batch)
        states = self.block_states(batch, anchors, real)
        return self.block_loss(batch, anchors, real, self.lm_head(states[:, :, self.first_slot:]))

    def block_loss(self, batch: dict, anchors: torch.Tensor, real: torch.Tensor, logits: torch.Tensor,
                   extra=None) -> StepOutput:
        """logits [b, A, D, v]: draft d of anchor a, x_{a+d+1}, scored against the target's distribution at a+d
        (computed once at each position some draft needs), weighted decay^d.  `extra(d, scored, logits, probs,
        denominator)`, if given, returns a further loss term for draft d's scored anchors (DSpark's confidence)."""
        b, s = batch["input_ids"].shape
        reply = batch["loss_mask"].bool() & batch["attention_mask"].bool()
        device = batch["input_ids"].device
        rows = torch.arange(b, device=device)[:, None].expand_as(anchors)
        scored = [real & (anchors + j < s) & reply.gather(1, (anchors + j).clamp(max=s - 1))
                  for j in range(1, logits.shape[2] + 1)]                                # draft j-1 is a+j
        needed = torch.zeros(b, s, dtype=torch.long, device=device)         # scattered, not compacted: no wait
        for j, ok in enumerate(scored, start=1):
            needed.index_put_((rows, (anchors + j - 1).clamp(max=s - 1)), ok.long(), accumulate=True)
        r, p = needed.bool().nonzero(as_tuple=True)
        probs, top, in_vocab = self._target_probs(batch, r, p)
        index = torch.full((b, s), -1, dtype=torch.long, device=device)
        index[r, p] = torch.arange(r.numel(), device=device)
        denominators = term_denominators(batch, self.loss_counts(batch))
        total = 0 * logits.sum()            # connected to every weight, even when a micro-batch scores nothing
        correct = torch.zeros(len(scored), device=device)
        counted = torch.zeros(len(scored), device=device)
        for j, ok in enumerate(scored, start=1):
            counted[j - 1] = ok.sum()
            ok = ok.nonzero(as_tuple=True)              # one host wait per slot (docs/scale.md)
            at = index[rows[ok], anchors[ok] + j - 1]
            drafted = logits[:, :, j - 1][ok]
            per, guess = acceptance_loss(drafted, probs[at], in_vocab[at].float(), self.config.loss)
            total = total + (self.config.loss_decay ** (j - 1)) * divide(per.sum(), denominators[j - 1])
            if extra is not None:
                total = total + extra(j - 1, ok, drafted, probs[at], denominators[j - 1])
            correct[j - 1] = ((guess == top[at]) & in_vocab[at]).sum()
        return StepOutput(loss=total, correct=correct, counted=counted)

    # -- decoding -----------------------------------------------------------------------------
    def set_proposal(self, chain: int | None = None, tree_size: int | None = None, tree: TreeSettings | None = None):
        """A chain of `chain` drafts, or the parallel tree (total_tokens = tree_size if given); never deeper
        than the block's K masks."""
        if chain is not None:
            settings = TreeSettings.chain(chain or self.config.tree.get("depth", self.K))
        elif tree is not None:
            settings = tree
        else:
            defaults = dict(self.config.tree)
            if tree_size:
                defaults["total_tokens"] = tree_size
            settings = TreeSettings(**defaults)
        self.tree = clamp_depth(settings, self.drafts)

    def describe_proposal(self) -> str:
        if self.tree.top_k == 1:
            return f"parallel chain of {self.tree.depth} (one drafter forward, block of {self.config.block_size})"
        return (f"parallel tree ({self.tree.total_tokens} nodes, depth {self.tree.depth}, top-{self.tree.top_k} "
                f"per depth, one drafter forward)")

    def reset(self) -> None:
        self.context_kv = None

    def draft_logits(self, context: DraftContext) -> torch.Tensor:
        """logits [depth, v] of the first depth drafts (draft_states through lm_head)."""
        return self.lm_head(self.draft_states(context))

    def draft_states(self, context: DraftContext) -> torch.Tensor:
        """Add the newly committed tokens' context keys, run the block [next token, K masks] at positions
        position .. position+K -> final states [depth, H] of the first depth drafts."""
        device = self.fc.weight.device
        m = context.tokens.shape[0]
        positions = torch.arange(context.position - m, context.position, device=device)[None]
        c = self.fused_context({i: context.hidden[i].to(device)[None] for i in self.layer_ids})
        new = self.context_keys(c, positions)
        if self.context_kv is None:
            self.context_kv = new
        else:
            self.context_kv = [(torch.cat([k, nk], dim=2), torch.cat([v, nv], dim=2))
                               for (k, v), (nk, nv) in zip(self.context_kv, new)]
        tokens = self.block_tokens(torch.tensor([context.next_token], device=device))       # [1, K+1]
        block_positions = torch.arange(context.position, context.position + self.K + 1, device=device)[None]
        states = self.run_block(tokens, block_positions, self.context_kv, None)[0]           # [K+1, H]
        return states[self.first_slot:self.first_slot + self.tree.depth]

    @torch.no_grad()
    def propose(self, context: DraftContext):
        logprobs = torch.log_softmax(self.draft_logits(context).float(), dim=-1)
        return parallel_tree(logprobs, self.tree, self.draft_to_target)


# -- reading the serving formats back (heads/dflash_export.py writes them) -------------------------------------

def reader(fmt: str):
    def read(config, weights, target, confirmed=False):
        layer = config.get("transformer_layer_config", config)
        if fmt == "speculators":
            ids = [int(i) for i in config.get("aux_hidden_state_layer_ids") or ()]
            mask = config.get("mask_token_id")
        else:
            dflash = config.get("dflash_config") or {}
            ids = [int(i) + 1 for i in dflash.get("target_layer_ids") or ()]
            mask = dflash.get("mask_token_id", config.get("mask_token_id"))
            if dflash.get("causal") is True:
                raise ImportFormatError("this DFlash drafter attends causally inside its block (dflash_config.causal: "
                                        "true), which draftsmith's DFlash does not do")
        if not ids:
            raise ImportFormatError("the export names no fused target layers (dflash_config.target_layer_ids or "
                                    "aux_hidden_state_layer_ids)")
        target.check_layer_ids(ids, "the export's fused layers (draftsmith's hidden_states ids)")
        if mask is None:
            raise ImportFormatError("the export has no mask token id (dflash_config.mask_token_id)")
        if "d2t" in weights:
            draft = torch.arange(weights["d2t"].numel()) + weights["d2t"].long()
            if int(draft.max()) >= target.vocab_size or (draft.diff() <= 0).any():
                raise ImportFormatError("d2t does not map the draft vocabulary to ascending ids inside the target's "
                                        "vocabulary")
        else:
            draft = torch.arange(target.vocab_size)
        block = int(config.get("block_size") or layer.get("block_size") or 0)
        if block < 2:
            raise ImportFormatError("the export does not say its block size (block_size): draftsmith's DFlash needs "
                                    "the block it was trained on")
        K = block - 1
        drafter = DFlash(DFlashConfig(layer_ids=ids, num_layers=int(layer["num_hidden_layers"]), block_size=block,
                                      draft_vocab_size=draft.numel(), intermediate_size=int(layer["intermediate_size"]),
                                      mask_token_id=int(mask), tree={"depth": K, "top_k": 1, "total_tokens": K}),
                         target)
        fill(drafter, weights, fmt, draft, skip={"d2t", "t2d"})
        return drafter
    return read


def _recognizes(config: dict) -> bool:
    if config.get("speculators_model_type") == "dspark" or any("DSpark" in str(a) for a in config.get("architectures") or ()):
        return False                # DSpark's vLLM config carries a dflash_config too (heads/dspark.py reads it)
    return (config.get("speculators_model_type") == "dflash" or "dflash_config" in config
            or any("DFlash" in str(a) for a in config.get("architectures") or ()))


DFlash.formats = (
    ExportFormat("vllm", write_vllm, lambda c: serve_command(c, "vllm"), read=reader("vllm"), recognizes=_recognizes,
                 method="dflash", parallel_drafting=False),
    ExportFormat("speculators", write_speculators, lambda c: serve_command(c, "speculators"), read=reader("speculators"),
                 recognizes=_recognizes),
)
