"""What the native kernel tests share: the kernel sets this CPU runs, one test run per set."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.backend.engine import native_kernels

_native = native_kernels._native
# Best first (as the extension lists them): AVX-512, AVX2, portable.
ISAS = list(_native.isa_info()["supported"]) if _native else []


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test once with each kernel set this CPU supports, then restores the automatic choice."""
    _native.set_isa(request.param)
    yield request.param
    _native.set_isa("")


def bf16(t):
    """t's values rounded to bf16 (nearest even), back in fp32."""
    return t.bfloat16().float()


def gemm_on_tiles(fmt: str, acts: torch.dtype) -> bool:
    """Whether the kernel set in use multiplies `fmt`'s dequantized panels on bf16 operands
    (AMX tiles, for activations that come in bf16: every format but f32 and f16), so that its
    GEMM matches the fp32 reference on bf16-rounded weights instead."""
    return bool(_native.isa_info()["gemm_bf16"]) and acts == torch.bfloat16 and fmt not in ("f32", "f16")
