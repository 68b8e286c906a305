"""GGUF block types against gguf-py's numpy reference (gguf.quants, a port of ggml-quants.c).

Types gguf-py can quantize are tested on random floats quantized by it; for the others
(K-quants, IQ4_*) any byte pattern is a valid block once its fp16 scales are finite, so
random blocks are built byte-wise. Everything must match bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from hybridmoe.backend.formats import quant
from hybridmoe.backend.formats.quant import QuantTensor, from_gguf, linear
from hybridmoe.backend.errors import UnsupportedModelError

QUANTIZABLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4]
# byte offsets of the fp16 fields (d, dmin) inside one block
BYTE_BUILT = {
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
}


def _random_floats(rng, shape):
    # rows of very different magnitudes, so scales span a wide fp16 range
    x = rng.standard_normal(shape).astype(np.float32)
    return x * (10.0 ** rng.uniform(-3, 2, size=shape[:-1] + (1,))).astype(np.float32)


def _random_blocks(rng, qtype, shape):
    """Random valid GGUF bytes for a tensor of logical `shape` (torch order)."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for off in BYTE_BUILT[qtype]:
        # finite scales of both signs, including fp16 subnormals and the largest normals
        d = rng.uniform(-1, 1, n_blocks) * (10.0 ** rng.uniform(-6, 4.8, n_blocks))
        raw[:, off : off + 2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def _quantized(qtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if qtype in BYTE_BUILT:
        return _random_blocks(rng, qtype, shape)
    return gq.quantize(_random_floats(rng, shape), qtype)


@pytest.mark.parametrize("qtype", QUANTIZABLE + list(BYTE_BUILT), ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference_bit_for_bit(qtype):
    shape = (3, 4, 512)
    data = _quantized(qtype, shape)
    ref = gq.dequantize(data, qtype)
    q = from_gguf(data, qtype)
    assert isinstance(q, QuantTensor)
    assert q.format == qtype.name.lower() and q.layout == "gguf" and q.ggml_type == qtype
    assert tuple(q.shape) == shape
    assert q.nbytes == data.nbytes
    out = q.dequantize()
    assert out.dtype == torch.float32 and tuple(out.shape) == shape
    np.testing.assert_array_equal(out.numpy(), ref)  # bit-exact (no NaNs here)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4], ids=lambda t: t.name)
def test_expert_and_row_indexing_equal_slicing_the_floats(qtype):
    data = _quantized(qtype, (5, 6, 256), seed=1)
    q = from_gguf(data, qtype)
    full = q.dequantize()
    base = q.parts["data"]
    for key in (2, -1, slice(1, 4), slice(None, None, 2), slice(3, 3)):
        part = q[key]
        assert isinstance(part, QuantTensor)
        assert tuple(part.shape) == tuple(full[key].shape)
        torch.testing.assert_close(part.dequantize(), full[key], rtol=0, atol=0)
        if part.numel():  # a view of the same bytes, not a copy
            assert part.parts["data"].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    # one expert, then a block of its rows (what per-expert views and row splits do)
    torch.testing.assert_close(q[3][2:5].dequantize(), full[3, 2:5], rtol=0, atol=0)
    # gathers (embedding lookups): index tensors of any shape, lists
    idx = torch.tensor([[4, 0], [1, 1]])
    torch.testing.assert_close(q[1][idx].dequantize(), full[1][idx], rtol=0, atol=0)
    torch.testing.assert_close(q[[0, 4]].dequantize(), full[[0, 4]], rtol=0, atol=0)
    assert q[2].nbytes == data[2].nbytes
    with pytest.raises(IndexError):
        q[0, 1]
    with pytest.raises(IndexError):
        q[0][0][0]  # a 1-D row has only its quantized dimension left


def test_the_mmap_bytes_are_used_without_copying(tmp_path):
    data = _quantized(T.Q4_K, (2, 3, 256))
    path = tmp_path / "raw.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r").reshape(data.shape)
    q = from_gguf(mm, T.Q4_K)
    assert q.parts["data"].data_ptr() == mm.ctypes.data
    assert q[1].parts["data"].data_ptr() == mm.ctypes.data + data[0].nbytes
    np.testing.assert_array_equal(q.dequantize().numpy(), gq.dequantize(data, T.Q4_K))


def test_shape_argument_and_flat_bytes():
    data = _quantized(T.Q8_0, (4, 64))
    q = from_gguf(data.reshape(-1), T.Q8_0, shape=(4, 64))  # torch order, outermost first
    assert tuple(q.shape) == (4, 64)
    np.testing.assert_array_equal(q.dequantize().numpy(), gq.dequantize(data, T.Q8_0))
    with pytest.raises(ValueError):
        from_gguf(data, T.Q8_0, shape=(4, 48))  # 48 is not a whole number of 32-blocks


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_come_back_as_torch_tensors(qtype):
    x = _random_floats(np.random.default_rng(3), (3, 8, 32))
    stored = x if qtype == T.F32 else (x.astype(np.float16) if qtype == T.F16 else gq.quantize(x, T.BF16))
    out = from_gguf(stored, qtype, shape=(3, 8, 32))
    assert isinstance(out, torch.Tensor)
    assert out.dtype == {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
    np.testing.assert_array_equal(out.float().numpy(), gq.dequantize(stored, qtype).reshape(3, 8, 32))


def test_unsupported_type_names_type_and_tensor():
    raw = np.zeros((2, 54), dtype=np.uint8)  # two TQ1_0 rows of 256 weights (a type the engine does not read)
    with pytest.raises(UnsupportedModelError) as err:
        from_gguf(raw, T.TQ1_0, name="blk.7.ffn_down_exps.weight")
    assert "TQ1_0" in str(err.value) and "blk.7.ffn_down_exps.weight" in str(err.value)
    assert "llama.cpp" in str(err.value)  # says what to do


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_matmul_with_the_dequantized_weight(dtype):
    q = from_gguf(_quantized(T.Q4_K, (2, 16, 256), seed=5), T.Q4_K)[1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=gen).to(dtype)
    bias = torch.randn(16, generator=gen)
    expect = torch.nn.functional.linear(x, q.dequantize(dtype), bias.to(dtype))
    out = linear(x, q, bias)
    assert out.dtype == dtype and out.shape == (3, 16)
    torch.testing.assert_close(out, expect, rtol=0, atol=0)
    wf = q.dequantize()
    torch.testing.assert_close(linear(x.float(), wf), x.float() @ wf.T)
    assert quant.dequantize(wf, torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_rounds_once_to_the_requested_dtype():
    q = from_gguf(_quantized(T.Q6_K, (4, 256), seed=7), T.Q6_K)
    assert torch.equal(q.dequantize(torch.bfloat16), q.dequantize().to(torch.bfloat16))
    assert torch.equal(q.to("cpu").dequantize(device="cpu"), q.dequantize())
