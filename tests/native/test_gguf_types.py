"""The GGUF types of the community mixes in every kernel set this CPU runs: Q4_1, Q5_1, IQ4_NL,
IQ4_XS and the i-quants (IQ1_S .. IQ3_S), with the K-quants beside them for comparison.

Their blocks are random valid ones (random codes, sane fp16 scales: every grid index, sign
and scale field is exercised). Dequantizing is held bit for bit to gguf's reference
dequantizers (the same float operations as ggml's); the GEMV, which quantizes the
activations to 8 bits as llama.cpp does, to the dequantized matrix times the activations."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from hybridmoe.backend.bench.synthetic_experts import random_matrix
from hybridmoe.backend.engine import native_kernels
from tests.native.conftest import ISAS

_native = native_kernels._native
pytestmark = pytest.mark.skipif(_native is None, reason="native extension not built")

NEW_TYPES = ("q4_1", "q5_1", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
TYPES = NEW_TYPES + ("q8_0", "q4_0", "q5_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
ROWS, K = 24, 768  # three super-blocks a row; rows not a multiple of a panel


def stored(fmt: str, rows: int = ROWS, k: int = K, seed: int = 0) -> np.ndarray:
    """[rows, bytes per row] of random valid blocks of `fmt`."""
    return np.ascontiguousarray(random_matrix(np.random.default_rng(seed), fmt, (rows, k)).parts["data"].numpy())


def reference(fmt: str, data: np.ndarray) -> np.ndarray:
    return quants.dequantize(data, GGMLQuantizationType[fmt.upper()]).astype(np.float32)


@pytest.mark.parametrize("fmt", TYPES)
def test_dequantizing_is_ggmls_bit_for_bit(fmt, isa):
    data = stored(fmt)
    out = np.full((ROWS, K), np.nan, np.float32)
    _native.dequantize(fmt, data, K, out)
    expected = reference(fmt, data)
    assert np.isfinite(expected).all()
    # Equal values: the same float32 bits, except that a zero code under a negative scale may be
    # -0.0 or +0.0 (the SIMD q4_0/q5_0 paths subtract the offset times d after the product).
    assert np.array_equal(out, expected), (
        f"{int((out != expected).sum())} values differ, max {float(np.abs(out - expected).max())}")


@pytest.mark.parametrize("tokens", [1, 3, 4, 6, 13])
@pytest.mark.parametrize("fmt", TYPES)
def test_the_gemv_computes_the_dequantized_product(fmt, tokens, isa):
    """Every type's GEMV, called by the type's name, in every kernel set: the kernel in the type's
    slot of the table is that type's (native/src/formats.h and the tables fill them by enumerator)."""
    data = stored(fmt)
    weights = torch.from_numpy(reference(fmt, data))
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((tokens, K)).astype(np.float32))
    tensor = torch.from_numpy(data)
    linear = _native.DenseLinear(fmt, K, [(ROWS, [tensor.data_ptr(), 0, data.shape[1], 0])], False)
    assert linear.format == fmt and linear.bytes == data.nbytes
    out = torch.empty(tokens, ROWS)
    linear.forward(x, out, 1 << 30)  # the GEMV at every count
    expected = x @ weights.T
    # 8-bit activations (one scale per 32 or 256 values): ~0.5 % of a row's magnitude.
    scale = float((x.abs() @ weights.abs().T).max())
    assert float((out - expected).abs().max()) <= 0.01 * scale


@pytest.mark.parametrize("tokens", [37, 181])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("fmt", NEW_TYPES)
def test_the_gemv_gives_each_token_the_same_bits_however_many_come_at_once(fmt, interleave, tokens, isa):
    """The i-quants' GEMV takes a prompt's tokens in one call, decoding each super-block once
    for a block of them (on AVX2 as many as fit in L2: 168 at this width, so 181 make two
    blocks; four rows at a time, here 27 rows where not copied); per token it does what the
    four-token passes do, in the same order. So do iq4_nl's and iq4_xs's row-interleaved
    copies (with AVX-512, gemm_x8nl_512 past four tokens: 24 rows, a pair of 8-row groups and a
    single one)."""
    rows = ROWS if interleave else ROWS + 3
    data = stored(fmt, rows)
    tensor = torch.from_numpy(data)
    linear = _native.DenseLinear(fmt, K, [(rows, [tensor.data_ptr(), 0, data.shape[1], 0])], interleave)
    copied = interleave and fmt in ("iq4_nl", "iq4_xs")
    assert linear.format == (f"{fmt}x8" if copied else fmt)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((tokens, K)).astype(np.float32))
    together = torch.empty(tokens, rows)
    linear.forward(x, together, 1 << 30)
    for t0 in range(0, tokens, 3):
        apart = torch.empty(min(3, tokens - t0), rows)
        linear.forward(x[t0:t0 + 3].contiguous(), apart, 1 << 30)
        assert torch.equal(together[t0:t0 + 3], apart), f"tokens {t0}..{t0 + 2}"


GEMV_ALWAYS = ("q4_1", "q5_1", "iq4_nl", "iq4_xs")  # their 32-block GEMV reads at the bandwidth's pace


@pytest.mark.parametrize("fmt", NEW_TYPES)
def test_their_prompts_take_one_path_by_format(fmt):
    """q4_1/q5_1/iq4_nl/iq4_xs take the GEMV at every count; the other i-quants switch to
    dequantized panels and the GEMM at their measured switch point (both experts and dense
    projections), past the four tokens a GEMV pass serves, and their prompts take one path:
    the GEMV (which decodes a super-block once for many tokens). The portable set's GEMM is
    the faster from one token."""
    for name in ISAS:
        _native.set_isa(name)
        try:
            info = _native.isa_info()
            experts, dense = info["prefill_min_tokens"][fmt], info["dense_prefill_min_tokens"][fmt]
            prompt_gemv = fmt in info["prompt_gemv"]
            if name == "scalar":
                assert experts == dense == 1 and not prompt_gemv
            elif fmt in GEMV_ALWAYS:
                assert experts is None and dense is None and prompt_gemv
            else:
                assert 4 < experts <= 256 and experts == dense
                assert prompt_gemv
        finally:
            _native.set_isa("")


@pytest.mark.parametrize("fmt", NEW_TYPES)
def test_the_prompt_path_computes_the_dequantized_product(fmt, isa):
    rows, k, tokens = 40, 512, 260  # past every switch point
    data = stored(fmt, rows, k, seed=3)
    weights = torch.from_numpy(reference(fmt, data))
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((tokens, k)).astype(np.float32))
    tensor = torch.from_numpy(data)
    linear = _native.DenseLinear(fmt, k, [(rows, [tensor.data_ptr(), 0, data.shape[1], 0])], False)
    out = torch.empty(tokens, rows)
    linear.forward(x, out, -1)  # prompt rows: the path of the format
    expected = x @ weights.T
    scale = float((x.abs() @ weights.abs().T).max())
    assert float((out - expected).abs().max()) <= 0.01 * scale


@pytest.mark.parametrize("tokens", [1, 3, 5, 40])
@pytest.mark.parametrize("fmt", ["iq4_xs", "iq4_nl"])
def test_the_32_block_formats_prompts_at_any_count_compute_the_dequantized_product(fmt, tokens, isa):
    """iq4_xs (iq4_nl's codes, a scale d * (ls - 32) per 32 values) and iq4_nl go through the
    32-block GEMV for decode steps and prompts alike (iq4_xs: past four tokens in one call, each
    block decoded once for all of them): a prompt's rows of any count (and a decode step's)
    against the dequantized matrix, in every kernel set."""
    rows, k = 40, 1024  # four super-blocks a row: gemv_b32_n's eight-block steps
    data = stored(fmt, rows, k, seed=5)
    weights = torch.from_numpy(reference(fmt, data))
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((tokens, k)).astype(np.float32))
    tensor = torch.from_numpy(data)
    linear = _native.DenseLinear(fmt, k, [(rows, [tensor.data_ptr(), 0, data.shape[1], 0])], False)
    expected = x @ weights.T
    scale = float((x.abs() @ weights.abs().T).max())
    for prefill_min_tokens in (-1, 1 << 30):  # prompt rows, then the decode GEMV at every count
        out = torch.full((tokens, rows), float("nan"))
        linear.forward(x, out, prefill_min_tokens)
        assert float((out - expected).abs().max()) <= 0.01 * scale, prefill_min_tokens


@pytest.mark.parametrize("name", ISAS)
def test_every_kernel_set_agrees_with_the_portable_one(name):
    """The extension's own self-test: every format's GEMV and dequantizing against the
    portable kernels, on random blocks (the i-quants included)."""
    assert _native.self_test(name) == ""


@pytest.mark.parametrize("fmt", ["iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s"])
def test_a_rows_bits_do_not_depend_on_its_neighbours(fmt, isa):
    """The AVX-512 iq2 GEMV computes two super-blocks a step, and a row of an odd number of them
    shares its last step with the next row's: each row must still get the bits it gets alone
    (a one-row matrix: its last super-block in a step by itself), for 1-4 tokens, at one to five
    super-blocks a row and row counts odd and even."""
    for k in (256, 768, 1280, 1024):
        for rows in (1, 2, 3, 6):
            data = stored(fmt, rows=rows, k=k, seed=rows * 7 + k)
            tensor = torch.from_numpy(data)
            together = _native.DenseLinear(fmt, k, [(rows, [tensor.data_ptr(), 0, data.shape[1], 0])], False)
            x = torch.from_numpy(np.random.default_rng(k + rows).standard_normal((4, k)).astype(np.float32)) * 3
            for n in (1, 2, 3, 4):
                out = torch.empty(n, rows)
                together.forward(x[:n].contiguous(), out, 1 << 30)
                for r in range(rows):
                    one = torch.from_numpy(np.ascontiguousarray(data[r:r + 1]))
                    alone = _native.DenseLinear(fmt, k, [(1, [one.data_ptr(), 0, data.shape[1], 0])], False)
                    row_out = torch.empty(n, 1)
                    alone.forward(x[:n].contiguous(), row_out, 1 << 30)
                    assert torch.equal(out[:, r:r + 1], row_out), f"{k} values, {rows} rows, {n} tokens: row {r}"
