"""Synthetic stored weights (hybridmoe.backend.bench.synthetic_experts) of the GGUF types of the
community mixes: valid blocks, the stored bytes of the type, values at the requested spread."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridmoe.backend.bench.synthetic_experts import GGUF_FORMATS, IQ_FORMATS, block_of, random_matrix
from hybridmoe.backend.formats.quant import QuantTensor


def test_the_community_types_are_among_the_gguf_formats():
    """So the native tests and `bench kernels`, which sweep GGUF_FORMATS, cover them."""
    assert IQ_FORMATS == ("q4_1", "q5_1", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s",
                          "iq1_s", "iq1_m")
    assert set(IQ_FORMATS) <= set(GGUF_FORMATS)


@pytest.mark.parametrize("fmt", IQ_FORMATS)
@pytest.mark.parametrize("scale", [0.05, 0.002])
def test_random_matrix_of_each_new_type(fmt, scale):
    qtype = GGMLQuantizationType[fmt.upper()]
    block, size = GGML_QUANT_SIZES[qtype]
    assert block_of(fmt) == block
    shape = (3, 48, 1024)
    w = random_matrix(np.random.default_rng(7), fmt, shape, scale)
    assert isinstance(w, QuantTensor) and w.format == fmt and tuple(w.shape) == shape
    assert w.nbytes == 3 * 48 * 1024 // block * size
    x = w.dequantize()
    assert bool(torch.isfinite(x).all())
    # every block's values at about `scale` (block scales drawn from 0.3..1.7 of it), centred
    assert 0.8 * scale < float(x.std()) < 1.3 * scale
    assert abs(float(x.mean())) < 0.05 * scale
    per_block = x.reshape(-1, block).std(dim=1)
    assert float(per_block.min()) > 0.05 * scale and float(per_block.max()) < 4 * scale
    # the codes are random: expert 0 and 1 differ, and a second draw differs from the first
    assert not torch.equal(x[0], x[1])
    assert not torch.equal(x, random_matrix(np.random.default_rng(8), fmt, shape, scale).dequantize())


@pytest.mark.parametrize("fmt", ["q2_k", "q4_k", "q5_k"])
def test_k_quants_with_mins_are_centred_like_a_quantizers_output(fmt):
    """Their sub-block mins cancel the codes' mean: random mins would shift whole rows by about
    their spread, and a model made of such rows attends and routes near-argmax (chaotic: no
    measure of an implementation's accuracy)."""
    scale = 0.02
    x = random_matrix(np.random.default_rng(3), fmt, (64, 2048), scale).dequantize()
    assert 0.8 * scale < float(x.std()) < 1.3 * scale
    assert float(x.mean(dim=1).abs().max()) < 0.2 * scale  # no row is shifted
    sub = 16 if fmt == "q2_k" else 32
    assert float(x.reshape(-1, sub).mean(dim=1).std()) < 0.45 * scale  # codes' spread only
