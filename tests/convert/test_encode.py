"""The torch encoders produce the bytes of gguf-py's numpy reference (a port of ggml-quants.c)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from hybridmoe.backend.convert.encode import encode, row_bytes, tensor_bytes


def _samples() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * 0.05
    x[0] = 0.0  # all-zero blocks (d = 0)
    x[1, :32] = torch.linspace(-1, 1, 32)  # exact halves: rounding ties
    x[2, :32] = 7.0  # a constant block
    x[3, 5] = 1e4  # one outlier dominating its block
    x[4, :32] = -torch.arange(32.0)  # largest magnitude negative
    return x


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.BF16, Q.F16, Q.F32])
def test_encode_matches_gguf_reference(qtype):
    x = _samples()
    ours = encode(x, qtype)
    ref = quantize(x.numpy(), qtype).view(np.uint8).reshape(ours.shape)
    assert ours.shape == (64, row_bytes(qtype, 256))
    assert np.array_equal(ours, ref)


def test_encode_keeps_bf16_bits_and_leading_dims():
    x = _samples().to(torch.bfloat16).reshape(4, 16, 256)
    out = encode(x, Q.BF16)
    assert out.shape == (4, 16, 512)
    assert np.array_equal(out.view(np.uint16).reshape(4, 16, 256), x.view(torch.uint16).numpy())
    assert tensor_bytes(Q.Q8_0, (8, 64, 256)) == 8 * 64 * 8 * 34
