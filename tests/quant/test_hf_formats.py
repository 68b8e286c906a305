"""Safetensors quantization layouts: DeepSeek fp8 blocks and GPT-OSS MXFP4 (int4: test_int4.py).

Each is checked against an independent reference: a per-block loop for fp8, transformers'
conversion for MXFP4 (plus hand-computed values and the GGUF MXFP4 layout holding the same
numbers).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from hybridmoe.backend.formats.quant import (
    QuantTensor,
    from_compressed_int4,
    from_fp8_block,
    from_gguf,
    from_mxfp4,
)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- fp8 block (DeepSeek-V3 weight_scale_inv) -------------------------------------------


def _fp8_case(shape, seed=0):
    gen = _gen(seed)
    w = (torch.randn(shape, generator=gen) * 3).to(torch.float8_e4m3fn)
    sshape = (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    s = torch.rand(sshape, generator=gen) * 0.01 + 1e-4
    return w, s


def _fp8_reference(w, s):
    """Weight times the scale of its 128x128 block, one block at a time."""
    out = torch.empty(w.shape, dtype=torch.float32)
    rows, cols = w.shape[-2:]
    for bi in range(math.ceil(rows / 128)):
        for bj in range(math.ceil(cols / 128)):
            r, c = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
            out[..., r, c] = w[..., r, c].float() * s[..., bi, bj, None, None]
    return out


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (3, 130, 260)])
def test_fp8_block_matches_per_block_reference(shape):
    w, s = _fp8_case(shape)
    q = from_fp8_block(w, s)
    assert q.format == "fp8_block" and tuple(q.shape) == shape
    assert q.nbytes == w.numel() + s.numel() * 4
    ref = _fp8_reference(w, s)
    torch.testing.assert_close(q.dequantize(), ref, rtol=0, atol=0)
    torch.testing.assert_close(q.dequantize(torch.bfloat16), ref.to(torch.bfloat16), rtol=0, atol=0)


def test_fp8_block_slicing():
    w, s = _fp8_case((3, 300, 200), seed=1)
    q = from_fp8_block(w, s)
    ref = _fp8_reference(w, s)
    torch.testing.assert_close(q[1].dequantize(), ref[1], rtol=0, atol=0)  # one expert
    torch.testing.assert_close(q[1:3].dequantize(), ref[1:3], rtol=0, atol=0)
    assert q[2].parts["weight"].data_ptr() == w[2].data_ptr()
    m = q[0]  # 2-D: row slices keep the scale rows that cover them
    for a, b in ((0, 300), (130, 290), (5, 6), (128, 256), (250, 300)):
        torch.testing.assert_close(m[a:b].dequantize(), ref[0, a:b], rtol=0, atol=0)
    torch.testing.assert_close(m[100:290][40:60].dequantize(), ref[0, 140:160], rtol=0, atol=0)
    with pytest.raises(IndexError):
        m[3]  # a single row of a 2-D block-scaled tensor has no clean scale view
    with pytest.raises(ValueError):
        from_fp8_block(w[0], s[0, :2])  # scale grid does not cover 300 rows


# ---- MXFP4, GPT-OSS checkpoint layout --------------------------------------------------


def _mxfp4_case(seed, experts=2, out=6, groups=4):
    gen = _gen(seed)
    blocks = torch.randint(0, 256, (experts, out, groups, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (experts, out, groups), dtype=torch.uint8, generator=gen)
    return blocks, scales


def test_mxfp4_hand_computed_values():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21  # element 0 = code 1 (+0.5), element 1 = code 2 (+1.0)
    blocks[0, 0, 1] = 0xF8  # element 2 = code 8 (-0), element 3 = code 15 (-6.0)
    blocks[0, 0, 15] = 0x7B  # element 30 = code 11 (-1.5), element 31 = code 7 (+6.0)
    for e, factor in ((127, 1.0), (128, 2.0), (125, 0.25)):
        q = from_mxfp4(blocks, torch.full((1, 1), e, dtype=torch.uint8))
        assert q.format == "mxfp4" and q.layout == "hf" and tuple(q.shape) == (1, 32)
        v = q.dequantize()[0]
        assert v[:4].tolist() == [0.5 * factor, 1.0 * factor, 0.0, -6.0 * factor]
        assert v[30:].tolist() == [-1.5 * factor, 6.0 * factor]
        assert torch.signbit(v[2])  # negative zero is kept
    tiny = from_mxfp4(blocks, torch.zeros(1, 1, dtype=torch.uint8)).dequantize()[0]
    assert tiny[1].item() == 2.0 ** -127  # e8m0 0 is 2**-127 (denormal in fp32), not zero
    assert torch.isnan(from_mxfp4(blocks, torch.full((1, 1), 255, dtype=torch.uint8)).dequantize()).all()


def test_mxfp4_matches_transformers_conversion():
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _mxfp4_case(5)
    q = from_mxfp4(blocks, scales)
    assert tuple(q.shape) == (2, 6, 128) and q.nbytes == blocks.numel() + scales.numel()
    # transformers dequantizes to GptOss' x @ W layout [E, in, out]; ours is [E, out, in].
    ref = mx.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.float32)
    torch.testing.assert_close(q.dequantize(), ref.transpose(1, 2), rtol=0, atol=0)
    ref16 = mx.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    torch.testing.assert_close(q.dequantize(torch.bfloat16), ref16.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(q[1].dequantize(), ref[1].T, rtol=0, atol=0)


def test_mxfp4_hf_and_gguf_layouts_hold_the_same_numbers():
    """Repack HF blocks into ggml's MXFP4 blocks (scale byte first; elements 0-15 in the low
    nibbles, 16-31 in the high ones) as llama.cpp's converter does: same values."""
    blocks, scales = _mxfp4_case(6)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    ggml_qs = codes[..., :16] | (codes[..., 16:] << 4)
    ggml = torch.cat((scales.unsqueeze(-1), ggml_qs), dim=-1).reshape(2, 6, 4 * 17).numpy()
    g = from_gguf(ggml, T.MXFP4)
    assert g.layout == "gguf" and g.format == "mxfp4"
    torch.testing.assert_close(g.dequantize(), from_mxfp4(blocks, scales).dequantize(), rtol=0, atol=0)
    np.testing.assert_array_equal(g.dequantize().numpy(), gq.dequantize(ggml, T.MXFP4))


def test_constructor_validation():
    with pytest.raises(ValueError):
        from_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError):
        from_compressed_int4(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(4, 2), (4, 72))
    with pytest.raises(ValueError):
        from_fp8_block(torch.zeros(4, 4), torch.ones(1, 1))  # not fp8
    assert isinstance(from_fp8_block(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), torch.ones(1, 1)), QuantTensor)
