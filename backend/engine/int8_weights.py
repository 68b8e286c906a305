"""Weight-only int8 matrices with one scale per output row, for experts kept on the GPU.

A routed expert resident on the main device is read in full for every token routed to it,
so the bytes it takes there decide both how many experts fit and how fast decode reads
them. ``Int8Weight`` halves a bf16 expert: W ≈ q · scale[:, None] with q int8 [out, in] and
one scale per output row in the compute dtype (3·H·I bytes plus (2·I + H) scales per
expert; ``backend.plan.budget.resident_expert_bytes`` counts exactly this).

The product runs through ``torch._weight_int8pack_mm`` (x [T, in] in the compute dtype,
scales in the same dtype), which PyTorch implements on the CPU and, in recent releases, on
CUDA (a warp-per-output GEMV: right for decode, where few tokens reach an expert). Where that
op cannot run or would be slow (many tokens on CUDA, where cuBLAS on the widened matrix wins;
bf16 rows whose length is not a multiple of 8, on which the CPU kernel of torch 2.13 reads
out of bounds), the matrix is widened to the compute dtype for one F.linear and the row
scales applied to the product: the same numbers up to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tokens per call up to which the int8 GEMV op is used on CUDA; above it the widened matrix
# and cuBLAS are faster (the op's kernel has no tiling across tokens).
CUDA_GEMV_MAX_TOKENS = 8

_cuda_op_works: dict[torch.device, bool] = {}


class Int8Weight:
    """W ≈ q · scale[:, None]: q int8 [out, in], scale [out] in the compute dtype."""

    __slots__ = ("q", "scale")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        if q.dtype != torch.int8 or q.dim() != 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"expected int8 [out, in] and scale [out], got {q.dtype} {tuple(q.shape)} "
                             f"and {tuple(scale.shape)}")
        self.q, self.scale = q, scale

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix these bytes stand for (the reference the product is tested against)."""
        return (self.q.to(torch.float32) * self.scale.to(torch.float32)[:, None]).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T for x [..., in] in the scales' dtype; the result has x's dtype."""
        out, k = self.q.shape
        flat = x.reshape(-1, k)
        if _use_int8_op(flat, k, self.scale.dtype):
            try:
                y = torch._weight_int8pack_mm(flat.contiguous(), self.q, self.scale)
            except (RuntimeError, NotImplementedError):  # a build without the op on this device
                _cuda_op_works[flat.device] = False
                y = F.linear(flat, self.q.to(flat.dtype)) * self.scale
        else:
            y = F.linear(flat, self.q.to(flat.dtype)) * self.scale
        return y.reshape(*x.shape[:-1], out)


def _use_int8_op(x: torch.Tensor, k: int, scale_dtype: torch.dtype) -> bool:
    if x.dtype != scale_dtype:
        return False
    if x.dtype != torch.float32 and k % 8:
        return False  # torch 2.13's CPU kernel misreads such rows in bf16/fp16
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        return x.shape[0] <= CUDA_GEMV_MAX_TOKENS and _cuda_op_works.get(x.device, True)
    return False


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Per-row symmetric int8 of `w` [out, in] (any float dtype, any device).

    The scale is max|row| / 127 rounded to `dtype` (the compute dtype the product runs in),
    and q is rounded against that rounded scale, so dequantizing gives exactly the numbers
    the product uses. An all-zero row gets scale 1 and q = 0.
    """
    w32 = w.to(torch.float32)
    absmax = w32.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax)).to(dtype)
    q = torch.round(w32 / scale.to(torch.float32)[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())
