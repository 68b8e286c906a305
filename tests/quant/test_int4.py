"""compressed-tensors ``pack-quantized`` int4 (Kimi K2.x) against the library itself.

compressed-tensors is the reference: its compressor packs the test weights, and its
decompressor (unpack + dequantize) gives the values ours must equal bit for bit in bf16.
The module is skipped where it is not installed (``pip install compressed-tensors``).
"""

from __future__ import annotations

import pytest
import torch

from hybridmoe.backend.formats.quant import from_compressed_int4

pytest.importorskip("compressed_tensors", reason="pip install compressed-tensors for the int4 reference")

from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme


def _gen(seed):
    return torch.Generator().manual_seed(seed)


_INT4 = QuantizationScheme(
    targets=["Linear"],
    weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
)


def _ct_compress(weight, scale):
    return PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, _INT4)


def _ct_decompress(sd):
    return PackedQuantizationCompressor.decompress(dict(sd), _INT4)["weight"]


@pytest.mark.parametrize("shape", [(64, 128), (48, 96)])
def test_int4_matches_compressed_tensors(shape):
    gen = _gen(2)
    w = torch.randn(shape, generator=gen).to(torch.bfloat16)
    scale = (w.float().reshape(shape[0], -1, 32).abs().amax(-1) / 7).to(torch.bfloat16)
    sd = _ct_compress(w, scale)
    q = from_compressed_int4(sd["weight_packed"], sd["weight_scale"], sd["weight_shape"])
    assert q.format == "int4_g32" and tuple(q.shape) == shape and q.meta["group_size"] == 32
    assert q.nbytes == sd["weight_packed"].numel() * 4 + sd["weight_scale"].numel() * 2
    ref = _ct_decompress(sd)  # compressed-tensors' own unpack + dequantize (bf16)
    torch.testing.assert_close(q.dequantize(torch.bfloat16), ref, rtol=0, atol=0)
    torch.testing.assert_close(q.dequantize(), ref.float(), rtol=0, atol=2.0 ** -7 * ref.float().abs().max().item())


def test_int4_sign_convention_on_every_code():
    """A weight that is exactly q*scale for q = -8..7 comes back exactly (no off-by-8, no sign flip)."""
    out, cols = 16, 64
    codes = torch.arange(out * cols).reshape(out, cols) % 16 - 8
    scale = (torch.rand(out, cols // 32, generator=_gen(3)) + 0.5).to(torch.bfloat16)
    w = (codes.float() * scale.float().repeat_interleave(32, -1)).to(torch.bfloat16)
    sd = _ct_compress(w, scale)
    q = from_compressed_int4(sd["weight_packed"], sd["weight_scale"], sd["weight_shape"])
    torch.testing.assert_close(q.dequantize(torch.bfloat16), w, rtol=0, atol=0)


def test_int4_merged_experts_and_slices():
    gen = _gen(4)
    packed, scales, refs = [], [], []
    for _ in range(3):
        w = torch.randn(32, 64, generator=gen).to(torch.bfloat16)
        scale = (w.float().reshape(32, 2, 32).abs().amax(-1) / 7).to(torch.bfloat16)
        sd = _ct_compress(w, scale)
        packed.append(sd["weight_packed"]), scales.append(sd["weight_scale"]), refs.append(_ct_decompress(sd))
    q = from_compressed_int4(torch.stack(packed), torch.stack(scales), (3, 32, 64))
    ref = torch.stack(refs)
    torch.testing.assert_close(q.dequantize(torch.bfloat16), ref, rtol=0, atol=0)
    torch.testing.assert_close(q[2].dequantize(torch.bfloat16), ref[2], rtol=0, atol=0)
    torch.testing.assert_close(q[0][5:9].dequantize(torch.bfloat16), ref[0, 5:9], rtol=0, atol=0)
    assert q[1].parts["weight_packed"].data_ptr() == q.parts["weight_packed"][1].data_ptr()
