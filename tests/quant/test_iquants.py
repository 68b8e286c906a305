"""The PyTorch dequantizers of the grid i-quants (backend/formats/iquants.py) against gguf's
reference dequantizers, bit for bit, on random valid blocks (every grid index, sign bit and
scale field), and through ``from_gguf`` / ``dequantize`` as the engine reads a tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from hybridmoe.backend.bench.synthetic_experts import random_matrix
from hybridmoe.backend.formats.iquants import DEQUANTIZERS
from hybridmoe.backend.formats.quant import dequantize, from_gguf


@pytest.mark.parametrize("qtype", list(DEQUANTIZERS), ids=lambda t: t.name.lower())
def test_dequantizers_are_ggmls_bit_for_bit(qtype):
    data = random_matrix(np.random.default_rng(int(qtype)), qtype.name.lower(), (96, 256)).parts["data"].numpy()
    expected = quants.dequantize(data, qtype).reshape(-1, 256).astype(np.float32)
    ours = DEQUANTIZERS[qtype](torch.from_numpy(data)).numpy()
    assert np.isfinite(expected).all()
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.IQ2_XXS, GGMLQuantizationType.IQ1_M],
                         ids=lambda t: t.name.lower())
def test_a_gguf_tensor_of_them_reads_and_dequantizes(qtype):
    rows, cols = 6, 512
    data = random_matrix(np.random.default_rng(0), qtype.name.lower(), (rows, cols)).parts["data"].numpy()
    tensor = from_gguf(data, qtype, (rows, cols), name="blk.0.ffn_up_exps.weight")
    assert tensor.format == qtype.name.lower() and tuple(tensor.shape) == (rows, cols)
    expected = quants.dequantize(data, qtype).astype(np.float32)
    assert torch.equal(dequantize(tensor), torch.from_numpy(expected))
