"""The native kernels on experts read from a real GGUF file: every matrix is copied once out
of the file's read-only mapping (and its pages there let go), q4_0 into the row-interleaved
layout, a format without one (f16 here) as stored, into memory that can have huge pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from hybridmoe.backend.engine import native_experts, native_kernels
from hybridmoe.backend.engine.experts import (
    ExpertActivation,
    ExpertStore,
    HostExperts,
    ResidentExperts,
    experts_forward,
)
from hybridmoe.backend.formats.gguf_weights import open_gguf
from tests.native.test_native_experts import q8
from tests.quant.tiny_gguf import rand, write_gguf

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")

E, H, I = 6, 256, 128


@pytest.fixture(scope="module")
def gguf_experts(tmp_path_factory):
    rng = np.random.default_rng(0)
    b = "blk.0."
    tensors = {  # down in another type than gate/up, as Q4_K_M does
        b + "ffn_gate_exps.weight": (rand(rng, E, I, H, scale=0.1), T.Q4_0),
        b + "ffn_up_exps.weight": (rand(rng, E, I, H, scale=0.1), T.Q4_0),
        b + "ffn_down_exps.weight": (rand(rng, E, H, I, scale=0.1), T.F16),
    }
    kv = {"qwen3moe.block_count": 1, "qwen3moe.expert_count": E, "general.name": "experts only"}
    path = tmp_path_factory.mktemp("gguf") / "experts.gguf"
    write_gguf(path, "qwen3moe", tensors, kv)
    return open_gguf(path)


def test_copies_the_mapping_once(gguf_experts):
    store = ExpertStore(gguf_experts, "model.layers.0.mlp", E, H, I)
    experts = HostExperts(store, [0, 2, 3, 5], torch.float32, ExpertActivation("silu"))
    native = native_experts.native_for(experts)
    assert native is not None, native_experts.unsupported_reason(experts)
    assert (native.format, native.down_format) == ("q4_0", "f16")
    # q4_0 gate/up are copied into the interleaved layout, the f16 down as it is stored.
    assert (native.layer.format, native.layer.down_format) == ("q4_0x8", "f16")
    assert native.layer.interleaved_bytes == len(experts.ids) * (2 * I * H // 32 * 18 + H * I * 2)
    maps = [(r.data.ctypes.data, r.data.ctypes.data + r.data.nbytes) for r in gguf_experts._readers]
    assert native._keep and all(any(a <= t.data_ptr() < b for a, b in maps) for t in native._keep)

    ref = ResidentExperts(store, experts.ids, torch.float32, "cpu", experts.act)
    rng = np.random.default_rng(1)
    for T_ in (1, 50):
        x = torch.from_numpy(rng.standard_normal((T_, H)).astype(np.float32))
        ids = torch.from_numpy(np.argsort(rng.random((T_, E)), axis=1)[:, :2].astype(np.int64))
        w = torch.rand(T_, 2)
        expected = experts_forward(x, ids, w, ref)
        # The prefill GEMM of q4_0's gate and up on x's Q8_0 values (llama.cpp's), of f16's
        # down on the intermediate as it is.
        assert float((native.forward(x, ids, w, regime="prefill") - experts_forward(q8(x), ids, w, ref)).norm()
                     / expected.norm()) < 1e-5
        for regime, tol in (("decode", 3e-2), ("prefill", 3e-2)):
            got = native.forward(x, ids, w, regime=regime)
            err = float((got - expected).norm() / expected.norm())
            assert err < tol, (T_, regime, err)


def _mapping_rss(path: str) -> int:
    """Resident bytes of this process's mappings of `path` (/proc/self/smaps)."""
    rss, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            inside = len(head) >= 6 and head[5] == path
        elif inside and head[0] == "Rss:":
            rss += int(head[1]) * 1024
    return rss


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_the_copy_lets_go_of_the_source_pages(tmp_path):
    """After the interleaved copy, the q4_0 and q8_0 pages of the read-only mapping are dropped:
    the process holds the experts once, not twice."""
    rng = np.random.default_rng(2)
    e, h, i = 8, 1024, 512  # gate/up: 8 x 2 x 288 KB, whole pages to drop
    b = "blk.0."
    tensors = {b + "ffn_gate_exps.weight": (rand(rng, e, i, h, scale=0.1), T.Q4_0),
               b + "ffn_up_exps.weight": (rand(rng, e, i, h, scale=0.1), T.Q4_0),
               b + "ffn_down_exps.weight": (rand(rng, e, h, i, scale=0.1), T.Q8_0)}
    path = tmp_path / "experts.gguf"
    write_gguf(path, "qwen3moe", tensors, {"qwen3moe.block_count": 1, "qwen3moe.expert_count": e})
    weights = open_gguf(path)
    store = ExpertStore(weights, "model.layers.0.mlp", e, h, i)
    experts = HostExperts(store, range(e), torch.float32, ExpertActivation("silu"))
    for ex in range(e):  # fault every expert page in, as reading the file at load would
        for name in ("gate", "up", "down"):
            store.stored(ex)[name].parts["data"].sum()
    before = _mapping_rss(str(path))
    native = native_experts.NativeExperts(experts)
    after = _mapping_rss(str(path))
    copied = native.layer.interleaved_bytes
    assert copied == e * (2 * i * h // 32 * 18 + h * i // 32 * 34)
    assert before - after >= copied - 2 * e * 3 * 4096, (before, after, copied)  # all but partial pages at the ends
