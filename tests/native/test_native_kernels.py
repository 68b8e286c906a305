"""The extension as the engine uses it (``native_kernels.py``): every kernel user goes through
it, and the dense projections and attention do not depend on the experts' module."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.backend.bench.synthetic_experts import make_host_experts, random_routing
from hybridmoe.backend.engine import native_experts, native_kernels
from hybridmoe.backend.engine.native_attention import decode_attention
from hybridmoe.backend.engine.native_linear import native_linear
from tests.test_architecture import _loads


def test_the_dense_projections_and_attention_load_no_expert_code():
    """native_linear (imported by layers.py, which experts.py imports) once took its helpers
    from native_experts, a step away from a circle through experts.py."""
    statements = "import hybridmoe.backend.engine.native_linear, hybridmoe.backend.engine.native_attention"
    assert not _loads("hybridmoe.backend.engine.native_experts", statements)
    assert not _loads("hybridmoe.backend.engine.experts", statements)


def test_without_the_extension_every_kernel_user_falls_back(monkeypatch):
    """The extension is loaded in one place: without it the experts, the dense projections and
    attention all take the PyTorch path, and doctor says why."""
    monkeypatch.setattr(native_kernels, "_native", None)
    monkeypatch.setattr(native_kernels, "_IMPORT_ERROR", "no module named hybridmoe._native")
    experts = make_host_experts(np.random.default_rng(0), "f32", 3, 64, 32, range(3))
    ids, weights = random_routing(np.random.default_rng(1), 2, 3, 2)

    assert not native_kernels.available() and not native_kernels.enabled()
    assert native_experts.try_forward(torch.randn(2, 64), ids, weights, experts) is None
    assert native_experts.native_for(experts) is None
    assert native_experts.unsupported_reason(experts) == "unavailable (no module named hybridmoe._native)"
    assert native_linear(torch.randn(8, 64), None, torch.device("cpu")) is None
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    assert decode_attention(q, k, k, 1.0) is None
    assert native_kernels.summary() == ("PyTorch reference (unavailable (no module named hybridmoe._native)): "
                                        "CPU experts and projections run far slower")


@pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")
def test_isa_is_reported():
    info = native_kernels.isa_info()
    assert info["isa"] in ("avx512_amx", "avx512_vnni", "avx2", "scalar")
    assert native_kernels.isa() == info["isa"]
    assert info["threads"] >= 1 and info["numa_nodes"] >= 1
