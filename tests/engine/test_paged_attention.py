"""Native decode attention over a block-allocated (paged) KV cache.

Checked against softmax(scale q k^T) v in float64 on the gathered keys, and against
attend_decode on the contiguous cache holding the same keys: the kernel hands each run of
positions to the same arithmetic as stretches contiguous in memory, in position order, so the
two agree bit for bit (fp32 and bf16 caches, every block size and table).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.native_attention import decode_attention, paged_decode_attention
from tests.native.conftest import isa  # noqa: F401 - each kernel set this CPU supports

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")

_native = native_kernels._native


def _paged_cache(hkv, block, d, dv, length, dtype, seed, spare_blocks=3):
    """Random k/v blocks with more blocks than the sequence uses, and a shuffled table."""
    g = torch.Generator().manual_seed(seed)
    used = -(-length // block)
    n_blocks = used + spare_blocks
    k_blocks = torch.randn(n_blocks, hkv, block, d, generator=g).to(dtype)
    v_blocks = torch.randn(n_blocks, hkv, block, dv, generator=g).to(dtype)
    table = torch.randperm(n_blocks, generator=g)[:used]
    return k_blocks, v_blocks, table


def _gathered(blocks, table, length):
    """[n_blocks, Hkv, B, D] read through the table: the sequence's [1, Hkv, length, D]."""
    hkv, d = blocks.shape[1], blocks.shape[3]
    return blocks[table].permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length].unsqueeze(0).contiguous()


def _reference(q, k, v, scale):
    """softmax(scale q k^T) v in float64, query heads grouped over the KV heads; over an fp16
    cache the query and the softmax's weights rounded to fp16 first, as the kernels round them
    (llama.cpp's attention)."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    as_cache = (lambda t: t.half().double()) if k.dtype == torch.float16 else (lambda t: t.double())  # noqa: E731
    return as_cache(torch.softmax(as_cache(q) @ k64.transpose(-1, -2) * scale, dim=-1)) @ v64


def _lengths(block):
    return sorted({n for n in (1, block - 1, block, block + 1, 3 * block + 5, 1000) if n >= 1})


# (query heads, KV heads, head size, value head size): GQA groups 1, 4, 8 and 12 (more heads
# than one pass of the kernels takes); head sizes 64 and 128; a value head size unlike the
# key's (as MLA's); sizes that are not whole vectors (40, 24: the kernels' tails).
HEADS = [(4, 4, 64, 64), (16, 4, 128, 128), (32, 4, 128, 128), (8, 1, 64, 48), (24, 2, 40, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [1, 16, 64, 256, 320])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv{h[2]}d{h[3]}dv")
def test_matches_reference_and_contiguous(isa, heads, block, dtype):
    hq, hkv, d, dv = heads
    for length in _lengths(block):
        k_blocks, v_blocks, table = _paged_cache(hkv, block, d, dv, length, dtype, seed=length * 1000 + block)
        g = torch.Generator().manual_seed(length)
        q = 3 * torch.randn(1, hq, 1, d, generator=g)  # sharp softmax: the max matters
        scale = d**-0.5
        out = paged_decode_attention(q, k_blocks, v_blocks, table, length, scale)
        assert out is not None and out.shape == (1, hq, 1, dv) and out.dtype == torch.float32

        k, v = _gathered(k_blocks, table, length), _gathered(v_blocks, table, length)
        ref = _reference(q, k, v, scale)
        err = float((out.double() - ref).norm() / ref.norm())
        # fp32 arithmetic on exact inputs: summation order only. Over fp16 the order puts a weight
        # on the other side of an fp16 rounding now and then (a few in a thousand positions), which
        # moves it by 2^-11 of itself (unrounded, 3-4e-4 off: tests/native/test_decode_attention.py).
        assert err < (2e-4 if dtype == torch.float16 else 1e-5), (length, err)

        contiguous = decode_attention(q, k, v, scale)
        assert torch.equal(out, contiguous), (length, float((out - contiguous).abs().max()))


def test_table_as_list_and_longer_than_needed():
    k_blocks, v_blocks, table = _paged_cache(2, 16, 64, 64, 40, torch.bfloat16, seed=1)
    q = torch.randn(1, 4, 1, 64, dtype=torch.bfloat16)
    # Entries past the used ones are not read (here: not even valid ids).
    longer = table.tolist() + [10**9, -1]
    out = paged_decode_attention(q, k_blocks, v_blocks, longer, 40, 0.125)
    assert out.dtype == torch.bfloat16  # q's dtype, as decode_attention
    assert torch.equal(out, paged_decode_attention(q, k_blocks, v_blocks, table, 40, 0.125))


def test_numpy_views_as_the_decode_step_passes_them():
    """bf16 arrives as its bits in uint16 (NumPy has no bfloat16), as for attend_decode."""
    k_blocks, v_blocks, table = _paged_cache(4, 64, 128, 128, 300, torch.bfloat16, seed=2)
    q = torch.randn(32, 128)
    out = np.empty((32, 128), np.float32)
    _native.attend_decode_paged(q.numpy(), k_blocks.view(torch.uint16).numpy(), v_blocks.view(torch.uint16).numpy(),
                                table.numpy(), 300, 0.088, out)
    expected = paged_decode_attention(q.view(1, 32, 1, 128), k_blocks, v_blocks, table, 300, 0.088)
    assert np.array_equal(out, expected.view(32, 128).numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_of_a_step_each_get_their_solo_bits(isa, dtype):
    """One call for the queries of several sequences (a decode step) over one shared pool of
    blocks: each row equals attend_decode_paged of that row alone, bit for bit, whatever the
    other rows' lengths (1 block, a partial one, several runs of positions)."""
    g = torch.Generator().manual_seed(5)
    lengths = [1, 63, 300, 700, 64]
    n_blocks = sum(-(-n // 64) for n in lengths) + 2
    k_blocks = torch.randn(n_blocks, 4, 64, 128, generator=g).to(dtype)
    v_blocks = torch.randn(n_blocks, 4, 64, 128, generator=g).to(dtype)
    order = torch.randperm(n_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in lengths:
        used = -(-n // 64)
        tables.append(order[at:at + used])
        at += used
    padded = torch.zeros(len(lengths), max(map(len, tables)), dtype=torch.int64)
    for row, table in zip(padded, tables):
        row[:len(table)] = torch.tensor(table)
    q = torch.randn(len(lengths), 32, 128, generator=g)
    out = torch.empty(len(lengths), 32, 128)
    _native.attend_decode_rows(q, k_blocks, v_blocks, padded, torch.tensor(lengths), 0.088, out)
    for t, (n, table) in enumerate(zip(lengths, tables)):
        alone = torch.empty(32, 128)
        _native.attend_decode_paged(q[t], k_blocks, v_blocks, torch.tensor(table), n, 0.088, alone)
        assert torch.equal(out[t], alone), f"row {t} ({n} positions)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_short_context_shares_its_heads_out_with_the_same_bits(isa, dtype):
    """One KV head (latent attention's shape: 16 query heads of 576, values of 512) over a
    context of one run of positions is one unit of work, fewer than the threads: its query
    heads are shared out among them. Each head gets the bits it gets unsplit (in a call with a
    longer row, whose runs fill the threads) and matches the reference."""
    if _native.num_threads() < 2:
        pytest.skip("one thread: nothing to share out")
    g = torch.Generator().manual_seed(7)
    k_blocks = torch.randn(16, 1, 64, 576, generator=g).to(dtype)
    v_blocks = torch.randn(16, 1, 64, 512, generator=g).to(dtype)
    q = torch.randn(2, 16, 576, generator=g)
    for length in (1, 40, 64):
        alone = torch.empty(16, 512)
        _native.attend_decode_paged(q[0], k_blocks, v_blocks, torch.tensor([3]), length, 0.05, alone)
        out = torch.empty(2, 16, 512)
        tables = torch.tensor([[3] + [0] * 11, list(range(4, 16))])
        _native.attend_decode_rows(q, k_blocks, v_blocks, tables, torch.tensor([length, 700]), 0.05, out)
        assert torch.equal(alone, out[0]), length
        k, v = _gathered(k_blocks, torch.tensor([3]), length), _gathered(v_blocks, torch.tensor([3]), length)
        ref = _reference(q[0].view(1, 16, 1, 576), k, v, 0.05).view(16, 512)
        assert float((alone.double() - ref).norm() / ref.norm()) < (2e-4 if dtype == torch.float16 else 1e-5), length


def test_rows_are_checked_one_by_one():
    k_blocks, v_blocks, table = _paged_cache(2, 16, 64, 64, 40, torch.float32, seed=3)
    tables = torch.stack([table, table])
    with pytest.raises(ValueError, match="length 49 out of range"):
        _native.attend_decode_rows(torch.randn(2, 8, 64), k_blocks, v_blocks, tables, torch.tensor([40, 49]), 0.1,
                                   torch.empty(2, 8, 64))
    with pytest.raises(ValueError, match="one row per sequence"):
        _native.attend_decode_rows(torch.randn(2, 8, 64), k_blocks, v_blocks, tables, torch.tensor([40]), 0.1,
                                   torch.empty(2, 8, 64))


def _call(q=None, k=None, v=None, table=None, length=40, out=None):
    k_blocks, v_blocks, default_table = _paged_cache(2, 16, 64, 64, 40, torch.float32, seed=3)
    _native.attend_decode_paged(
        torch.randn(8, 64) if q is None else q, k_blocks if k is None else k, v_blocks if v is None else v,
        default_table if table is None else table, length, 0.125, torch.empty(8, 64) if out is None else out)


@pytest.mark.parametrize("arguments, message", [
    (dict(table=torch.tensor([0, 1, 9])), "block table entry 2 is 9, not a block of the cache (0 to 5)"),
    (dict(table=torch.tensor([0, -1, 2])), "block table entry 1 is -1"),
    (dict(length=49, table=torch.tensor([0, 1, 2])), "length 49 out of range: the table's 3 blocks of 16 hold 1 to 48"),
    (dict(length=0), "length 0 out of range"),
    (dict(v=torch.randn(6, 2, 8, 64)), "k_blocks and v_blocks must have the same number of blocks, KV heads and block size"),
    (dict(v=torch.randn(5, 2, 16, 64)), "same number of blocks"),
    (dict(k=torch.randn(6, 2, 0, 64), v=torch.randn(6, 2, 0, 64)), "block size (axis 2 of k_blocks) must be at least 1"),
    (dict(q=torch.randn(7, 64)), "query heads must be a multiple of KV heads"),
    (dict(q=torch.randn(8, 32)), "keys and queries differ in head size"),
    (dict(k=torch.randn(6, 2, 64, 16).transpose(-1, -2), v=torch.randn(6, 2, 64, 16).transpose(-1, -2)),
     "cache rows must be contiguous"),
    (dict(out=torch.empty(8, 32)), "out must be float32 [Hq, Dv]"),
])
def test_bad_arguments_are_refused_with_what_is_wrong(arguments, message):
    with pytest.raises(ValueError) as caught:
        _call(**arguments)
    assert message in str(caught.value)


def test_cache_dtype_is_checked():
    k = torch.randn(6, 2, 16, 64, dtype=torch.float64)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        _call(k=k, v=k)
    with pytest.raises(TypeError, match="one dtype"):
        _call(k=torch.randn(6, 2, 16, 64).to(torch.bfloat16))


def test_not_taken_when_disabled_or_not_covered(monkeypatch):
    k_blocks, v_blocks, table = _paged_cache(2, 16, 8, 8, 20, torch.float32, seed=4)
    q = torch.randn(1, 2, 1, 8)
    assert paged_decode_attention(q, k_blocks, v_blocks, table, 20, 1.0) is not None
    assert paged_decode_attention(q, k_blocks.double(), v_blocks.double(), table, 20, 1.0) is None
    assert paged_decode_attention(q, k_blocks, v_blocks.bfloat16(), table, 20, 1.0) is None
    strided = k_blocks.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert paged_decode_attention(q, strided, v_blocks, table, 20, 1.0) is None
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    assert paged_decode_attention(q, k_blocks, v_blocks, table, 20, 1.0) is None
