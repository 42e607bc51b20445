"""DFlash's drafter layer (heads/dflash.py): a Qwen3 decoder layer over the query block whose attention also
reads the context's keys and values, computed from the fused target features; and the saved tensors' layout.

Shape notation: b batch, n block tokens, m context positions, H hidden, d head dim, hk key/value heads.
"""
from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads.eagle_layer import MLP, RMSNorm, masked_attention, rotate
from draftsmith.heads.formats import VOCABULARY


class BlockAttention(nn.Module):
    """Qwen3 attention whose keys are the context's (from the fused target features) and the block's own."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        h, kv, d, H = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size
        self.q_proj = nn.Linear(H, h * d, bias=False)
        self.k_proj = nn.Linear(H, kv * d, bias=False)
        self.v_proj = nn.Linear(H, kv * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_norm_eps)
        self.k_norm = RMSNorm(d, shape.rms_norm_eps)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[b, n, heads * d] -> [b, heads, n, d]"""
        return x.view(*x.shape[:2], -1, self.shape.head_dim).transpose(1, 2)

    def context(self, c: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """c [b, m, H] (the normed fused features) -> rotated keys, values [b, hk, m, d]"""
        k = self.k_norm(self._heads(self.k_proj(c)))
        k, _ = rotate(k, k, cos, sin)
        return k, self._heads(self.v_proj(c))

    def forward(self, x, cos, sin, context_kv, mask) -> torch.Tensor:
        """x [b, n, H] (the block, normed) over context_kv ([b, hk, m, d] twice) and itself -> [b, n, H].
        mask: [b, 1, n, m + n] bool, or None for all visible."""
        q = self.q_norm(self._heads(self.q_proj(x)))
        k = self.k_norm(self._heads(self.k_proj(x)))
        q, k = rotate(q, k, cos, sin)
        keys = torch.cat([context_kv[0], k], dim=2)
        values = torch.cat([context_kv[1], self._heads(self.v_proj(x))], dim=2)
        out = masked_attention(q, keys, values, mask)          # the fused-kernel rule (heads/eagle_layer.py)
        return self.o_proj(out.to(x.dtype).transpose(1, 2).reshape(*x.shape[:2], -1))


class BlockLayer(nn.Module):
    """One Qwen3 decoder layer (pre-norm residuals) over the block, attending to the context as well."""

    def __init__(self, shape):
        super().__init__()
        self.self_attn = BlockAttention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, h, cos, sin, context_kv, mask) -> torch.Tensor:
        """h [b, n, H] (the block's residual stream) -> [b, n, H]; context_kv and mask as BlockAttention's."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, context_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def dflash_layout(config: dict) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every saved tensor, from a checkpoint's config.json alone."""
    shape, T = config["architecture"], config["target"]["hidden_size"]
    H, I, d, draft = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"], shape["draft_vocab_size"]
    q, kv = shape["num_heads"] * d, shape["num_kv_heads"] * d
    layer = {"self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H),
             "self_attn.o_proj.weight": (H, q), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
             "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
             "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    out = {"fc.weight": (H, shape["num_fused_layers"] * T), "hidden_norm.weight": (H,), "norm.weight": (H,),
           "lm_head.weight": (draft, H), VOCABULARY: (draft,)}
    for i in range(config["drafter"]["num_layers"]):
        out |= {f"layers.{i}.{name}": size for name, size in layer.items()}
    return out
