"""GPU experts kept in their stored 4-bit form (``int4_weights``): the codes and group scales of
every 4-bit format read out exactly (Q4_K and IQ4_XS scales rounded to fp16, within the stated
2^-11), the bytes the planner counts, rows joined as the engine fuses gate and up, and the
product on the CPU (the GPU's decode kernels are tested in tests/engine/test_decode_experts.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from hybridmoe.backend.formats import quant
from hybridmoe.backend.formats.int4_weights import Int4Weight, _gguf_parts, cat_rows, from_quant
from hybridmoe.backend.models.formats import int4_resident_layout

EXACT = (Q.Q4_0, Q.Q4_1, Q.IQ4_NL, Q.MXFP4)
ROUNDED = (Q.Q4_K, Q.IQ4_XS)  # a group's scale is a product of two stored numbers


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF bytes of a [rows, cols] tensor: random codes and sub-scales, with the fp16
    super-scales (d, and dmin/m where the type has them) set to finite values of both signs."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    halves = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.IQ4_NL: (0,), Q.Q4_K: (0, 2), Q.IQ4_XS: (0,)}.get(qtype, ())
    for offset in halves:
        d = (rng.standard_normal(len(data)) * 0.01).astype(np.float16)
        data[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == Q.MXFP4:
        data[:, 0] = rng.integers(110, 135, size=len(data))  # e8m0 exponents near 2^0
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", EXACT + ROUNDED, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(16, 256), (3, 512)])
def test_gguf_codes_and_scales_are_the_stored_ones(qtype, shape):
    rows, cols = shape
    stored = quant.from_gguf(random_blocks(qtype, rows, cols), qtype, shape)
    w = from_quant(stored)
    group, has_min = int4_resident_layout(qtype.name)
    assert w.shape == shape and w.group == group == 32 and (w.min is not None) == has_min
    assert w.codes.shape == (rows, cols // 2) and w.scale.dtype in (torch.float16, torch.bfloat16)
    ref = stored.dequantize()
    got = w.dequantize()
    if qtype in EXACT:
        assert torch.equal(got, ref)
        assert w.nbytes == stored.nbytes or qtype == Q.MXFP4  # MXFP4: a 2-byte scale for its 1-byte exponent
    else:
        # The exact group scale (and min) in float32, and the 2^-11 its fp16 rounding may cost.
        b = stored.parts["data"].reshape(-1, GGML_QUANT_SIZES[qtype][1])
        _, scale, mins, table = _gguf_parts(qtype.name.lower(), b)
        peak = 127.0 if table == "iq4" else 15.0
        bound = (peak * scale.abs() + (mins.abs() if mins is not None else 0)).reshape(rows, -1, 1) * 2**-11
        assert torch.all((got - ref).abs().reshape(rows, -1, 32) <= bound * 1.0001)
    assert w.nbytes == rows * cols // 2 + rows * cols // 32 * 2 * (2 if has_min else 1)


def test_compressed_int4_and_hf_mxfp4_are_exact():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(-(2**31), 2**31 - 1, (24, 128 // 8), dtype=torch.int32, generator=g)
    scale = (torch.rand(24, 128 // 32, generator=g) * 0.02).to(torch.bfloat16)
    int4 = quant.from_compressed_int4(packed, scale, (24, 128))
    w = from_quant(int4)
    assert w.table == "int" and torch.equal(w.dequantize(), int4.dequantize())
    assert w.nbytes == int4.nbytes  # Kimi's experts take on a card what they take on disk
    blocks = torch.randint(0, 256, (24, 4, 16), dtype=torch.uint8, generator=g)
    exps = torch.randint(100, 140, (24, 4), dtype=torch.uint8, generator=g)
    mx = quant.from_mxfp4(blocks, exps)
    assert torch.equal(from_quant(mx).dequantize(), mx.dequantize())
    # Formats with more than 4 bits have no such form.
    assert from_quant(quant.from_gguf(random_blocks(Q.Q8_0, 4, 64), Q.Q8_0, (4, 64))) is None


def test_rows_join_as_gate_and_up_fuse():
    gate = from_quant(quant.from_gguf(random_blocks(Q.Q4_0, 4, 64, seed=2), Q.Q4_0, (4, 64)))
    up = from_quant(quant.from_gguf(random_blocks(Q.Q4_0, 4, 64, seed=3), Q.Q4_0, (4, 64)))
    fused = cat_rows([gate, up])
    assert torch.equal(fused.dequantize(), torch.cat((gate.dequantize(), up.dequantize())))
    interleaved = cat_rows([gate, up], interleave=True)
    assert torch.equal(interleaved.dequantize()[0::2], gate.dequantize())
    assert torch.equal(interleaved.dequantize()[1::2], up.dequantize())
    other = from_quant(quant.from_gguf(random_blocks(Q.Q4_1, 4, 64), Q.Q4_1, (4, 64)))
    assert cat_rows([gate, other]) is None  # different tables: the caller widens instead
    with pytest.raises(ValueError):
        Int4Weight(gate.codes, gate.scale[:, :1], None, "int", 32)


def test_the_product_on_the_cpu_is_the_dequantized_matrix_product():
    w = from_quant(quant.from_gguf(random_blocks(Q.Q4_K, 8, 256), Q.Q4_K, (8, 256)))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(w.linear(x), torch.nn.functional.linear(x, w.dequantize()))
