"""The Triton kernels of ``stored_linear``: a GGUF matrix read on the GPU in the blocks the
file stores, for every block type the engine reads.

``_value`` gives the weight at (row, column) of a stored matrix from the bytes of its block:
one branch per GGML type (chosen at compile time by the type's number, ``TYPE``), each the
same float operations in the same order as the torch dequantizers of ``formats.quant`` and
``formats.iquants`` (themselves ggml's), so a dequantized tile equals theirs. Two kernels use
it: ``gemv_kernel`` (a few tokens: every weight read once, multiplied into each token's sum in
float32) and ``dequantize_kernel`` (a tile of rows in the compute dtype, for a prompt's
tensor-core matmul).

The block geometry (weights and bytes per block) is gguf's ``GGML_QUANT_SIZES``; the grids and
sign table of the grid types come from ``formats.iquants`` (``stored_linear`` passes them).
Imported only where Triton is; the tests run these kernels in Triton's interpreter, which must
be switched on before this module is first imported.
"""

from __future__ import annotations

import triton
import triton.language as tl

# GGML type numbers (gguf.GGMLQuantizationType), as compile-time constants of the kernels.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M = 16, 17, 18, 19, 20, 21, 22, 23, 29
MXFP4 = 39

# Weights per chunk (``_value``): a 32-weight block or sub-block, or 16 where the sub-blocks are.
CHUNKS = {Q2_K: 16, Q3_K: 16, Q6_K: 16}


@triton.jit
def _u8(p, off, m):
    """The byte at p + off, as int32 (0 where masked off)."""
    return tl.load(p + off, mask=m, other=0).to(tl.int32)


@triton.jit
def _i8(p, off, m):
    b = _u8(p, off, m)
    return b - ((b >> 7) << 8)


@triton.jit
def _u16(p, off, m):
    return _u8(p, off, m) | (_u8(p, off + 1, m) << 8)


@triton.jit
def _u32(p, off, m):
    """A little-endian 32-bit word as int32 (the top bit lands in the sign: mask after shifts)."""
    return _u16(p, off, m) | (_u16(p, off + 2, m) << 16)


@triton.jit
def _bits_to_half(bits):
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16(p, off, m):
    return _bits_to_half(_u16(p, off, m))


@triton.jit
def _nibble32(p, qs, j, m):
    """Element j of a 32-weight block's 16 code bytes at qs: low nibbles are 0-15, high 16-31."""
    return (_u8(p, qs + (j & 15), m) >> ((j >> 4) << 2)) & 15


@triton.jit
def _k_scale_min(p, s, m):
    """Q4_K/Q5_K sub-block s's 6-bit scale and min from the 12 bytes at offset 4."""
    i = s & 3
    a = _u8(p, 4 + i, m)
    b = _u8(p, 8 + i, m)
    c = _u8(p, 12 + i, m)
    low = s < 4
    sc = tl.where(low, a & 63, (c & 15) | ((a >> 2) & 0x30))
    mn = tl.where(low, b & 63, (c >> 4) | ((b >> 2) & 0x30))
    return sc, mn


@triton.jit
def _signed(sign_byte, e):
    """+1 or -1: bit e of the sign byte set means negative."""
    return 1.0 - 2.0 * ((sign_byte >> e) & 1).to(tl.float32)


@triton.jit
def _value(p, j0, j, m, grid_ptr, signs_ptr, TYPE: tl.constexpr):
    """Weights j of the blocks at p, float32, as ggml dequantizes them. The weights come in chunks
    (``CHUNK``: 32, or 16 for the types with 16-weight sub-blocks): p [.., chunks, 1] points at
    each chunk's block, j0 [.., chunks, 1] is the chunk's first weight in its block and j
    [.., chunks, CHUNK] each weight's; m [.., chunks, 1] masks whole chunks. What a chunk
    shares (block scales, sub-block scales, high bits, sign words) is loaded once per chunk,
    by offsets of j0; codes once per weight."""
    if TYPE == Q8_0:
        v = _f16(p, 0, m) * _i8(p, 2 + j, m).to(tl.float32)
    elif TYPE == Q4_0:
        v = _f16(p, 0, m) * (_nibble32(p, 2, j, m) - 8).to(tl.float32)
    elif TYPE == Q4_1:
        v = _f16(p, 0, m) * _nibble32(p, 4, j, m).to(tl.float32) + _f16(p, 2, m)
    elif TYPE == Q5_0:
        q = _nibble32(p, 6, j, m) | (((_u32(p, 2, m) >> j) & 1) << 4)
        v = _f16(p, 0, m) * (q - 16).to(tl.float32)
    elif TYPE == Q5_1:
        q = _nibble32(p, 8, j, m) | (((_u32(p, 4, m) >> j) & 1) << 4)
        v = _f16(p, 0, m) * q.to(tl.float32) + _f16(p, 2, m)
    elif TYPE == Q2_K:  # scales[16] | qs[64] | d | dmin; 16-weight sub-blocks (chunks of 16)
        q = (_u8(p, 16 + (j >> 7) * 32 + (j & 31), m) >> (((j >> 5) & 3) * 2)) & 3
        sc = _u8(p, j0 >> 4, m)
        dl = _f16(p, 80, m) * (sc & 15).to(tl.float32)
        ml = _f16(p, 82, m) * (sc >> 4).to(tl.float32)
        v = dl * q.to(tl.float32) - ml
    elif TYPE == Q3_K:  # hmask[32] | qs[64] | scales[12] | d; 6-bit signed sub-block scales (chunks of 16)
        s = j0 >> 4
        low = (_u8(p, 96 + (s & 7), m) >> ((s >> 3) * 4)) & 15
        high = (_u8(p, 104 + (s & 3), m) >> ((s >> 2) * 2)) & 3
        dl = _f16(p, 108, m) * ((low | (high << 4)) - 32).to(tl.float32)
        ql = (_u8(p, 32 + (j >> 7) * 32 + (j & 31), m) >> (((j >> 5) & 3) * 2)) & 3
        hbit = (_u8(p, j & 31, m) >> (j0 >> 5)) & 1
        v = dl * (ql - ((hbit ^ 1) << 2)).to(tl.float32)
    elif TYPE == Q4_K or TYPE == Q5_K:  # d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128]
        s = j0 >> 5
        sc, mn = _k_scale_min(p, s, m)
        dl = _f16(p, 0, m) * sc.to(tl.float32)
        ml = _f16(p, 2, m) * mn.to(tl.float32)
        if TYPE == Q4_K:
            q = (_u8(p, 16 + (j0 >> 6) * 32 + (j & 31), m) >> ((s & 1) * 4)) & 15
        else:
            q = (_u8(p, 48 + (j0 >> 6) * 32 + (j & 31), m) >> ((s & 1) * 4)) & 15
            q = q | (((_u8(p, 16 + (j & 31), m) >> s) & 1) << 4)
        v = dl * q.to(tl.float32) - ml
    elif TYPE == Q6_K:  # ql[128] | qh[64] | scales[16] int8 | d (chunks of 16)
        lo = (_u8(p, (j >> 7) * 64 + (j & 63), m) >> (((j0 >> 6) & 1) * 4)) & 15
        hi = (_u8(p, 128 + (j >> 7) * 32 + (j & 31), m) >> (((j0 >> 5) & 3) * 2)) & 3
        dl = _f16(p, 208, m) * _i8(p, 192 + (j0 >> 4), m).to(tl.float32)
        v = dl * ((lo | (hi << 4)) - 32).to(tl.float32)
    elif TYPE == IQ4_NL:
        v = _f16(p, 0, m) * tl.load(grid_ptr + _nibble32(p, 2, j, m))
    elif TYPE == IQ4_XS:  # d | scales_h (u16) | scales_l[4] | qs[128]
        s = j0 >> 5
        sl = (_u8(p, 4 + (s >> 1), m) >> ((s & 1) * 4)) & 15
        sh = (_u16(p, 2, m) >> (s * 2)) & 3
        dl = _f16(p, 0, m) * ((sl | (sh << 4)) - 32).to(tl.float32)
        q = (_u8(p, 8 + s * 16 + (j & 15), m) >> (((j >> 4) & 1) * 4)) & 15
        v = dl * tl.load(grid_ptr + q)
    elif TYPE == MXFP4:  # e8m0 | qs[16]; the grid holds the e2m1 values doubled, the scale is halved
        e = _u8(p, 0, m)
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        v = bits.to(tl.float32, bitcast=True) * tl.load(grid_ptr + _nibble32(p, 1, j, m))
    elif TYPE == IQ2_XXS:  # d | 8 x (4 grid indices, u32 of 4 x 7 sign fields and a 4-bit scale)
        at = 2 + (j0 >> 5) * 8
        w = _u32(p, at + 4, m)
        db = _f16(p, 0, m) * (0.5 + ((w >> 28) & 15).to(tl.float32)) * 0.25
        sign = tl.load(signs_ptr + ((w >> (((j >> 3) & 3) * 7)) & 127))
        v = db * tl.load(grid_ptr + _u8(p, at + ((j >> 3) & 3), m) * 8 + (j & 7)) * _signed(sign, j & 7)
    elif TYPE == IQ2_XS:  # d | qs u16[32] (9-bit index, 7-bit sign field) | scales[8]
        q = _u16(p, 2 + (j >> 3) * 2, m)
        sc = (_u8(p, 66 + (j0 >> 5), m) >> (((j >> 4) & 1) * 4)) & 15
        db = _f16(p, 0, m) * (0.5 + sc.to(tl.float32)) * 0.25
        v = db * tl.load(grid_ptr + (q & 511) * 8 + (j & 7)) * _signed(tl.load(signs_ptr + (q >> 9)), j & 7)
    elif TYPE == IQ2_S:  # d | qs[32] | signs[32] | qh[8] | scales[8]
        g = j >> 3  # group of 8: sub-block g >> 2, l = g & 3
        idx = _u8(p, 2 + g, m) | ((_u8(p, 66 + (j0 >> 5), m) << (8 - 2 * (g & 3))) & 0x300)
        sc = (_u8(p, 74 + (j0 >> 5), m) >> (((j >> 4) & 1) * 4)) & 15
        db = _f16(p, 0, m) * (0.5 + sc.to(tl.float32)) * 0.25
        v = db * tl.load(grid_ptr + idx * 8 + (j & 7)) * _signed(_u8(p, 34 + g, m), j & 7)
    elif TYPE == IQ3_XXS:  # d | qs[64] (4-value grid entries) | 8 x u32 (sign fields, scale)
        w = _u32(p, 66 + (j0 >> 5) * 4, m)
        db = _f16(p, 0, m) * (0.5 + ((w >> 28) & 15).to(tl.float32)) * 0.5
        sign = tl.load(signs_ptr + ((w >> (((j >> 3) & 3) * 7)) & 127))
        v = db * tl.load(grid_ptr + _u8(p, 2 + (j >> 2), m) * 4 + (j & 3)) * _signed(sign, j & 7)
    elif TYPE == IQ3_S:  # d | qs[64] | qh[8] | signs[32] | scales[4]
        ib = j0 >> 5
        s = (_u8(p, 106 + (ib >> 1), m) >> ((ib & 1) * 4)) & 15
        db = _f16(p, 0, m) * (1 + 2 * s).to(tl.float32)
        idx = _u8(p, 2 + (j >> 2), m) | (((_u8(p, 66 + ib, m) >> ((j >> 2) & 7)) & 1) << 8)
        v = db * tl.load(grid_ptr + idx * 4 + (j & 3)) * _signed(_u8(p, 74 + (j >> 3), m), j & 7)
    elif TYPE == IQ1_S:  # d | qs[32] | qh u16[8] (3 high index bits x 4, 3-bit scale, delta sign)
        qh = _u16(p, 34 + (j0 >> 5) * 2, m)
        dl = _f16(p, 0, m) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        idx = _u8(p, 2 + (j >> 3), m) | (((qh >> (3 * ((j >> 3) & 3))) & 7) << 8)
        delta = tl.where((qh & 0x8000) != 0, -0.125, 0.125)
        v = dl * (tl.load(grid_ptr + idx * 8 + (j & 7)) + delta)
    else:
        tl.static_assert(TYPE == IQ1_M, "a GGML type the kernels do not read")
        # qs[32] | qh[16] | scales u16[4] (3-bit scales, and d's 16 bits in their top nibbles)
        d = _bits_to_half(((_u16(p, 48, m) >> 12) & 0xF) | ((_u16(p, 50, m) >> 8) & 0xF0)
                          | ((_u16(p, 52, m) >> 4) & 0xF00) | (_u16(p, 54, m) & 0xF000))
        ib = j0 >> 5
        g = (j >> 3) & 3
        per = _u16(p, 48 + (ib >> 1) * 2, m) >> ((ib & 1) * 6)
        dl = d * (2 * ((per >> ((g >> 1) * 3)) & 7) + 1).to(tl.float32)
        h = _u8(p, 32 + ib * 2 + (g >> 1), m)
        idx = _u8(p, j >> 3, m) | ((h << (8 - (g & 1) * 4)) & 0x700)
        delta = tl.where((h & (0x08 << ((g & 1) * 4))) != 0, -0.125, 0.125)
        v = dl * (tl.load(grid_ptr + idx * 8 + (j & 7)) + delta)
    return v


@triton.jit
def _tile(w_ptr, rows, r_ok, k0, K, row_bytes, grid_ptr, signs_ptr, TYPE: tl.constexpr, QK: tl.constexpr,
          TS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weights of `rows` in columns k0 .. k0 + BLOCK_K as [len(rows), BLOCK_K // CHUNK, CHUNK],
    float32 (0 where masked off), and those columns' indices in the same shape."""
    c0 = k0 + tl.arange(0, BLOCK_K // CHUNK) * CHUNK  # each chunk's first column
    e = tl.arange(0, CHUNK)
    m = r_ok[:, None, None] & (c0 < K)[None, :, None]  # K is whole blocks: a chunk is all in or all out
    p = w_ptr + rows.to(tl.int64)[:, None, None] * row_bytes + ((c0 // QK) * TS)[None, :, None]
    j0 = (c0 % QK)[None, :, None]
    w = _value(p, j0, j0 + e[None, None, :], m, grid_ptr, signs_ptr, TYPE)
    return w, c0[:, None] + e[None, :]


@triton.jit
def gemv_kernel(x_ptr, w_ptr, grid_ptr, signs_ptr, y_ptr, T, N, K, row_bytes,
                TYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[t, r] = sum_c W[r, c] x[t, c] for the T (<= BLOCK_T) tokens, BLOCK_R rows a program:
    each weight is dequantized once and meets every token's activations, float32 sums."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < N
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, c = _tile(w_ptr, rows, r_ok, k0, K, row_bytes, grid_ptr, signs_ptr, TYPE, QK, TS, CHUNK, BLOCK_K)
        x = tl.load(x_ptr + t[:, None, None] * K + c[None, :, :], mask=t_ok[:, None, None] & (c < K)[None, :, :],
                    other=0).to(tl.float32)  # [BLOCK_T, chunks, CHUNK]
        acc += tl.sum(tl.sum(w[None, :, :, :] * x[:, None, :, :], axis=3), axis=2)
    tl.store(y_ptr + t[:, None] * N + rows[None, :], acc, mask=t_ok[:, None] & r_ok[None, :])


@triton.jit
def dequantize_kernel(w_ptr, grid_ptr, signs_ptr, out_ptr, N, K, row_bytes,
                      TYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[r, c] = W[r, c] rounded to out's dtype, a BLOCK_R x BLOCK_K tile a program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < N
    w, c = _tile(w_ptr, rows, r_ok, tl.program_id(1) * BLOCK_K, K, row_bytes, grid_ptr, signs_ptr, TYPE, QK, TS,
                 CHUNK, BLOCK_K)
    tl.store(out_ptr + rows.to(tl.int64)[:, None, None] * K + c[None, :, :], w.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None, None] & (c < K)[None, :, :])
