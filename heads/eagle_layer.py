"""The draft decoder layer of EAGLE-1 and EAGLE-3: one Llama layer (the layout every serving stack loads).

EAGLE-3 (arXiv 2503.01840; vLLM `LlamaForCausalLMEagle3`): the fc output h
and the token embedding e are normed separately (`hidden_norm`,
`input_layernorm`), attention reads cat(e, h) (2H wide, embedding first), and
the residual is the un-normed h.  EAGLE-1 (arXiv 2401.15077): the layer reads
the fc output directly, with no input norm.

Two ways to attend:
- `cached`: decoding, through an EngineCache (heads/runtime/engine.py) so a tree of
  drafts sees the real context and its own ancestors only;
- `ttt`: training-time test.  At unrolled step s, position i attends to the
  step-0 keys causally (j <= i) and, from every later step t = 1..s, only to
  its own position i (EAGLE-3, arXiv 2503.01840, section 3.2).  `ttt_mask` spells
  that pattern out; `ttt` computes it without materialising it.

Shape notation: b batch, s sequence, n new tokens, d head dim, h heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from draftsmith.heads.runtime.engine import EngineCache, cached_attention


@dataclass
class LayerShape:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int


def layer_shape_from_target(target, hidden_size=None, intermediate_size=None, num_heads=None,
                            num_kv_heads=None) -> LayerShape:
    """The target's own layer shape, any field overridable."""
    cfg = target.config
    hidden = hidden_size or cfg.hidden_size
    heads = num_heads or cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default",
                                                     "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    if "full_attention" in rope:          # per-layer-type rope (Gemma 3): the global layers' rope
        rope = rope["full_attention"]
    return LayerShape(
        hidden_size=hidden, num_heads=heads, num_kv_heads=num_kv_heads or getattr(cfg, "num_key_value_heads", heads),
        head_dim=getattr(cfg, "head_dim", None) or hidden // heads,
        intermediate_size=intermediate_size or cfg.intermediate_size,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), rope_parameters=dict(rope),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] -> [..., H], computed in fp32 as Llama does."""
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding with the target's rope settings (transformers computes the frequencies)."""

    def __init__(self, shape: LayerShape):
        super().__init__()

        config = LlamaConfig(hidden_size=shape.hidden_size, num_attention_heads=shape.num_heads,
                             num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                             max_position_embeddings=shape.max_position_embeddings,
                             rope_parameters=shape.rope_parameters)
        self.rotary = LlamaRotaryEmbedding(config)

    def _apply(self, fn, recurse=True):
        """Moves go through; a cast does not reach the frequencies.  `module.bfloat16()` (DeepSpeed's engine)
        and `.to(bf16)` (eval) would round inv_freq to 8 bits, about a radian of angle on the fastest dimensions
        at 500 tokens; DDP, FSDP and vLLM keep it fp32, and so does this (tests/test_gpu_shaped.py)."""
        kept = dict(self.rotary.named_buffers())
        super()._apply(fn, recurse)
        for name, original in kept.items():
            moved = self.rotary._buffers[name]
            if moved is not None and moved.dtype != original.dtype:
                self.rotary._buffers[name] = original.to(moved.device)
        return self

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, n] -> cos, sin [b, n, d]"""
        return self.rotary(x, positions)


KERNEL_DEVICE: str | None = None
"""Force the attention rule of one device type ("cuda", "cpu") whatever the tensors' device: a test runs the
CUDA rule on the CPU (tests/test_gpu_shaped.py).  None: the rule of the tensors' own device."""


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Training attention with a boolean mask: q [b, h, n, d], k and v [b, hk, m, d] -> [b, h, n, d] in q's dtype.

    On CUDA in the training dtype, in a form a fused kernel takes: flash attention refuses any mask and the
    memory-efficient kernel refuses `enable_gqa`, so with a mask the keys and values are repeated to the query
    heads (with `enable_gqa` SDPA would fall back to the math kernel, which holds fp32 scores [b, h, n, m]).
    On the CPU in fp32 with `enable_gqa`: the masked kernel's bf16 backward is 4-6x slower there (b=8,
    s=400, measured: 2.5-3.4 s against 0.35-0.8 s per step).  train's memory probe runs this same function,
    so its estimate follows the rule that runs."""
    rule = KERNEL_DEVICE or q.device.type
    groups = q.shape[1] // k.shape[1]
    with torch.autocast(q.device.type, enabled=False):
        if rule == "cpu":
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                 enable_gqa=groups > 1)
        else:
            if groups > 1 and mask is not None:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)   # [b, h, m, d]
            out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                                 enable_gqa=groups > 1 and mask is None)
    return out.to(q.dtype)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    return apply_rotary_pos_emb(q, k, cos, sin)


def ttt_mask(seq_len: int, step: int) -> torch.Tensor:
    """[s, s * (step + 1)] bool: what position i sees at unrolled step `step`, over (step-0 keys, step-1 keys, ...)."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    diagonal = torch.eye(seq_len, dtype=torch.bool)
    return torch.cat([causal] + [diagonal] * step, dim=1)


class Projected(NamedTuple):
    query: torch.Tensor       # [b, h, n, d], rotated
    key: torch.Tensor         # [b, hk, n, d], rotated
    value: torch.Tensor       # [b, hk, n, d]


class DraftAttention(nn.Module):
    def __init__(self, shape: LayerShape, input_size: int):
        super().__init__()
        self.shape = shape
        h, kv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_proj = nn.Linear(input_size, h * d, bias=False)
        self.k_proj = nn.Linear(input_size, kv * d, bias=False)
        self.v_proj = nn.Linear(input_size, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, shape.hidden_size, bias=False)

    def _qkv(self, x, cos, sin) -> Projected:
        b, n, _ = x.shape
        d = self.shape.head_dim
        q = self.q_proj(x).view(b, n, -1, d).transpose(1, 2)             # [b, h, n, d]
        k = self.k_proj(x).view(b, n, -1, d).transpose(1, 2)             # [b, hk, n, d]
        v = self.v_proj(x).view(b, n, -1, d).transpose(1, 2)
        q, k = rotate(q, k, cos, sin)
        return Projected(q, k, v)

    def cached(self, x: torch.Tensor, cos, sin, cache: EngineCache) -> torch.Tensor:
        """x: [b, n, in] -> [b, n, H], attending over the cache (whose mask the caller prepared)."""
        q, k, v = self._qkv(x, cos, sin)
        out = cached_attention(cache, 0, q, k, v.to(q.dtype))                   # [b, n, h, d]
        return self.o_proj(out.reshape(x.shape[0], x.shape[1], -1))

    def ttt(self, x: torch.Tensor, cos, sin, past: list, key_valid: torch.Tensor) -> torch.Tensor:
        """One unrolled step.  x: [b, s, in]; past: (k, v) of the earlier steps (appended here);
        key_valid: [b, s] False on padding.  Returns [b, s, H].

        `scaled_dot_product_attention` over the keys of every step so far, [k0 | k1 | ... | kt], with the
        training-time-test mask, by blocks of queries (`block_visibility`): the fused kernels never hold
        the [b, h, s, s] scores in fp32 (11 GB at b=2, s=2048 over 7 steps for an 8B drafter, eagerly)."""
        out, k, v = self.ttt_step(x, cos, sin, past, key_valid)
        past.append((k, v))
        return out

    def ttt_step(self, x: torch.Tensor, cos, sin, past: list, key_valid: torch.Tensor):
        """`ttt` without appending to `past` (a pure function, so a checkpoint may run it again):
        returns the output [b, s, H] and this step's (k, v)."""
        q, k, v = self._qkv(x, cos, sin)
        past = [*past, (k, v)]
        s = x.shape[1]
        out = torch.cat([masked_attention(q[:, :, a:e], *block_keys(past, a, e, q.dtype),
                                          block_visibility(key_valid, a, e, len(past) - 1))
                         for a, e in query_blocks(s)], dim=2)                                  # [b, h, s, d]
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], s, -1)), k, v       # [b, s, H]


TTT_QUERY_BLOCK = 1024
"""Queries attended together in the training-time test.  A block of queries [a, e) reads the step-0 keys
up to e and its own positions' keys of the later steps, so its mask is [e - a, e + (e - a) * step] instead
of the whole [s, s * (step + 1)]: at 16k tokens and 4 steps the mask entries of all steps fall from 2.7 G
to 0.67 G, and the keys past e are never scored (docs/results/2026-12-05-long-sequences.md: the step's peak
memory and time, before and after).  The same attention (tests/test_eagle3.py: losses and gradients)."""


def query_blocks(seq_len: int, block: int | None = None) -> list[tuple[int, int]]:
    block = block or TTT_QUERY_BLOCK
    return [(a, min(seq_len, a + block)) for a in range(0, seq_len, block)]


def block_keys(past: list, a: int, e: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values queries [a, e) may see: the step-0 ones up to e, then each later step's at a..e."""
    keys = [past[0][0][:, :, :e]] + [kt[:, :, a:e] for kt, _ in past[1:]]
    values = [past[0][1][:, :, :e]] + [vt[:, :, a:e] for _, vt in past[1:]]
    cat = lambda parts: (torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]).to(dtype)  # noqa: E731
    return cat(keys), cat(values)


def block_visibility(key_valid: torch.Tensor, a: int, e: int, step: int) -> torch.Tensor:
    """[b, 1, e - a, e + (e - a) * step] bool: what queries [a, e) see of `block_keys`: `ttt_mask`'s
    rows a..e without the columns no query of the block can see, and the step-0 keys' padding masked."""
    rows = torch.arange(a, e, device=key_valid.device)
    causal = (torch.arange(e, device=key_valid.device)[None] <= rows[:, None]) & key_valid[:, None, :e]  # [b, n, e]
    if step == 0:
        return causal[:, None]
    diagonal = torch.eye(e - a, dtype=torch.bool, device=key_valid.device).expand(key_valid.shape[0], e - a, e - a)
    return torch.cat([causal] + [diagonal] * step, dim=-1)[:, None]


class MLP(nn.Module):
    def __init__(self, shape: LayerShape):
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def layer_layout(shape: dict, fused: bool, prefix: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one DraftLayer (names under `prefix`, shapes) from its shape fields: the one place
    its layout is written down for checkpoints, exports and imports (tests compare it with the module)."""
    H, I, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_heads"] * d, shape["num_kv_heads"] * d
    width = 2 * H if fused else H
    names = {"self_attn.q_proj.weight": (q, width), "self_attn.k_proj.weight": (kv, width),
             "self_attn.v_proj.weight": (kv, width), "self_attn.o_proj.weight": (H, q),
             "post_attention_layernorm.weight": (H,),
             "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)}
    if fused:
        names |= {"hidden_norm.weight": (H,), "input_layernorm.weight": (H,)}
    return {prefix + name: size for name, size in names.items()}


class DraftLayer(nn.Module):
    """fused=True: EAGLE-3's layer (attention over cat(norm(emb), norm(h))); False: EAGLE-1's (over h)."""

    def __init__(self, shape: LayerShape, fused: bool, norm_before_residual: bool = False):
        super().__init__()
        self.fused = fused
        self.norm_before_residual = norm_before_residual
        width = 2 * shape.hidden_size if fused else shape.hidden_size
        if fused:
            self.hidden_norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
            self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = DraftAttention(shape, width)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def _attention_input(self, hidden: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        """EAGLE-3: cat(norm(emb), norm(h)); EAGLE-1: h as it is (its input norm is removed)."""
        if self.fused:
            return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)   # [b, n, 2H]
        return hidden

    def _finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual is the un-normed input, or with norm_before_residual the normed one (hidden_norm(h))."""
        residual = self.hidden_norm(hidden).to(hidden.dtype) if self.norm_before_residual else hidden
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def cached(self, hidden, embeds, cos, sin, cache: EngineCache) -> torch.Tensor:
        """hidden, embeds: [b, n, H] -> [b, n, H]"""
        return self._finish(hidden, self.self_attn.cached(self._attention_input(hidden, embeds), cos, sin, cache))

    def ttt(self, hidden, embeds, cos, sin, past: list, key_valid, checkpointed: bool = False) -> torch.Tensor:
        """hidden, embeds: [b, s, H] -> [b, s, H] for one unrolled step; `past` gets this step's (k, v).
        checkpointed: the step's activations are not kept but recomputed in backward (the gradients are
        the same; train.gradient_checkpointing)."""
        flat = [t for kv in past for t in kv]
        if checkpointed and torch.is_grad_enabled():
            out, k, v = checkpoint(self._ttt_step, hidden, embeds, cos, sin, key_valid, *flat, use_reentrant=False)
        else:
            out, k, v = self._ttt_step(hidden, embeds, cos, sin, key_valid, *flat)
        past.append((k, v))
        return out

    def _ttt_step(self, hidden, embeds, cos, sin, key_valid, *flat_past):
        past = list(zip(flat_past[0::2], flat_past[1::2]))
        attended, k, v = self.self_attn.ttt_step(self._attention_input(hidden, embeds), cos, sin, past, key_valid)
        return self._finish(hidden, attended), k, v
