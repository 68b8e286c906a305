"""Dense projections on the CPU through the native kernels (``native/src/dense_linear.cpp``).

When the main device is the CPU, the attention projections, shared experts, dense MLPs and
the LM head are read in full for every token, exactly like the routed experts, and PyTorch
is a poor fit for them there: its bf16 matmul on CPUs without bf16 arithmetic runs at a
fraction of the memory bandwidth (measured 2.9 GB/s for a 4096 x 2048 GEMV on the 2-core
development machine, against 12.7 GB/s in fp32), and a quantized GGUF projection would have
to be dequantized into a copy two to four times its size. ``NativeLinear`` reads the stored
matrix in place, in its own format (Q4_0 stays 4.5 bits a weight in memory), with the same
kernels as the experts: Q8 activations and integer dot products for a few tokens, dequantized
panels and an fp32 GEMM for a prompt.

Numerics: float32 accumulation and one rounding to the compute dtype, like PyTorch's bf16
matmul; quantized formats see Q8-rounded activations, like llama.cpp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from backend.engine import native_experts
from backend.engine.native_experts import Unsupported, matrix_ref, native_format


class NativeLinear(nn.Module):
    """y = x W^T (+ b) from the stored matrix `stored` [out, in] (a float tensor or a quant
    object); or, given several matrices of one format and width, their outputs side by side
    (``fused``)."""

    def __init__(self, stored: Any, bias: torch.Tensor | None = None, *, more: tuple = ()):
        super().__init__()
        matrices = (stored, *more)
        fmt = native_format(stored)
        if fmt is None or any(native_format(m) != fmt for m in more):
            raise Unsupported("storage the kernels do not read, or matrices in different formats")
        cols = int(stored.shape[1])
        if any(int(m.shape[1]) != cols for m in more):
            raise Unsupported("matrices of different widths")
        parts, keep = [], []
        for m in matrices:
            ref, kept = matrix_ref(m, fmt, int(m.shape[0]))
            parts.append((int(m.shape[0]), ref))
            keep.extend(kept)
        try:
            self.native = native_experts._native.DenseLinear(fmt, cols, parts)
        except ValueError as err:
            raise Unsupported(str(err)) from None
        self._keep = keep  # the kernels read these tensors' memory
        self._stored = matrices
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        self.out_features, self.in_features = sum(p[0] for p in parts), cols

    @classmethod
    def fused(cls, *linears: nn.Module) -> NativeLinear | None:
        """One projection computing `linears` together (outputs concatenated), or None when
        they cannot be (not all native, or formats or widths differ)."""
        if not all(isinstance(lin, NativeLinear) for lin in linears):
            return None
        stored = [m for lin in linears for m in lin._stored]
        biases = [lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears]
        any_bias = any(lin.bias is not None for lin in linears)
        try:
            return cls(stored[0], torch.cat(biases) if any_bias else None, more=tuple(stored[1:]))
        except Unsupported:
            return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.float()
        out = torch.empty((flat.shape[0], self.out_features), dtype=torch.float32)
        if flat.shape[0]:
            self.native.forward(flat.contiguous(), out)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*lead, self.out_features)


def native_linear(stored: Any, bias: torch.Tensor | None, device: torch.device) -> NativeLinear | None:
    """A NativeLinear over `stored` when the main device is the CPU and the kernels read it, else None."""
    if device.type != "cpu" or not native_experts.enabled():
        return None
    try:
        return NativeLinear(stored, bias)
    except Unsupported:
        return None
