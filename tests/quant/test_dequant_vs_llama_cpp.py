"""Dequantizing every GGUF type the engine reads is bit for bit llama.cpp's own: the PyTorch
dequantizers (hybridmoe.backend.formats.quant) against ggml's ``to_float`` of each type, called
through ctypes in the libggml that llama-cpp-python ships, on random valid blocks.

The blocks are random bytes (every code, grid index, sign bit and sub-scale field) with their
fp16 scales (and mins) replaced by random finite fp16 values across the whole range, signs,
subnormals and zero included, so that every rounding of ggml's float operations is exercised;
MXFP4's e8m0 exponent is kept where 12 * 2^(e-128) stays finite. Nothing is NaN or inf on
either side, so equal float32 bits is the test.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridmoe.backend.formats.quant import GGUF_SUPPORTED_TYPES, dequantize, from_gguf

# Every block type the engine reads, by the byte offsets of its fp16 scale fields.
FP16_FIELDS = {
    "q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
    "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,),
    "iq4_nl": (0,), "iq4_xs": (0,), "iq2_xxs": (0,), "iq2_xs": (0,), "iq2_s": (0,),
    "iq3_xxs": (0,), "iq3_s": (0,), "iq1_s": (0,),
    "iq1_m": (),  # its d is the top nibbles of the four 16-bit scale words (bytes 48-55)
    "mxfp4": (),  # an e8m0 exponent byte, no fp16
}
TYPES = tuple(FP16_FIELDS)
N_BLOCKS = 512


class _TypeTraits(ctypes.Structure):
    """ggml.h's struct ggml_type_traits (the layout is checked against each type's known name,
    block size and block bytes before its to_float is called)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


# typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


@pytest.fixture(scope="module")
def ggml_type_traits():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from hybridmoe.backend.llamacpp import library

    try:
        return library._symbol("ggml_get_type_traits", ctypes.POINTER(_TypeTraits), [ctypes.c_int])
    except library.LlamaCppUnavailable as exc:
        pytest.skip(str(exc))


def llama_cpp_dequantize(get_traits, qtype: GGMLQuantizationType, blocks: np.ndarray) -> np.ndarray:
    """ggml's own dequantization of `blocks` [n, type_size] -> float32 [n * block]."""
    traits = get_traits(int(qtype)).contents
    block, size = GGML_QUANT_SIZES[qtype]
    assert (traits.type_name.decode().lower(), traits.blck_size, traits.type_size, traits.is_quantized) == (
        qtype.name.lower(), block, size, True), "ggml_type_traits does not have the expected layout"
    assert traits.to_float, f"ggml has no to_float for {qtype.name}"
    blocks = np.ascontiguousarray(blocks)
    out = np.full(blocks.shape[0] * block, np.nan, np.float32)
    _TO_FLOAT(traits.to_float)(blocks.ctypes.data, out.ctypes.data, out.size)
    return out


def _finite_f16_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random finite fp16 bit patterns: any sign, any exponent but all ones (inf/NaN)."""
    return (rng.integers(0, 0x7C00, size=n) | (rng.integers(0, 2, size=n) << 15)).astype(np.uint16)


def random_valid_blocks(rng: np.random.Generator, fmt: str, n: int) -> np.ndarray:
    qtype = GGMLQuantizationType[fmt.upper()]
    blocks = rng.integers(0, 256, size=(n, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in FP16_FIELDS[fmt]:
        blocks[:, at:at + 2] = _finite_f16_bits(rng, n).view(np.uint8).reshape(n, 2)
    if fmt == "iq1_m":
        words = blocks[:, 48:56].copy().view(np.uint16)  # [n, 4]
        d = _finite_f16_bits(rng, n)
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = words.view(np.uint8)
    if fmt == "mxfp4":
        blocks[:, 0] = rng.integers(0, 251, size=n)  # 12 * 2^(250 - 128) is finite; 253 is not
    return blocks


def test_every_type_the_engine_reads_is_covered():
    quantized = {t.name.lower() for t in GGUF_SUPPORTED_TYPES} - {"f32", "f16", "bf16"}
    assert quantized == set(TYPES)


@pytest.mark.parametrize("fmt", TYPES)
def test_dequantizing_is_llama_cpps_bit_for_bit(fmt, ggml_type_traits):
    qtype = GGMLQuantizationType[fmt.upper()]
    block = GGML_QUANT_SIZES[qtype][0]
    blocks = random_valid_blocks(np.random.default_rng(int(qtype)), fmt, N_BLOCKS)
    expected = torch.from_numpy(llama_cpp_dequantize(ggml_type_traits, qtype, blocks))
    assert bool(torch.isfinite(expected).all())

    rows = 8  # as the engine reads a tensor: [rows, K] of whole blocks
    tensor = from_gguf(blocks.reshape(rows, -1), qtype, (rows, N_BLOCKS // rows * block),
                       name="blk.0.ffn_up_exps.weight")
    ours = dequantize(tensor).reshape(-1)
    assert ours.dtype == torch.float32
    differ = ours.view(torch.int32) != expected.view(torch.int32)
    assert not bool(differ.any()), (
        f"{fmt}: {int(differ.sum())} of {differ.numel()} values differ from llama.cpp's, first at "
        f"{int(differ.nonzero()[0])}: {float(ours[differ][0])!r} vs {float(expected[differ][0])!r}")
