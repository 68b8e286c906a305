"""The i-quants' many-token GEMV (on AVX-512 a GEMM micro-kernel over panels of 16 decoded rows,
kernels_iq.inl; iq4_xs's the 32-block GEMV's, gemm_b32_512; q3_k's and q2_k's gemv_q23k_n's,
gemm_q23k_512) gives every token the bits of the decode GEMV (calls of at most four tokens),
in every kernel set this CPU runs: each format, token counts around the kernel's groups of 16
(ragged ones included), row counts that are not a multiple of 16 (a call's last, short row
block) and rows of one to eight super-blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.backend.engine import native_kernels
from tests.native.test_gguf_types import reference, stored

_native = native_kernels._native
pytestmark = pytest.mark.skipif(_native is None, reason="native extension not built")

FORMATS = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m", "iq4_xs", "q3_k", "q2_k")
SHAPES = [(7, 256), (24, 768), (40, 2048), (67, 512)]  # rows, K
TOKENS = (5, 8, 13, 16, 17, 31, 33, 40, 67)


def _linear(fmt: str, rows: int, k: int):
    data = stored(fmt, rows, k, seed=rows + k)
    tensor = torch.from_numpy(data)
    return _native.DenseLinear(fmt, k, [(rows, [tensor.data_ptr(), 0, data.shape[1], 0])], False), data, tensor


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_tokens_give_the_decode_gemvs_bits(fmt, isa):
    for rows, k in SHAPES:
        linear, data, _keep = _linear(fmt, rows, k)
        # Larger activations than the unit normal, so that every 8-bit code is used.
        x = torch.from_numpy(np.random.default_rng(rows).standard_normal((max(TOKENS), k)).astype(np.float32)) * 3
        apart = torch.empty(max(TOKENS), rows)
        for t0 in range(0, max(TOKENS), 4):  # the decode GEMV: four tokens a call
            part = torch.empty(min(4, max(TOKENS) - t0), rows)
            linear.forward(x[t0:t0 + 4].contiguous(), part, 1 << 30)
            apart[t0:t0 + 4] = part
        for n in TOKENS:
            together = torch.empty(n, rows)
            linear.forward(x[:n].contiguous(), together, 1 << 30)
            assert torch.equal(together, apart[:n]), f"{rows} x {k}, {n} tokens: {int((together != apart[:n]).sum())} differ"


@pytest.mark.parametrize("fmt", FORMATS)
def test_many_tokens_compute_the_dequantized_product(fmt, isa):
    rows, k, n = 67, 768, 37
    linear, data, _keep = _linear(fmt, rows, k)
    weights = torch.from_numpy(reference(fmt, data))
    x = torch.from_numpy(np.random.default_rng(9).standard_normal((n, k)).astype(np.float32))
    out = torch.empty(n, rows)
    linear.forward(x, out, 1 << 30)
    expected = x @ weights.T
    scale = float((x.abs() @ weights.abs().T).max())
    assert float((out - expected).abs().max()) <= 0.01 * scale


def test_iq4_xs_prompt_rows_give_each_token_alone_its_bits(isa):
    """iq4_xs past four tokens a call (AVX-512: gemm_b32_512, 16 rows in the lanes; AVX2:
    gemv_b32_many) against calls of one token (gemv_b32_n<1>), bit for bit: token counts around
    the GEMM's groups of 16, a row count that leaves a short last row block."""
    rows, k = 37, 1024
    linear, data, _keep = _linear("iq4_xs", rows, k)
    x = torch.from_numpy(np.random.default_rng(11).standard_normal((67, k)).astype(np.float32)) * 3
    alone = torch.empty(67, rows)
    for t in range(67):
        linear.forward(x[t:t + 1].contiguous(), alone[t:t + 1], 1 << 30)
    for n in (5, 16, 17, 40, 67):
        together = torch.empty(n, rows)
        linear.forward(x[:n].contiguous(), together, 1 << 30)
        assert torch.equal(together, alone[:n]), f"{n} tokens: {int((together != alone[:n]).sum())} differ"


@pytest.mark.parametrize("fmt", ["q3_k", "q2_k"])
def test_q3_k_q2_k_prompt_rows_give_each_token_alone_its_bits(fmt, isa):
    """q3_k and q2_k past four tokens a call (AVX-512: gemm_q23k_512, 16 rows in the lanes;
    elsewhere the decode GEMV four tokens at a time) against calls of one token
    (gemv_q23k_n<1>), bit for bit, as decode rows and as a prompt's: token counts around the
    GEMM's groups of 16, row counts that leave a short last row block, rows of one to eight
    super-blocks (the portable set: its GEMV's calls)."""
    for rows, k in ((37, 1024), (7, 256), (24, 2048), (67, 768)):
        linear, data, _keep = _linear(fmt, rows, k)
        x = torch.from_numpy(np.random.default_rng(rows).standard_normal((67, k)).astype(np.float32)) * 3
        alone = torch.empty(67, rows)
        for t in range(67):
            linear.forward(x[t:t + 1].contiguous(), alone[t:t + 1], 1 << 30)
        for n in (5, 16, 17, 40, 67):
            # A decode step's rows; a prompt's (the portable set's prompts take the GEMM).
            for rows_of in (1 << 30, -1) if isa != "scalar" else (1 << 30,):
                together = torch.empty(n, rows)
                linear.forward(x[:n].contiguous(), together, rows_of)
                assert torch.equal(together, alone[:n]), (
                    f"{rows} x {k}, {n} tokens: {int((together != alone[:n]).sum())} differ")
