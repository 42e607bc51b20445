"""DSpark: DFlash's block drafter with a sequential (Markov) head inside the block and a confidence head that
picks how much of the block to submit.

The backbone is DFlash's (heads/dflash.py): one forward over the query block [x_{P+1}, masks] at positions
P+1 .. P+B (B = block_size) reading the target's fused features of the committed positions.  With
`sample_from_anchor` (DSpark's convention, the default) every slot drafts the token after its position:
slot k drafts x_{P+k+2}, B drafts a block; without it the anchor slot drafts nothing and slot k drafts
x_{P+k+1}, DFlash's B - 1.  Draft d of a block is x_{P+d+2} either way.

The sequential head adds, to draft d's logits, a bias from the token before it (the anchor for d = 0, the
token drafted at d - 1 after that), low rank over the target vocabulary:

    bias(prev) = markov_w2 @ markov_w1[prev]        markov_w1 [V, r] (an embedding), markov_w2 [v, r]

so the block's one parallel forward is followed by d cheap left-to-right steps that make each draft depend
on the one before.  markov_w2 starts at zero: a DSpark warm-started from a DFlash checkpoint drafts what that
DFlash drafted until training moves it.

The confidence head is one linear layer over [the draft slot's final state, markov_w1[prev]] -> a logit
whose sigmoid estimates the draft's acceptance given the tokens before it.  Training: its target is the
draft's acceptance probability under the target's distribution p and the drafter's q (the overlap
sum_v min(p_v, q_v) = 1 - TV(p, q), detached), binary cross-entropy weighted as the draft's own loss
(decay ** d), times `confidence_weight`.  Decoding: drafts are submitted while the running product of their
confidences stays at or above `confidence_threshold` (at least one); the rest of the block is dropped before
the target sees it.  Verification is the engine's, so the output is the target's whatever is submitted.

Training is DFlash's (random anchors, one query batch of blocks per sequence) with the sequential head
teacher-forced: the token before each draft is the data's (the target's own reply).

Serving formats: speculators' `dspark` (DSparkDraftModel: the DFlash tensors plus markov_head.markov_w1,
markov_head.markov_w2, confidence_head.proj) and vLLM's Qwen3DSparkModel (`method: dspark`).  The block fixes
the served K: a stack given another K drafts a different block (the peers' cards warn SGLang does so silently),
so the export says the K and `bench` refuses another.

Shape notation as heads/dflash.py; r the Markov rank, D the drafts a block gives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.decoding.dynamic_tree import TreeSettings
from draftsmith.heads.decoding.tree import DraftTree
from draftsmith.heads.dflash import DFlash, DFlashConfig
from draftsmith.heads.dflash_export import export_tensors, qwen3_fields
from draftsmith.heads.dflash import reader as dflash_reader
from draftsmith.heads.dflash_layer import dflash_layout
from draftsmith.heads.drafter import DraftContext, StepOutput, divide
from draftsmith.heads.eagle3_layout import speculators_config
from draftsmith.heads.formats import ExportFormat, ImportFormatError, output_convention, readme
from draftsmith.heads.registry import register

MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
CONFIDENCE = ("confidence_head.proj.weight", "confidence_head.proj.bias")
HEAD_TYPES = ("vanilla",)                 # speculators also has "gated" and "rnn": not implemented here


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 256
    """Rank r of the sequential head's bias markov_w2 @ markov_w1[prev]; 0: no sequential head (DFlash's drafts)."""
    markov_head_type: str = "vanilla"
    """The sequential head's form: vanilla (a first-order bias from the token before); the only one implemented."""
    sample_from_anchor: bool = True
    """The anchor slot drafts too (block_size drafts a block, DSpark's convention); false: block_size - 1 (DFlash's)."""
    confidence_head: bool = True
    """A head that estimates each draft's acceptance; decoding submits the drafts it trusts."""
    confidence_with_markov: bool = True
    """The confidence head also reads markov_w1[prev] (needs markov_rank > 0)."""
    confidence_weight: float = 1.0
    """The confidence loss's weight beside the drafts' loss."""
    confidence_threshold: float | None = 0.3
    """Decoding submits drafts while the product of their confidences is at least this (null: the whole chain)."""
    tree: dict | None = field(default=None)
    """Decoding: a chain (top_k 1) of depth drafts, at most a block's; default the whole block."""

    drafts_rule = "drafter.block_size with sample_from_anchor, else block_size - 1"

    def drafts(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def __post_init__(self):
        if self.tree is None:
            depth = self.drafts()
            self.tree = {"depth": depth, "top_k": 1, "total_tokens": depth}
        super().__post_init__()
        if self.tree.get("top_k", 1) != 1:
            raise ValueError("drafter.tree.top_k must be 1: DSpark drafts a chain (each draft depends on the one "
                             "before through the sequential head); draftsmith has no DSpark tree")
        if self.markov_head_type not in HEAD_TYPES:
            raise ValueError(f"drafter.markov_head_type '{self.markov_head_type}' is not implemented in draftsmith "
                             f"(it has {', '.join(HEAD_TYPES)}; speculators also trains gated and rnn heads)")
        if self.markov_rank < 0:
            raise ValueError(f"drafter.markov_rank must be >= 0 (0: no sequential head), got {self.markov_rank}")
        if self.confidence_head and self.confidence_with_markov and self.markov_rank == 0:
            raise ValueError("drafter.confidence_with_markov reads the sequential head's embedding, and "
                             "drafter.markov_rank is 0: set confidence_with_markov: false or a rank above 0")
        if self.confidence_threshold is not None and not 0 <= self.confidence_threshold < 1:
            raise ValueError(f"drafter.confidence_threshold must be in [0, 1) or null, got {self.confidence_threshold}")
        if self.confidence_threshold is not None and not self.confidence_head:
            raise ValueError("drafter.confidence_threshold needs the confidence head (drafter.confidence_head: true); "
                             "set it to null to submit the whole chain")
        if self.confidence_weight < 0:
            raise ValueError(f"drafter.confidence_weight must be >= 0, got {self.confidence_weight}")


class MarkovHead(nn.Module):
    """bias(prev) = markov_w2(markov_w1[prev]): [..] target ids -> [.., v] over the draft vocabulary."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        nn.init.zeros_(self.markov_w2.weight)          # a warm start from DFlash drafts what it drafted

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    """[.., H (+ r)] -> [..] a logit of the draft's acceptance."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


@register("dspark")
class DSpark(DFlash):
    title = "DSpark drafter (DFlash block + sequential and confidence heads)"
    config_class = DSparkConfig
    dynamic_tree = False             # a chain, its length chosen by the confidence head
    warm_starts_from = ("dflash",)   # a DFlash checkpoint has every tensor but the two heads'
    new_on_warm_start = MARKOV + CONFIDENCE

    def __init__(self, config: DSparkConfig, target):
        super().__init__(config, target)
        H, rank = self.shape.hidden_size, config.markov_rank
        v = self.draft_to_target.numel()
        self.markov_head = MarkovHead(target.vocab_size, v, rank) if rank else None
        self.confidence_head = (ConfidenceHead(H + (rank if config.confidence_with_markov else 0))
                                if config.confidence_head else None)
        self.confidence_threshold = config.confidence_threshold
        self.last_confidences: list[float] = []     # the last proposal's, for tests and reports

    @property
    def first_slot(self) -> int:
        return 0 if self.config.sample_from_anchor else 1

    @staticmethod
    def parameter_layout(config: dict) -> dict[str, tuple[int, ...]]:
        drafter, shape = config["drafter"], config["architecture"]
        out = dflash_layout(config)
        rank, H = drafter["markov_rank"], shape["hidden_size"]
        if rank:
            out |= {MARKOV[0]: (config["target"]["vocab_size"], rank), MARKOV[1]: (shape["draft_vocab_size"], rank)}
        if drafter["confidence_head"]:
            width = H + (rank if drafter["confidence_with_markov"] else 0)
            out |= {CONFIDENCE[0]: (1, width), CONFIDENCE[1]: (1,)}
        return out

    def architecture(self) -> dict:
        return {**super().architecture(), "drafts": self.drafts}

    # -- the two heads --------------------------------------------------------------------------
    def markov(self, prev: torch.Tensor):
        """prev [..] target ids -> (markov_w1[prev] [.., r] or None, bias [.., v] or None)."""
        if self.markov_head is None:
            return None, None
        embedded = self.markov_head.embed(prev)
        return embedded, self.markov_head.bias(embedded)

    def confidence_logits(self, states: torch.Tensor, embedded) -> torch.Tensor:
        """states [.., H] (a draft slot's final state), embedded [.., r] or None -> [..] logits."""
        if self.config.confidence_with_markov:
            states = torch.cat([states, embedded.to(states.dtype)], dim=-1)
        return self.confidence_head(states)

    # -- training -----------------------------------------------------------------------------
    def loss(self, batch: dict) -> StepOutput:
        """DFlash's block loss on the drafts with the sequential bias (the token before each draft is the
        data's), plus the confidence head's cross-entropy against each draft's acceptance probability."""
        anchors, real = self.sample_anchors(batch)
        states = self.block_states(batch, anchors, real)[:, :, self.first_slot:]              # [b, A, D, H]
        input_ids = batch["input_ids"]
        s, D = input_ids.shape[1], self.drafts
        before = (anchors[..., None] + torch.arange(D, device=anchors.device)).clamp(max=s - 1)   # x_{a+d}
        prev = input_ids.gather(1, before.flatten(1)).view_as(before)                              # [b, A, D]
        logits = self.lm_head(states)
        embedded, bias = self.markov(prev)
        if bias is not None:
            logits = logits + bias.to(logits.dtype)
        if self.confidence_head is None:
            return self.block_loss(batch, anchors, real, logits)
        confidence = self.confidence_logits(states, embedded)                                     # [b, A, D]

        def confidence_term(d, scored, drafted, probs, denominator):
            with torch.no_grad():
                accept = torch.minimum(torch.softmax(drafted.float(), dim=-1), probs).sum(-1)      # 1 - TV
            per = F.binary_cross_entropy_with_logits(confidence[:, :, d][scored].float(), accept.clamp(0, 1),
                                                     reduction="sum")
            return self.config.confidence_weight * (self.config.loss_decay ** d) * divide(per, denominator)

        return self.block_loss(batch, anchors, real, logits, extra=confidence_term)

    # -- decoding -----------------------------------------------------------------------------
    def set_proposal(self, chain: int | None = None, tree_size: int | None = None, tree: TreeSettings | None = None):
        """A chain of `chain` drafts (at most the block's), the confidence head cutting it where it stops
        trusting the drafts; a tree is refused: each draft depends on the one before."""
        if tree is not None and tree.top_k != 1:
            raise ValueError("a DSpark drafter drafts a chain: its sequential head makes each draft depend on the "
                             "one before, so it has no tree of alternatives; use --chain")
        super().set_proposal(chain=chain if chain is not None else (tree.depth if tree is not None else None))

    def describe_proposal(self) -> str:
        cut = (f", submitted while the confidences' product >= {self.confidence_threshold}"
               if self.confidence_head is not None and self.confidence_threshold is not None else "")
        return (f"DSpark chain of up to {self.tree.depth} (one drafter forward, block of {self.config.block_size}"
                f", sequential head{cut})")

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        """The chain left to right on the device (each draft's token indexes the next one's bias there), then one
        wait for the tokens and confidences, and the cut where the confidences' product falls below the
        threshold (at least one draft)."""
        states = self.draft_states(context)                                                     # [depth, H]
        base = self.lm_head(states).float()
        prev = torch.tensor([context.next_token], device=states.device)
        tokens, confidences = [], []
        for d in range(states.shape[0]):
            embedded, bias = self.markov(prev)
            logits = base[d] + (bias[0].float() if bias is not None else 0)
            prev = self.draft_to_target[logits.argmax()][None]
            tokens.append(prev)
            if self.confidence_head is not None:
                confidences.append(torch.sigmoid(self.confidence_logits(states[d:d + 1], embedded)).float())
        drafted = torch.cat(tokens).cpu()
        self.last_confidences = torch.cat(confidences).cpu().tolist() if confidences else []
        n = drafted.numel()
        if self.last_confidences and self.confidence_threshold is not None:
            running = torch.tensor(self.last_confidences).cumprod(0)
            n = max(1, int((running >= self.confidence_threshold).sum()))     # the product only falls
        return DraftTree(tokens=drafted[:n].clone(), parents=torch.arange(n) - 1)


# -- serving formats: speculators' `dspark` and vLLM's Qwen3DSparkModel -------------------------------------

def _dspark_fields(config: dict) -> dict:
    drafter = config["drafter"]
    return {"markov_rank": drafter["markov_rank"], "markov_head_type": drafter["markov_head_type"],
            "enable_confidence_head": drafter["confidence_head"],
            "confidence_head_with_markov": bool(drafter["confidence_head"] and drafter["confidence_with_markov"]),
            "sample_from_anchor": drafter["sample_from_anchor"], "block_size": drafter["block_size"]}


def served_k(config: dict) -> int:
    """The K a stack must be given: the drafts of the block it was trained on."""
    drafter = config["drafter"]
    return drafter["block_size"] if drafter["sample_from_anchor"] else drafter["block_size"] - 1


def _notes(config: dict) -> str:
    K = served_k(config)
    return (f"DSpark: a block of {config['drafter']['block_size']} drafting {K} tokens "
            f"(sample_from_anchor: {str(config['drafter']['sample_from_anchor']).lower()}), a sequential head of rank "
            f"{config['drafter']['markov_rank']}, confidence head: {str(config['drafter']['confidence_head']).lower()}. "
            f"Serve it with num_speculative_tokens = {K} and no other: another K drafts a different block than the "
            "one it was trained on (SGLang does so without a word).")


def _write_vllm(config, weights, target, dtype, checkpoint):
    ids = output_convention(config["target_layer_ids"], "vLLM's DSpark")
    mask = config["architecture"]["mask_token_id"]
    cfg = {"architectures": ["Qwen3DSparkModel"], **qwen3_fields(config, dtype), **_dspark_fields(config),
           "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids, "causal": False},
           "dspark_bonus_anchor": not config["drafter"]["sample_from_anchor"], "num_speculative_tokens": served_k(config)}
    return ({"model.safetensors": export_tensors(config, weights, dtype, "vllm")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "DSpark drafter for vLLM",
                                                       _serve(config, "vllm"), _notes(config))})


def _write_speculators(config, weights, target, dtype, checkpoint):
    K = served_k(config)
    layer = qwen3_fields(config, dtype)
    cfg = {"architectures": ["DSparkDraftModel"], "speculators_model_type": "dspark", "speculators_version": "0.9.0",
           "speculators_config": speculators_config(config, "dspark", K),
           "transformer_layer_config": layer, "draft_vocab_size": layer["draft_vocab_size"],
           "target_hidden_size": layer["target_hidden_size"], **_dspark_fields(config),
           "aux_hidden_state_layer_ids": list(config["target_layer_ids"]),
           "mask_token_id": config["architecture"]["mask_token_id"], "sliding_window_non_causal": True,
           "torch_dtype": layer["torch_dtype"]}
    return ({"model.safetensors": export_tensors(config, weights, dtype, "speculators")},
            {"config.json": cfg, "README.md": readme(config, checkpoint, "DSpark drafter (speculators format)",
                                                       _serve(config, "speculators"), _notes(config))})


def _serve(config: dict, fmt: str) -> str:
    K = served_k(config)
    if fmt == "vllm":
        return (f"""vllm serve TARGET_DIR --speculative-config '{{"method": "dspark", "model": "THIS_DIR", """
                f""""num_speculative_tokens": {K}}}'""")
    return f"vllm serve THIS_DIR   # num_speculative_tokens {K}: vLLM reads it from this config"


def _reads(fmt: str):
    base = dflash_reader(fmt)

    def read(config, weights, target, confirmed=False):
        rank = int(config.get("markov_rank", 0) or 0)
        head_type = config.get("markov_head_type", "vanilla")
        if head_type not in HEAD_TYPES:
            raise ImportFormatError(f"this DSpark drafter's sequential head is '{head_type}' (markov_head_type), "
                                    f"which draftsmith does not implement (it has {', '.join(HEAD_TYPES)})")
        confidence = bool(config.get("enable_confidence_head", False)) and CONFIDENCE[0] in weights
        if config.get("enable_confidence_head") and CONFIDENCE[0] not in weights:
            raise ImportFormatError("enable_confidence_head: true but the export has no confidence_head.proj.weight")
        if rank and MARKOV[0] not in weights:
            raise ImportFormatError(f"markov_rank: {rank} but the export has no markov_head.markov_w1.weight")
        if "sample_from_anchor" not in config:
            raise ImportFormatError("the export does not say sample_from_anchor: which slot drafts first decides "
                                    "every draft's position, and readers disagree on its default")
        dflash = base(config, {k: v for k, v in weights.items() if k not in MARKOV + CONFIDENCE}, target, confirmed)
        settings = {**{k: getattr(dflash.config, k) for k in ("layer_ids", "num_layers", "block_size",
                                                                "draft_vocab_size", "intermediate_size",
                                                                "mask_token_id")},
                    "markov_rank": rank, "sample_from_anchor": bool(config["sample_from_anchor"]),
                    "confidence_head": confidence,
                    "confidence_with_markov": bool(confidence and config.get("confidence_head_with_markov", False)),
                    "confidence_threshold": DSparkConfig.confidence_threshold if confidence else None}
        drafter = DSpark(DSparkConfig(**settings), target)
        state = {**dflash.state_dict(), **{k: weights[k] for k in MARKOV + CONFIDENCE if k in weights}}
        own = drafter.state_dict()
        wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own
                 if k in state and state[k].shape != own[k].shape]
        if wrong or set(own) - set(state):
            raise ImportFormatError(f"the export does not fit a dspark drafter for this target: shapes {wrong[:4]}, "
                                    f"missing {sorted(set(own) - set(state))[:4]}")
        drafter.load_state_dict({k: state[k] for k in own}, strict=True)
        return drafter
    return read


def _recognizes(config: dict) -> bool:
    return (config.get("speculators_model_type") == "dspark"
            or any("DSpark" in str(a) for a in config.get("architectures") or ()))


DSpark.formats = (
    ExportFormat("vllm", _write_vllm, lambda c: _serve(c, "vllm"), read=_reads("vllm"), recognizes=_recognizes,
                 method="dspark", serving_k=served_k),
    ExportFormat("speculators", _write_speculators, lambda c: _serve(c, "speculators"), read=_reads("speculators"),
                 recognizes=_recognizes, serving_k=served_k),
)
