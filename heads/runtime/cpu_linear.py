"""fp16 weights for decoding on CPUs without native bf16 (dtype float16 on a CPU).

Decoding reads every weight once per forward over a few tokens, so on a CPU it is bound by memory
bandwidth, and on AVX2 machines the fp32 BLAS switches to a slower kernel as soon as a forward
carries two tokens (measured on a 2-core AMD EPYC: a 5-token target forward took 1.5-2x a 1-token
one, and speculative decoding lost to plain decoding whatever the drafter).  FBGEMM's fp16-weight
GEMM reads half the bytes and stays flat for small blocks: on the same machine the 1-token forward
of SmolLM2-135M went from 79 to 51 ms and the 5-token one from 120 to 63 ms.

`PackedLinear` wraps an nn.Linear: blocks of at most SMALL_ROWS rows (decoding, tree verification)
use the packed fp16 weights with fp32 activations; larger ones (prefill, batched generation,
training features) use the fp32 weights as before.  The wrapped module keeps its weights, so
anything that reads `.weight` still finds them.  Where FBGEMM is missing (non-x86 builds, or a
PyTorch that removed these deprecated functions) nothing is packed and fp32 is used.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

SMALL_ROWS = 16


def fbgemm_fp16_available() -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(8, 8))
        return True
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """An nn.Linear whose small blocks run on fp16 weights packed for FBGEMM (fp32 in and out)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._packed = torch.fbgemm_pack_gemm_matrix_fp16(linear.weight.detach().float().contiguous())
        bias = linear.bias.detach().float() if linear.bias is not None else torch.zeros(linear.out_features)
        self.register_buffer("_bias", bias, persistent=False)
        with warnings.catch_warnings():
            # PyTorch warns once per process that the function is deprecated: spent here, so forward needs no
            # catch_warnings per call (measured: 12% of a one-token forward of the default target, AVX2 EPYC)
            warnings.simplefilter("ignore")
            torch.fbgemm_linear_fp16_weight_fp32_activation(torch.zeros(1, linear.in_features), self._packed,
                                                            self._bias)

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    @property
    def in_features(self) -> int:
        return self.linear.in_features

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]"""
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > SMALL_ROWS or torch.is_grad_enabled() and x.requires_grad:
            return self.linear(x)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        out = torch.fbgemm_linear_fp16_weight_fp32_activation(flat, self._packed, self._bias)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def pack_linears(model: nn.Module) -> int:
    """Wrap every nn.Linear of `model` (and its output head) in place; returns how many were wrapped."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
                count += 1
    return count
