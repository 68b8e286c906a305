"""Dense projections on the CPU through the native kernels (``native/src/dense_linear.cpp``).

When the main device is the CPU, the attention projections, shared experts, dense MLPs and
the LM head are read in full for every token, exactly like the routed experts, and PyTorch
is a poor fit for them there: its bf16 matmul on CPUs without bf16 arithmetic runs at a
fraction of the memory bandwidth (measured 2.9 GB/s for a 4096 x 2048 GEMV on the 2-core
development machine, against 12.7 GB/s in fp32), and a quantized GGUF projection would have
to be dequantized into a copy two to four times its size. ``NativeLinear`` reads the stored
matrix in its own format (Q4_0 stays 4.5 bits a weight in memory), with the same kernels as
the experts: Q8 activations and integer dot products for a few tokens, dequantized panels
and an fp32 GEMM for a prompt. In place, except q4_0 / iq4_nl / iq4_xs / int4_g32 / q4_k / q8_0, which are copied
once into the row-interleaved layout (``native/src/repack.h``) whose integer path wins at
every token count.

Numerics: float32 accumulation and one rounding to the compute dtype, like PyTorch's bf16
matmul; quantized formats see Q8-rounded activations, like llama.cpp.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.native_kernels import Unsupported, matrix_ref, native_format


class NativeLinear(nn.Module):
    """y = x W^T (+ b) from the stored matrix `stored` [out, in] (a float tensor or a quant
    object); or, given several matrices of one width, their outputs side by side (``fused``)."""

    runs_native: ClassVar[bool] = True

    def __init__(self, stored: Any, bias: torch.Tensor | None = None, *, interleave: bool = True,
                 dtype: torch.dtype | None = None):
        super().__init__()
        fmt = native_format(stored)
        if fmt is None:
            raise Unsupported("storage the kernels do not read")
        rows, cols = int(stored.shape[0]), int(stored.shape[1])
        ref, keep = matrix_ref(stored, fmt, rows)
        try:
            native = native_kernels._native.DenseLinear(fmt, cols, [(rows, ref)], interleave)
        except ValueError as err:
            raise Unsupported(str(err)) from None
        self._setup(native, bias, keep, dtype)

    def _setup(self, native: Any, bias: torch.Tensor | None, keep: list, dtype: torch.dtype | None) -> None:
        self.native = native
        self.dtype = dtype  # of the outputs (None: the input's)
        self._keep = keep  # what the kernels read: the stored tensors, or the joined projections
        self.register_buffer("bias", None if bias is None else bias.float(), persistent=False)
        self.out_features, self.in_features = int(native.rows), int(native.cols)

    @classmethod
    def fused(cls, *linears: nn.Module) -> NativeLinear | None:
        """One projection computing `linears` together (outputs concatenated) in one call,
        reading their matrices (no second copy), each in its own format and layout (a K-quant
        mix keeps v in Q6_K beside a Q4_K q and k); None when they cannot be (not all native,
        or widths differ)."""
        if not all(lin.runs_native for lin in linears):
            return None
        try:
            native = native_kernels._native.DenseLinear.join([lin.native for lin in linears])
        except ValueError:
            return None
        biases = [lin.bias if lin.bias is not None else torch.zeros(lin.out_features) for lin in linears]
        any_bias = any(lin.bias is not None for lin in linears)
        joined = cls.__new__(cls)
        nn.Module.__init__(joined)
        dtypes = {lin.dtype for lin in linears}
        joined._setup(native, torch.cat(biases) if any_bias else None, list(linears),
                      dtypes.pop() if len(dtypes) == 1 else None)
        return joined

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` [n] in `dtype`, each dequantized from its stored blocks in float32: an
        embedding lookup (llama.cpp's get_rows) on a table held as stored."""
        out = torch.empty((ids.numel(), self.in_features), dtype=torch.float32)
        if ids.numel():
            self.native.dequantize_rows(ids.reshape(-1).tolist(), out.numpy())
        return out.to(dtype)

    def forward(self, x: torch.Tensor, *, float32: bool = False) -> torch.Tensor:
        """float32: the kernels' float32 output as it is, not rounded to the compute dtype
        (logits). x may be float32 where the compute dtype is not (a norm's output, ``RMSNorm``)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.dtype not in (torch.float32, torch.bfloat16):
            flat = flat.float()
        out = torch.empty((flat.shape[0], self.out_features), dtype=torch.float32)
        if flat.shape[0]:
            self.native.forward(flat.contiguous(), out, native_kernels.dense_threshold())
        if self.bias is not None:
            out += self.bias
        return (out if float32 else out.to(self.dtype or x.dtype)).reshape(*lead, self.out_features)


def native_linear(stored: Any, bias: torch.Tensor | None, device: torch.device,
                  dtype: torch.dtype | None = None) -> NativeLinear | None:
    """A NativeLinear over `stored` with outputs in `dtype` when the main device is the CPU and
    the kernels read it, else None."""
    if device.type != "cpu" or not native_kernels.enabled():
        return None
    try:
        return NativeLinear(stored, bias, dtype=dtype)
    except Unsupported:
        return None
