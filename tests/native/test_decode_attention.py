"""Native decode attention (one query per head over the cache) against PyTorch's SDPA in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.native_attention import decode_attention

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")

_native = native_kernels._native



# (query heads, KV heads, head size, positions): grouped 8:1 as Qwen3, 3:1 with a head size
# that is not a multiple of the vector width, one position, several runs of 256 with a
# partial last one, multi-head (1:1).
SHAPES = [(32, 4, 128, 260), (12, 4, 72, 600), (8, 8, 64, 1), (4, 1, 128, 1000), (6, 6, 16, 257)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_sdpa(isa, shape, dtype):
    hq, hkv, d, s = shape
    g = torch.Generator().manual_seed(s)
    cache_k = torch.randn(1, hkv, s + 37, d, generator=g).to(dtype)  # a cache longer than its use
    cache_v = torch.randn(1, hkv, s + 37, d, generator=g).to(dtype)
    q = (3 * torch.randn(1, hq, 1, d, generator=g)).to(dtype)  # sharp softmax: the max matters
    k, v = cache_k[:, :, :s], cache_v[:, :, :s]
    out = decode_attention(q, k, v, d**-0.5)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=d**-0.5, enable_gqa=hq != hkv)
    assert out.shape == (1, hq, 1, d) and out.dtype == dtype
    err = float((out.float() - ref).norm() / ref.norm())
    # fp32: summation order only; bf16, f16: the result is rounded once (2^-9, 2^-12 relative).
    assert err < (1e-5 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 64])
def test_a_head_gets_the_same_bits_whatever_heads_share_its_keys(isa, dtype, d):
    # Eight query heads per KV head take the kernels' four-head path, whose score sums are
    # folded eight at a time; a head alone takes the one-head path. Same additions, same order.
    g = torch.Generator().manual_seed(d)
    k = torch.randn(1, 4, 600, d, generator=g).to(dtype)
    v = torch.randn(1, 4, 600, d, generator=g).to(dtype)
    q = (3 * torch.randn(1, 32, 1, d, generator=g)).to(dtype)
    together = decode_attention(q, k, v, d**-0.5)
    for h in range(32):
        alone = decode_attention(q[:, h:h + 1], k[:, h // 8:h // 8 + 1], v[:, h // 8:h // 8 + 1], d**-0.5)
        assert torch.equal(together[:, h], alone[:, 0]), h


def test_not_taken_when_disabled_or_not_on_the_cpu(monkeypatch):
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    assert decode_attention(q, k, k, 1.0) is not None
    assert decode_attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), k, 1.0) is None  # strided rows
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    assert decode_attention(q, k, k, 1.0) is None


@pytest.mark.parametrize("shape", [(32, 4, 128, 600), (8, 8, 64, 1), (4, 1, 128, 1000)])
def test_a_float16_cache_takes_the_query_and_the_weights_in_float16(isa, shape):
    """A GGUF's cache on the CPU: llama.cpp's attention multiplies its fp16 cache with the query
    and the softmax's weights converted to fp16, and so does the kernel, over several runs of
    positions (their softmax normalised over all of them before the rounding)."""
    hq, hkv, d, s = shape
    g = torch.Generator().manual_seed(s)
    k = torch.randn(1, hkv, s, d, generator=g).half()
    v = torch.randn(1, hkv, s, d, generator=g).half()
    q = 3 * torch.randn(1, hq, 1, d, generator=g)
    out = decode_attention(q, k, v, d**-0.5)
    keys, values = (t.float().repeat_interleave(hq // hkv, 1) for t in (k, v))
    weights = torch.softmax(q.half().float() @ keys.transpose(-1, -2) * d**-0.5, -1)
    rounded = weights.half().float() @ values
    exact = weights @ values if s == 1 else F.scaled_dot_product_attention(q, keys, values, scale=d**-0.5)
    err, unrounded = (float((out - ref).norm() / ref.norm()) for ref in (rounded, exact))
    assert err < 1e-5 and (s == 1 or unrounded > 10 * err), (err, unrounded)
