"""The Triton GEMV of ``int4_weights``: y = x W^T for the few tokens a decode step routes to
a GPU expert held as 4-bit codes, a 16-entry table and group scales (and mins).

Imported only where Triton is (PyTorch's CUDA builds bring it; the tests install it and run
the kernel in Triton's interpreter).
"""

from __future__ import annotations

from functools import cache

import triton
import triton.language as tl


def int4_gemv(x_ptr, codes_ptr, scale_ptr, min_ptr, table_ptr, y_ptr, T, N, K, n_groups,
              GROUP: tl.constexpr, HAS_MIN: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One program: BLOCK_N output rows for BLOCK_T tokens, over all of K, in float32. Each code
    # byte is loaded for both its columns (the second load hits the line the first brought).
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    tok_ok = toks < T
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        mask = row_ok[:, None] & col_ok[None, :]
        byte = tl.load(codes_ptr + rows[:, None] * (K // 2) + (cols // 2)[None, :], mask=mask, other=0)
        code = (byte >> ((cols % 2) * 4).to(tl.uint8)[None, :]) & 0x0F
        group = rows[:, None] * n_groups + (cols // GROUP)[None, :]
        w = tl.load(table_ptr + code.to(tl.int32)) * tl.load(scale_ptr + group, mask=mask, other=0).to(tl.float32)
        if HAS_MIN:
            w += tl.load(min_ptr + group, mask=mask, other=0).to(tl.float32)
        xv = tl.load(x_ptr + toks[:, None] * K + cols[None, :], mask=tok_ok[:, None] & col_ok[None, :],
                     other=0).to(tl.float32)
        acc += tl.sum(xv[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + toks[:, None] * N + rows[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tok_ok[:, None] & row_ok[None, :])


@cache
def compiled():
    """The kernel, compiled for the GPU on first use; under TRITON_INTERPRET=1 (set before
    Triton is imported, as the tests do in a process of their own) Triton's interpreter runs it
    on CPU tensors."""
    return triton.jit(int4_gemv)
