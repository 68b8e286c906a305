"""Weight-only int8 matrices with one scale per output row, for experts kept on the GPU.

A routed expert resident on the main device is read in full for every token routed to it,
so the bytes it takes there decide both how many experts fit and how fast decode reads
them. ``Int8Weight`` halves a bf16 expert: W ≈ q · scale[:, None] with q int8 [out, in] and
one scale per output row in the compute dtype (3·H·I bytes plus (2·I + H) scales per
expert; ``hybridmoe.backend.plan.budget.resident_expert_bytes`` counts exactly this).

The product runs through ``torch._weight_int8pack_mm`` (x [T, in] in the compute dtype,
scales in the same dtype), which PyTorch implements on the CPU and, in recent releases, on
CUDA (a GEMV: right for decode, where few tokens reach an expert). Where that op cannot run,
would be slow (many tokens on CUDA, where cuBLAS on the widened matrix wins) or would read
the wrong bytes (``int8pack_cpu_reads_correctly``, ``int8pack_cuda_reads_correctly``), the
matrix is widened to the compute dtype for one F.linear and the row scales applied to the
product: the same numbers up to rounding.
"""

from __future__ import annotations

import platform
from functools import cache

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
        flat = x.reshape(-1, k).contiguous()
        if _use_int8_op(flat, self.q, self.scale):
            try:
                # Some CUDA builds return float32 whatever x's dtype; the CPU keeps x's.
                y = torch._weight_int8pack_mm(flat, self.q, self.scale).to(flat.dtype)
            except (RuntimeError, NotImplementedError):  # a build without the op on this device
                _cuda_op_works[flat.device] = False
                y = F.linear(flat, self.q.to(flat.dtype)) * self.scale
        else:
            y = F.linear(flat, self.q.to(flat.dtype)) * self.scale
        return y.reshape(*x.shape[:-1], out)


def _use_int8_op(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> bool:
    if x.dtype != scale.dtype or not (q.is_contiguous() and scale.is_contiguous()):
        return False
    if x.device.type == "cpu":
        return int8pack_cpu_reads_correctly(x.shape[1], x.dtype, x.data_ptr(), q.data_ptr(),
                                            capability=_cpu_capability(), machine=platform.machine())
    if x.device.type == "cuda":
        return (x.shape[0] <= CUDA_GEMV_MAX_TOKENS and _cuda_op_works.get(x.device, True)
                and int8pack_cuda_reads_correctly(x.shape[0], x.shape[1], q.shape[0]))
    return False


@cache
def _cpu_capability() -> str:
    """The kernel variant PyTorch dispatches to on this CPU: "AVX512", "AVX2", "DEFAULT", ..."""
    return torch.backends.cpu.get_cpu_capability()


def int8pack_cpu_reads_correctly(k: int, dtype: torch.dtype, x_address: int, q_address: int, *,
                                 capability: str, machine: str) -> bool:
    """Whether torch's CPU ``_weight_int8pack_mm`` reads x [T, k] at `x_address` and q [N, k]
    at `q_address` as they are, given the ISA variant it dispatches to (`capability`, as
    ``torch.backends.cpu.get_cpu_capability()`` names it) and the CPU architecture (`machine`,
    as ``platform.machine()`` names it).

    From aten/src/ATen/native/cpu/int8mm_kernel.cpp as torch 2.13 builds it: the output is cut
    into 4 x 4 blocks (any T and N: partial blocks have their own instantiations), and each
    block's dot products step over k a whole vector at a time with no loop for a remainder,
    so a row whose length is not a multiple of the step is read past its end (into the next
    row, or past the tensor: on AVX-512 a bf16 k = 24 gave values near 1e37):
      - x86-64, AVX512 variant, bf16 only: 16 elements a step; x loaded with the aligned
        ``_mm256_load_si256`` (32 bytes) and q with the aligned ``_mm_load_si128`` (16);
      - x86-64, AVX2 variant, bf16 only: 8 a step; x with the aligned ``_mm_load_si128``
        (16 bytes), q with the unaligned ``_mm_loadu_si64``;
      - x86-64 float32 and float16, and other variants (DEFAULT): a scalar loop over k;
      - aarch64, every dtype (bf16, fp16, fp32): NEON, 8 a step, unaligned ``vld1`` loads;
      - other architectures (ppc64le, s390x): the scalar loop.
    The row starts' alignment counts too: an aligned load from a misaligned address faults
    (unless the compiler folded it into an instruction that does not check).
    """
    arch = machine.lower()
    if arch in ("aarch64", "arm64"):
        return k % 8 == 0
    if arch not in ("x86_64", "amd64") or dtype != torch.bfloat16:
        return True
    if capability == "AVX512":
        return k % 16 == 0 and x_address % 32 == 0 and q_address % 16 == 0
    if capability == "AVX2":
        return k % 8 == 0 and x_address % 16 == 0
    return True


def int8pack_cuda_reads_correctly(tokens: int, k: int, out: int) -> bool:
    """Whether torch's CUDA ``_weight_int8pack_mm`` (aten/src/ATen/native/cuda/int8mm.cu: one
    thread an output, a loop over all of k, so any k) indexes x [tokens, k] and q [out, k]
    correctly: it computes ``b * K + k`` and ``n * K + k`` in 32-bit ints."""
    return tokens * k < 2**31 and out * k < 2**31


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
