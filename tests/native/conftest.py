"""What the native kernel tests share: the kernel sets this CPU runs, one test run per set."""

from __future__ import annotations

import pytest

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
