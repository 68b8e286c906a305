"""Native dense projections (``NativeLinear``) against the PyTorch reference.

Every format the kernels read, both paths (GEMV on Q8 activations for few tokens, GEMM on
dequantized panels for many) and every kernel set this CPU runs, on shapes whose rows do
not fill whole work units. As for the experts (see test_native_experts.py): the GEMM path
and the float formats must equal fp32 math on the dequantized matrix to 1e-5; the GEMV path
of quantized formats must equal the same math on Q8-rounded activations to 5e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridmoe.backend.bench.synthetic_experts import (
    ALL_FORMATS,
    FLOAT_FORMATS,
    HF_FORMATS,
    block_of,
    random_matrix,
)
from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.loader import Loader
from hybridmoe.backend.engine.native_linear import NativeLinear
from hybridmoe.backend.formats.weights import dense
from hybridmoe.backend.hardware.memory import read_transparent_hugepages

from tests.native.conftest import ISAS, bf16, gemm_on_tiles

from .test_native_experts import act_group, q8, rel_err

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")

_native = native_kernels._native



def matrix(fmt: str, seed: int):
    block = block_of(fmt)
    cols = {256: 512, 32: 160}.get(block, 72)
    rows = 77  # not a multiple of any unit or panel
    return random_matrix(np.random.default_rng(seed), fmt, (rows, cols))


def as_float(w) -> torch.Tensor:
    return dense(w, torch.float32, "cpu")


@pytest.mark.parametrize("acts", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 5, 23, 24, 64, 300])
@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_matches_reference(isa, fmt, tokens, acts):
    w = matrix(fmt, seed=tokens)
    lin = NativeLinear(w)
    x = torch.randn(tokens, lin.in_features, generator=torch.Generator().manual_seed(tokens)).to(acts)
    ref_w = as_float(w)
    out = lin(x, float32=True)
    x = x.float()
    assert out.dtype == torch.float32 and out.shape == (tokens, lin.out_features)
    gemv = tokens < lin.native.prefill_min_tokens
    if not gemv and gemm_on_tiles(fmt, acts):  # bf16 weights (the activations are), fp32 sums
        assert rel_err(out, F.linear(x, bf16(ref_w))) < 1e-5
    elif fmt in FLOAT_FORMATS or (not gemv and fmt in HF_FORMATS):
        assert rel_err(out, F.linear(x, ref_w)) < 1e-5
    else:  # Q8 activations, as llama.cpp's: the integer GEMV, or the GEMM on their values
        # (q4_1's and q5_1's GEMV take each block's activation sum in fp16 for their min, as
        # llama.cpp's Q8_1: that rounding is theirs alone)
        tolerance = 2e-3 if gemv and fmt in ("q4_1", "q5_1") else 1e-4
        assert rel_err(out, F.linear(q8(x, act_group(fmt)), ref_w)) < tolerance


@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("fmt", ["q4_0", "int4_g32", "q4_k", "q8_0"])
def test_interleaved_copy_agrees_with_the_stored_layout(isa, fmt, tokens):
    """q4_0 / int4_g32 / q4_k / q8_0 matrices whose rows come in whole groups of 8 are copied into
    the row-interleaved layout, whose integer GEMV serves every token count; the in-place
    kernels on the same matrix give the same answer."""
    cols = 512 if fmt == "q4_k" else 160
    w = random_matrix(np.random.default_rng(tokens), fmt, (96, cols))
    copied, stored = NativeLinear(w), NativeLinear(w, interleave=False)
    assert copied.native.format == f"{fmt}x8" and copied.native.interleaved_bytes == copied.native.bytes
    assert stored.native.format == fmt and stored.native.interleaved_bytes == 0
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
    if isa != "scalar":  # the portable set computes a prompt with the GEMM, as it should
        assert copied.native.prefill_min_tokens > 100_000
    gemv_copied, gemv_stored = torch.empty(tokens, 96), torch.empty(tokens, 96)
    copied.native.forward(x, gemv_copied, 1_000_000)  # both GEMVs, forced
    stored.native.forward(x, gemv_stored, 1_000_000)
    assert rel_err(gemv_copied, gemv_stored) < 1e-6
    gemm_copied, gemm_stored = torch.empty(tokens, 96), torch.empty(tokens, 96)
    copied.native.forward(x, gemm_copied, 1)  # and both GEMMs (dequantized panels)
    stored.native.forward(x, gemm_stored, 1)
    assert rel_err(gemm_copied, gemm_stored) < 1e-6
    if fmt in HF_FORMATS:  # the checkpoints' int4: the GEMM on the rows as they came
        assert rel_err(gemm_copied, F.linear(x, as_float(w))) < 1e-5
    else:  # a GGUF type's on their Q8 values, as llama.cpp computes it: the GEMV's result
        assert rel_err(gemm_copied, F.linear(q8(x, act_group(fmt)), as_float(w))) < 1e-5
        assert rel_err(gemm_copied, gemv_copied) < 1e-5


def test_fused_projection_reads_its_parts_copies():
    """Joining interleaved projections (q, k, v) shares their copies: nothing is copied again."""
    rng = np.random.default_rng(5)
    parts = [NativeLinear(random_matrix(rng, "q4_0", (rows, 128))) for rows in (64, 16, 16)]
    fused = NativeLinear.fused(*parts)
    assert fused.native.format == "q4_0x8" and fused.native.interleaved_bytes == 0
    assert fused.out_features == 96 and fused.in_features == 128
    x = torch.randn(3, 128)
    assert rel_err(fused(x), torch.cat([p(x) for p in parts], dim=-1)) < 1e-6
    assert NativeLinear.fused(parts[0], NativeLinear(random_matrix(rng, "q4_0", (8, 256)))) is None


@pytest.mark.parametrize("tokens,threshold", [(1, 0), (3, 0), (40, 0), (40, 1), (5, 1_000_000), (3, -1), (40, -1)])
def test_projections_of_different_formats_join_into_one_call(tokens, threshold):
    """llama.cpp's K-quant mixes store v in Q6_K beside a Q4_K q and k: joined, each part
    computes exactly what it computes alone (its own layout, activations and GEMV/GEMM
    switch point), in one call."""
    rng = np.random.default_rng(6)
    parts = [NativeLinear(random_matrix(rng, fmt, (rows, 256))) for fmt, rows in
             (("q4_k", 64), ("q4_k", 16), ("q6_k", 16), ("bf16", 8), ("q4_0", 24), ("q4_0", 4))]
    fused = NativeLinear.fused(*parts)
    assert fused.native.format == "q4_kx8+q6_k+bf16+q4_0x8+q4_0"  # 4 rows: no x8 layout
    assert fused.native.bytes == sum(p.native.bytes for p in parts)
    x = torch.randn(tokens, 256)
    joined = torch.empty(tokens, fused.out_features)
    fused.native.forward(x, joined, threshold)
    alone = []
    for p in parts:
        alone.append(torch.empty(tokens, p.out_features))
        p.native.forward(x, alone[-1], threshold)
    assert torch.equal(joined, torch.cat(alone, dim=-1))


@pytest.mark.parametrize("rows", [64, 63])  # 63: no x8 copy, read as stored
@pytest.mark.parametrize("fmt", ["q4_0", "q8_0", "q4_k", "q6_k", "bf16"])
def test_prompt_rows_take_one_path_by_format_at_any_count(isa, fmt, rows):
    """Prompt rows (-1): the GEMV for the formats with a row-interleaved copy (its GEMV is the
    faster at every count; as stored too, so that a matrix sliced into parts computes what it
    computes whole), the GEMM for the rest, whatever the count: a prompt's numbers do not
    depend on its chunks."""
    lin = NativeLinear(random_matrix(np.random.default_rng(8), fmt, (rows, 512)))
    assert lin.native.format.endswith("x8") == (rows == 64 and fmt in ("q4_0", "q8_0", "q4_k"))
    x = torch.randn(40, 512)
    whole = torch.empty(40, rows)
    lin.native.forward(x, whole, -1)
    path = torch.empty(40, rows)
    lin.native.forward(x, path, 1_000_000 if fmt in ("q4_0", "q8_0", "q4_k") and isa != "scalar" else 1)
    assert torch.equal(whole, path)
    for a, b in ((0, 1), (1, 14), (14, 40)):
        chunk = torch.empty(b - a, rows)
        lin.native.forward(x[a:b], chunk, -1)
        assert torch.equal(chunk, whole[a:b]), (a, b)


@pytest.mark.skipif(not {"avx512_vnni", "avx2"} <= set(ISAS), reason="needs both x86 kernel sets")
@pytest.mark.parametrize("fmt", ["q4_k", "iq4_nl", "iq4_xs"])
def test_x8_gemv_gives_the_same_bits_on_avx512_as_on_avx2(fmt):
    """q4_kx8: AVX-512 computes three or four tokens on pairs of 8-row groups (vpdpbusd into
    int32), AVX2 group by group (vpmaddubsw into int16). iq4_nlx8 and iq4_xsx8: AVX-512 takes
    the values + 128 and an offset per block, AVX2 the signs onto the activations. All: exact
    integer sums, the same float steps."""
    x = torch.randn(9, 1024)
    outs = {}
    try:
        lin = NativeLinear(random_matrix(np.random.default_rng(9), fmt, (72, 1024)))  # 4 pairs and a group
        assert lin.native.format == f"{fmt}x8"
        for isa in ("avx512_vnni", "avx2"):
            _native.set_isa(isa)
            outs[isa] = torch.empty(9, 72)
            lin.native.forward(x, outs[isa], 1 << 30)
    finally:
        _native.set_isa("")
    assert torch.equal(outs["avx512_vnni"], outs["avx2"])


@pytest.mark.parametrize("fmt", ["q4_0", "bf16"])
def test_both_paths_agree_on_any_token_count(fmt):
    w = matrix(fmt, seed=7)
    lin = NativeLinear(w)
    x = torch.randn(40, lin.in_features)
    gemv, gemm = torch.empty(40, lin.out_features), torch.empty(40, lin.out_features)
    lin.native.forward(x, gemv, 1_000_000)
    lin.native.forward(x, gemm, 1)
    assert rel_err(gemv, gemm) < (1e-5 if fmt == "bf16" else 2e-2)


def test_bias_batch_dims_and_bf16_activations():
    w = matrix("q8_0", seed=3)
    bias = torch.randn(w.shape[0])
    lin = NativeLinear(w, bias)
    x = torch.randn(2, 30, w.shape[1]).to(torch.bfloat16)  # 60 tokens: the GEMM path
    out = lin(x)
    assert out.shape == (2, 30, w.shape[0]) and out.dtype == torch.bfloat16
    ref = (F.linear(x.float(), as_float(w)) + bias).to(torch.bfloat16)
    assert rel_err(out.float(), ref.float()) < 1e-2  # one bf16 rounding apart


def test_reads_the_stored_matrix_in_place():
    w = torch.randn(64, 96).to(torch.bfloat16)
    lin = NativeLinear(w)
    x = torch.randn(1, 96)
    before = lin(x)
    w.mul_(2)  # the kernels read w's own memory: no copy was made
    assert rel_err(lin(x), 2 * before) < 1e-2


def test_loader_uses_the_kernels_on_the_cpu_only():
    stored = matrix("q4_0", seed=1)
    loader = Loader({"p.weight": stored}, torch.device("cpu"), torch.bfloat16)
    assert isinstance(loader.linear("p", *stored.shape), NativeLinear)
    meta = Loader({"p.weight": stored}, torch.device("meta"), torch.bfloat16)
    assert not isinstance(meta.linear("p", *stored.shape), NativeLinear)


def test_storage_the_kernels_cannot_read_is_materialised_once(monkeypatch):
    # A transposed view has no contiguous rows: it is copied once, then read natively.
    w = torch.randn(96, 64).t()
    loader = Loader({"p.weight": w}, torch.device("cpu"), torch.float32)
    lin = loader.linear("p", 64, 96)
    x = torch.randn(3, 96)
    assert isinstance(lin, NativeLinear)
    assert rel_err(lin(x), x @ w.t()) < 1e-5
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    assert not isinstance(loader.linear("p", 64, 96), NativeLinear)


def _anon_huge_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("AnonHugePages:"))


@pytest.mark.skipif(read_transparent_hugepages()[0] not in ("always", "madvise"), reason="no transparent huge pages here")
def test_copies_get_huge_pages_after_large_blocks_were_freed():
    """The interleaved copy is streamed once per token: on 4 KiB pages every page is a TLB
    miss (a nested page walk in a VM). Freeing large blocks first makes malloc serve the next
    ones from memory already faulted in at 4 KiB; the copies are mappings of their own."""
    for _ in range(3):
        block = np.ones(24 << 20, np.uint8)  # 24 MB, freed again: glibc raises its mmap threshold
        del block
    stored = random_matrix(np.random.default_rng(0), "q4_0", (8192, 2048))  # a 9.4 MB copy
    before = _anon_huge_bytes()
    lin = NativeLinear(stored)
    gained = _anon_huge_bytes() - before
    whole_pages = lin.native.interleaved_bytes // (2 << 20) * (2 << 20)
    # The kernel may refuse a huge page where memory is fragmented: most, not all.
    assert gained >= whole_pages // 2, (gained, whole_pages)
