"""The native kernels on experts read from a real GGUF file: the bytes are used where the
file's read-only mapping has them (nothing copied), in the layout llama.cpp wrote."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from backend.engine import native_experts
from backend.engine.experts import (
    ExpertActivation,
    ExpertStore,
    HostExperts,
    ResidentExperts,
    experts_forward,
)
from backend.engine.gguf_weights import open_gguf
from tests.quant.tiny_gguf import rand, write_gguf

pytestmark = pytest.mark.skipif(not native_experts.available(), reason="native extension not built")

E, H, I = 6, 256, 128


@pytest.fixture(scope="module")
def gguf_experts(tmp_path_factory):
    rng = np.random.default_rng(0)
    b = "blk.0."
    tensors = {  # gguf-py quantizes q8_0 / q4_0; down in another type than gate/up, as Q4_K_M does
        b + "ffn_gate_exps.weight": (rand(rng, E, I, H, scale=0.1), T.Q4_0),
        b + "ffn_up_exps.weight": (rand(rng, E, I, H, scale=0.1), T.Q4_0),
        b + "ffn_down_exps.weight": (rand(rng, E, H, I, scale=0.1), T.Q8_0),
    }
    kv = {"qwen3moe.block_count": 1, "qwen3moe.expert_count": E, "general.name": "experts only"}
    path = tmp_path_factory.mktemp("gguf") / "experts.gguf"
    write_gguf(path, "qwen3moe", tensors, kv)
    return open_gguf(path)


def test_reads_the_mapping_in_place(gguf_experts):
    store = ExpertStore(gguf_experts, "model.layers.0.mlp", E, H, I)
    experts = HostExperts(store, [0, 2, 3, 5], torch.float32, ExpertActivation("silu"))
    native = native_experts.native_for(experts)
    assert native is not None, native_experts.unsupported_reason(experts)
    assert (native.format, native.down_format) == ("q4_0", "q8_0")
    maps = [(r.data.ctypes.data, r.data.ctypes.data + r.data.nbytes) for r in gguf_experts._readers]
    assert native._keep and all(any(a <= t.data_ptr() < b for a, b in maps) for t in native._keep)

    ref = ResidentExperts(store, experts.ids, torch.float32, "cpu", experts.act)
    rng = np.random.default_rng(1)
    for T_ in (1, 50):
        x = torch.from_numpy(rng.standard_normal((T_, H)).astype(np.float32))
        ids = torch.from_numpy(np.argsort(rng.random((T_, E)), axis=1)[:, :2].astype(np.int64))
        w = torch.rand(T_, 2)
        expected = experts_forward(x, ids, w, ref)
        for regime, tol in (("decode", 3e-2), ("prefill", 1e-5)):
            got = native.forward(x, ids, w, regime=regime)
            err = float((got - expected).norm() / expected.norm())
            assert err < tol, (T_, regime, err)
