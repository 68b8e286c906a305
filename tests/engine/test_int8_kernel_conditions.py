"""When torch's ``_weight_int8pack_mm`` reads its operands correctly, and that Int8Weight only
hands it those shapes: the conditions for every CPU variant are checked here as a pure
function (the build machines have AVX2 only), against the kernel itself on the CPU that runs
the tests, and through Int8Weight with the AVX-512 variant stood in for."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.backend.formats import int8_weights
from hybridmoe.backend.formats.int8_weights import (
    int8pack_cpu_reads_correctly,
    int8pack_cuda_reads_correctly,
    quantize_int8,
)
from tests.engine.conftest import relative_error

ALIGNED = 4096  # an address aligned for every load the kernels make


def reads(k, dtype, *, capability, machine="x86_64", x_address=ALIGNED, q_address=ALIGNED):
    return int8pack_cpu_reads_correctly(k, dtype, x_address, q_address, capability=capability, machine=machine)


def test_avx512_reads_bf16_rows_of_whole_16_element_steps_from_aligned_starts():
    for k in (16, 32, 48, 64, 4096):
        assert reads(k, torch.bfloat16, capability="AVX512")
    for k in (8, 20, 24, 40, 4104):  # multiples of 8 but not 16 are misread here, not on AVX2
        assert not reads(k, torch.bfloat16, capability="AVX512")
        assert reads(k, torch.bfloat16, capability="AVX2") == (k % 8 == 0)
    assert not reads(64, torch.bfloat16, capability="AVX512", x_address=ALIGNED + 16)
    assert not reads(64, torch.bfloat16, capability="AVX512", q_address=ALIGNED + 8)


def test_avx2_reads_bf16_rows_of_whole_8_element_steps_from_aligned_starts():
    for k in (8, 24, 40, 64):
        assert reads(k, torch.bfloat16, capability="AVX2")
    for k in (4, 12, 20, 36):
        assert not reads(k, torch.bfloat16, capability="AVX2")
    assert not reads(64, torch.bfloat16, capability="AVX2", x_address=ALIGNED + 8)
    assert reads(64, torch.bfloat16, capability="AVX2", q_address=ALIGNED + 8)  # q is read unaligned


def test_x86_reads_float32_and_float16_and_the_default_variant_element_by_element():
    for capability in ("AVX512", "AVX2"):
        for dtype in (torch.float32, torch.float16):
            assert reads(20, dtype, capability=capability, x_address=ALIGNED + 2, q_address=ALIGNED + 1)
    assert reads(20, torch.bfloat16, capability="DEFAULT", x_address=ALIGNED + 2)
    assert reads(20, torch.bfloat16, capability="VSX", machine="ppc64le")


def test_aarch64_reads_every_dtype_in_8_element_steps():
    for machine in ("aarch64", "arm64"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert reads(24, dtype, capability="DEFAULT", machine=machine, x_address=ALIGNED + 2)
            assert not reads(20, dtype, capability="SVE256", machine=machine)


def test_cuda_indexes_in_32_bits():
    assert int8pack_cuda_reads_correctly(8, 7168, 2048)
    assert int8pack_cuda_reads_correctly(1, 20, 48)  # any k: the kernel loops over all of it
    assert not int8pack_cuda_reads_correctly(8, 1 << 28, 1)
    assert not int8pack_cuda_reads_correctly(1, 1 << 16, 1 << 15)


def _padded(t: torch.Tensor, fill: float) -> torch.Tensor:
    """`t` as a contiguous view at the start of a longer buffer whose tail holds `fill`, so
    that a kernel reading past the end of `t` reads `fill` (and stays inside the buffer)."""
    buf = torch.full((t.numel() + 64,), fill, dtype=t.dtype)
    buf[: t.numel()] = t.reshape(-1)
    return buf[: t.numel()].view(t.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_condition_is_the_kernels_on_this_cpu(dtype):
    """On the CPU running the tests, the op is exact where the condition says so, and where
    it does not, it really reads past the row (so the condition is neither loose nor too
    strict). One row of x and of q: every row starts aligned, so only the length matters."""
    capability, machine = torch.backends.cpu.get_cpu_capability(), platform.machine()
    g = torch.Generator().manual_seed(3)
    for k in range(4, 69, 4):
        x = _padded(torch.randn(1, k, generator=g).to(dtype), 1000.0)
        w = quantize_int8(torch.randn(1, k, generator=g), dtype)
        q, scale = _padded(w.q, 100), w.scale
        ref = F.linear(x.float(), w.dequantize())
        got = torch._weight_int8pack_mm(x, q, scale).float()
        error = relative_error(got, ref)
        if int8pack_cpu_reads_correctly(k, dtype, x.data_ptr(), q.data_ptr(), capability=capability, machine=machine):
            assert error < 1e-2, f"k={k} {dtype} on {capability}/{machine}: the op is off by {error:.3g}"
        else:
            assert error > 1, (f"k={k} {dtype} on {capability}/{machine}: the kernel now reads such rows "
                               "correctly; int8pack_cpu_reads_correctly can allow them")


def test_int8_weight_routes_around_the_avx512_misread(monkeypatch):
    """With the AVX-512 variant stood in for (this machine may lack it), a bf16 matrix of
    k = 24 (a multiple of AVX2's step, not of AVX-512's) is multiplied without the op, and
    one of k = 32 still with it."""
    monkeypatch.setattr(int8_weights, "_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(int8_weights.platform, "machine", lambda: "x86_64")
    calls = []
    real = torch._weight_int8pack_mm

    def spy(x, q, scale):
        calls.append(q.shape[1])
        return real(x, q, scale)

    monkeypatch.setattr(torch, "_weight_int8pack_mm", spy)
    g = torch.Generator().manual_seed(4)
    for k in (24, 32):
        w = quantize_int8(torch.randn(48, k, generator=g), torch.bfloat16)
        x = torch.randn(3, k, generator=g).to(torch.bfloat16)
        assert relative_error(w.linear(x), F.linear(x.float(), w.dequantize())) < 1e-2
    assert calls == [32]
