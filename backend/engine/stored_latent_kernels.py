"""The Triton kernels of ``stored_latent``: MLA's per-head products with kv_b read in the GGUF
blocks the file stores.

Both are batched GEMVs with the heads as a grid axis: head h reads its own rows of the stored
matrix, ``h * HEAD_ROWS + ROW0 ..`` (``R`` of them), and its own input vectors ``x[h, t]``
(strides ``s_xh``, ``s_xt``; unit stride along the vector), writing ``y[h, t]`` (strides
``s_yh``, ``s_yt``) in y's dtype from float32 sums. The weights come from
``stored_linear_kernels._tile`` (every GGML block type the engine reads, the reference
dequantizers' values bit for bit).

- ``head_gemv_kernel``: y[h, t, r] = sum_k W[row(h, r), k] x[h, t, k], the output along the
  rows: W_UV after attention (whole kv_b's v rows, or split attn_v_b), and W_UK folded into
  the queries from a split attn_k_b (each head's W_UK transposed: rows of kv_lora, nope wide);
- ``head_gemv_t_kernel``: y[h, t, k] = sum_r W[row(h, r), k] x[h, t, r], x^T W over a head's
  rows, the output along the blocks' axis: W_UK folded into the queries from a whole kv_b
  (each head's nope rows, kv_lora wide).

Each weight is dequantized once a call and meets every token's input (up to BLOCK_T tokens).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridmoe.backend.engine.stored_linear_kernels import _tile


@triton.jit
def head_gemv_kernel(x_ptr, s_xh, s_xt, w_ptr, grid_ptr, signs_ptr, y_ptr, s_yh, s_yt, T, R, K, HEAD_ROWS, ROW0,
                     row_bytes, TYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (h, i): head h's rows i * BLOCK_R .. of R, over all K columns."""
    h = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    rows = h * HEAD_ROWS + ROW0 + r
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    x_head = x_ptr + h.to(tl.int64) * s_xh
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, c = _tile(w_ptr, rows, r_ok, k0, K, row_bytes, grid_ptr, signs_ptr, TYPE, QK, TS, CHUNK, BLOCK_K)
        x = tl.load(x_head + t[:, None, None] * s_xt + c[None, :, :],
                    mask=t_ok[:, None, None] & (c < K)[None, :, :], other=0).to(tl.float32)  # [BLOCK_T, chunks, CHUNK]
        acc += tl.sum(tl.sum(w[None, :, :, :] * x[:, None, :, :], axis=3), axis=2)
    tl.store(y_ptr + h.to(tl.int64) * s_yh + t[:, None] * s_yt + r[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None] & r_ok[None, :])


@triton.jit
def head_gemv_t_kernel(x_ptr, s_xh, s_xt, w_ptr, grid_ptr, signs_ptr, y_ptr, s_yh, s_yt, T, R, K, HEAD_ROWS, ROW0,
                       row_bytes, TYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (h, j): head h's columns j * BLOCK_K .. of K, summed over its R rows."""
    h = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    x_head = x_ptr + h.to(tl.int64) * s_xh
    acc = tl.zeros([BLOCK_T, BLOCK_K // CHUNK, CHUNK], dtype=tl.float32)
    c = k0 + tl.arange(0, BLOCK_K // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # as _tile's
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < R
        w, _ = _tile(w_ptr, h * HEAD_ROWS + ROW0 + r, r_ok, k0, K, row_bytes, grid_ptr, signs_ptr, TYPE, QK, TS,
                     CHUNK, BLOCK_K)  # [BLOCK_R, chunks, CHUNK], 0 on rows past R
        x = tl.load(x_head + t[:, None] * s_xt + r[None, :], mask=t_ok[:, None] & r_ok[None, :],
                    other=0).to(tl.float32)  # [BLOCK_T, BLOCK_R]
        acc += tl.sum(w[None, :, :, :] * x[:, :, None, None], axis=1)
    tl.store(y_ptr + h.to(tl.int64) * s_yh + t[:, None, None] * s_yt + c[None, :, :], acc.to(y_ptr.dtype.element_ty),
             mask=t_ok[:, None, None] & (c < K)[None, :, :])
