"""The Triton kernels of ``paged_decode``: a decode step's attention on the GPU in two launches.

``rope_store_kernel``: one program per (row, head). A query head is normalised (per-head RMSNorm,
where the model has one), rotated and written out; a key head likewise, written into its block
of the paged cache with the value head beside it. ``attend_kernel``: one program per (row, query
head) reads its sequence's keys and values block by block through the block table, with the
softmax kept online (float32), and writes the head's output.

Rounding follows the reference path (``layers.RMSNorm``, ``rope.Rotary.apply``): the norm in
float32, rounded to the compute dtype before (or after) the weight; the rotation's products and
sums each rounded to the compute dtype unless the model rotates in float32.

Imported only where Triton is (the tests run the kernels in Triton's interpreter, which must be
switched on before this module is first imported).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _normed(ptr, idx, ok, w_ptr, inv, HAS_NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, DT: tl.constexpr):
    """Elements `idx` of a head, normalised by `inv` (1/rms) and weighted as the model's RMSNorm
    does, as float32 values of the compute dtype."""
    x = tl.load(ptr + idx, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:
        w = tl.load(w_ptr + idx, mask=ok, other=0.0).to(tl.float32)
        if ROUND_BEFORE_WEIGHT:
            x = (w * (x * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        else:
            x = (w * x * inv).to(DT).to(tl.float32)
    return x


@triton.jit
def _rotated(src, offs, ok, pos, w_ptr, eps, D, cos_ptr, sin_ptr, half, src_a_ptr, src_b_ptr, sign_ptr, RD,
             HAS_NORM: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, FLOAT32_MATH: tl.constexpr, DT: tl.constexpr):
    """A head at `src` (D features), RMS-normalised when HAS_NORM, rotated for position `pos`
    over its first RD features, in the compute dtype DT."""
    inv = 1.0
    if HAS_NORM:
        x = tl.load(src + offs, mask=ok, other=0.0).to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    # out[i] = x[a(i)] cos[c(i)] + sign(i) x[b(i)] sin[c(i)] for i < RD (both layouts come down
    # to this with the index vectors ``paged_decode`` makes); x[i] past RD.
    a = tl.load(src_a_ptr + offs, mask=ok, other=0)
    b = tl.load(src_b_ptr + offs, mask=ok, other=0)
    sign = tl.load(sign_ptr + offs, mask=ok, other=0.0)
    c = offs % half
    rot = offs < RD
    xa = _normed(src, a, ok, w_ptr, inv, HAS_NORM, ROUND_BEFORE_WEIGHT, DT)
    xb = _normed(src, b, ok & rot, w_ptr, inv, HAS_NORM, ROUND_BEFORE_WEIGHT, DT)
    cos = tl.load(cos_ptr + pos * half + c, mask=ok & rot, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * half + c, mask=ok & rot, other=0.0).to(tl.float32)
    if FLOAT32_MATH:
        out = xa * cos + sign * (xb * sin)
    else:
        cos = cos.to(DT).to(tl.float32)
        sin = sin.to(DT).to(tl.float32)
        out = ((xa * cos).to(DT).to(tl.float32) + sign * (xb * sin).to(DT).to(tl.float32))
    return tl.where(rot, out, xa).to(DT)


# A step's table width (its longest sequence's blocks) changes as sequences grow: not a value
# to compile a kernel for (Triton specialises integers that are 1 or multiples of 16).
@triton.jit(do_not_specialize=["meta_stride"])
def rope_store_kernel(q_ptr, k_ptr, v_ptr, q_st, q_sh, k_st, k_sh, v_st, v_sh, q_out_ptr, qn_ptr, kn_ptr, eps,
                      cos_ptr, sin_ptr, half, src_a_ptr, src_b_ptr, sign_ptr, meta_ptr, meta_stride,
                      k_cache_ptr, v_cache_ptr, kc_sb, kc_sh, vc_sb, vc_sh, Hq, D, Dv, RD,
                      BLOCK: tl.constexpr, DP: tl.constexpr, HAS_NORM: tl.constexpr,
                      ROUND_BEFORE_WEIGHT: tl.constexpr, FLOAT32_MATH: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    DT = q_ptr.dtype.element_ty
    pos = tl.load(meta_ptr + t * meta_stride)
    offs = tl.arange(0, DP)
    ok = offs < D
    is_q = h < Hq
    j = h - Hq
    if is_q:
        src = q_ptr + t * q_st + h * q_sh
        w_ptr = qn_ptr
    else:
        src = k_ptr + t * k_st + j * k_sh
        w_ptr = kn_ptr
    out = _rotated(src, offs, ok, pos, w_ptr, eps, D, cos_ptr, sin_ptr, half, src_a_ptr, src_b_ptr, sign_ptr, RD,
                   HAS_NORM, ROUND_BEFORE_WEIGHT, FLOAT32_MATH, DT)
    if is_q:
        tl.store(q_out_ptr + (t * Hq + h) * D + offs, out, mask=ok)
    else:
        block = tl.load(meta_ptr + t * meta_stride + 1 + pos // BLOCK)
        row = pos % BLOCK
        kc = k_cache_ptr + block * kc_sb + j * kc_sh + row * D
        tl.store(kc + offs, out.to(k_cache_ptr.dtype.element_ty), mask=ok)
        v_ok = offs < Dv
        v = tl.load(v_ptr + t * v_st + j * v_sh + offs, mask=v_ok, other=0.0)
        vc = v_cache_ptr + block * vc_sb + j * vc_sh + row * Dv
        tl.store(vc + offs, v.to(v_cache_ptr.dtype.element_ty), mask=v_ok)


@triton.jit(do_not_specialize=["meta_stride"])
def attend_kernel(q_ptr, out_ptr, meta_ptr, meta_stride, k_cache_ptr, v_cache_ptr, kc_sb, kc_sh, vc_sb, vc_sh,
                  Hq, group, D, Dv, scale, BLOCK: tl.constexpr, DP: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kv = h // group
    length = tl.load(meta_ptr + t * meta_stride) + 1
    offs_d = tl.arange(0, DP)
    offs_n = tl.arange(0, BLOCK)
    d_ok = offs_d < D
    dv_ok = offs_d < Dv
    q = tl.load(q_ptr + (t * Hq + h) * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    l_sum = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
    acc = tl.zeros([DP], tl.float32)
    n_blocks = (length + BLOCK - 1) // BLOCK
    for i in range(0, n_blocks):
        block = tl.load(meta_ptr + t * meta_stride + 1 + i)
        keys_ok = i * BLOCK + offs_n < length
        kp = k_cache_ptr + block * kc_sb + kv * kc_sh + offs_n[:, None] * D + offs_d[None, :]
        k = tl.load(kp, mask=keys_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(keys_ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        l_sum = l_sum * alpha + tl.sum(p, axis=0)
        vp = v_cache_ptr + block * vc_sb + kv * vc_sh + offs_n[:, None] * Dv + offs_d[None, :]
        v = tl.load(vp, mask=keys_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / l_sum
    tl.store(out_ptr + (t * Hq + h) * Dv + offs_d, out.to(out_ptr.dtype.element_ty), mask=dv_ok)


@triton.jit(do_not_specialize=["meta_stride"])
def latent_rope_store_kernel(q_ptr, q_st, latent_ptr, lat_st, kr_ptr, kr_st, q_rope_ptr, cos_ptr, sin_ptr, half,
                             src_a_ptr, src_b_ptr, sign_ptr, meta_ptr, meta_stride, cache_ptr, c_sb, c_sp, H, NOPE,
                             R, C, BLOCK: tl.constexpr, RP: tl.constexpr, CP: tl.constexpr,
                             FLOAT32_MATH: tl.constexpr):
    """Latent attention: program (row, h < H) rotates head h's rotary query into q_rope [rows,
    H, R]; program (row, H) rotates the row's rotary key and writes it with the latent into the
    row's place in the cache ([blocks, BLOCK, C + R])."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    DT = q_ptr.dtype.element_ty
    pos = tl.load(meta_ptr + t * meta_stride)
    offs = tl.arange(0, RP)
    ok = offs < R
    is_q = h < H
    if is_q:
        src = q_ptr + t * q_st + h * (NOPE + R) + NOPE
    else:
        src = kr_ptr + t * kr_st
    out = _rotated(src, offs, ok, pos, src, 0.0, R, cos_ptr, sin_ptr, half, src_a_ptr, src_b_ptr, sign_ptr, R,
                   False, False, FLOAT32_MATH, DT)
    if is_q:
        tl.store(q_rope_ptr + (t * H + h) * R + offs, out, mask=ok)
    else:
        block = tl.load(meta_ptr + t * meta_stride + 1 + pos // BLOCK)
        row = cache_ptr + block * c_sb + (pos % BLOCK) * c_sp
        tl.store(row + C + offs, out.to(cache_ptr.dtype.element_ty), mask=ok)
        offs_c = tl.arange(0, CP)
        c_ok = offs_c < C
        latent = tl.load(latent_ptr + t * lat_st + offs_c, mask=c_ok, other=0.0)
        tl.store(row + offs_c, latent.to(cache_ptr.dtype.element_ty), mask=c_ok)


@triton.jit(do_not_specialize=["meta_stride"])
def latent_attend_kernel(ql_ptr, ql_sh, ql_st, qr_ptr, out_ptr, o_sh, o_st, meta_ptr, meta_stride, cache_ptr, c_sb,
                         c_sp, H, C, R, scale, BLOCK: tl.constexpr, KT: tl.constexpr, HB: tl.constexpr,
                         CP: tl.constexpr, RP: tl.constexpr, PRECISION: tl.constexpr):
    """Latent attention, absorbed: program (row, block of HB heads) scores the heads' latent
    queries ql [H, rows, C] and rotary queries qr [rows, H, R] against the row's cached
    [latent | rotary key] rows, KT positions at a time, and writes the attended latents
    [H, rows, C]. Every head reads the same cache rows: a block of heads shares each tile.
    PRECISION "ieee" for float32 models (tf32 would round their inputs), else "tf32"."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    h_ok = heads < H
    length = tl.load(meta_ptr + t * meta_stride) + 1
    offs_c = tl.arange(0, CP)
    offs_r = tl.arange(0, RP)
    offs_k = tl.arange(0, KT)
    c_ok = offs_c < C
    r_ok = offs_r < R
    # Products in float32 tiles: exact for bf16/fp16 values with PRECISION "tf32" too (10 bits of
    # mantissa), and Triton's interpreter, which the tests run, multiplies bf16 tiles wrongly.
    ql = tl.load(ql_ptr + heads[:, None] * ql_sh + t * ql_st + offs_c[None, :], mask=h_ok[:, None] & c_ok[None, :],
                 other=0.0).to(tl.float32)
    qr = tl.load(qr_ptr + (t * H + heads[:, None]) * R + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :],
                 other=0.0).to(tl.float32)
    m = tl.full([HB], float("-inf"), tl.float32)
    l_sum = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, CP], tl.float32)
    for i in range(0, (length + KT - 1) // KT):
        p0 = i * KT
        block = tl.load(meta_ptr + t * meta_stride + 1 + p0 // BLOCK)
        keys_ok = p0 + offs_k < length
        rows = cache_ptr + block * c_sb + (p0 % BLOCK + offs_k)[:, None] * c_sp
        kl = tl.load(rows + offs_c[None, :], mask=keys_ok[:, None] & c_ok[None, :], other=0.0)
        kr = tl.load(rows + C + offs_r[None, :], mask=keys_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        s = (tl.dot(ql, tl.trans(kl.to(tl.float32)), input_precision=PRECISION)
             + tl.dot(qr, tl.trans(kr), input_precision=PRECISION))
        s = tl.where(keys_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        # The probabilities in the cache's dtype, as the reference rounds them before its product.
        acc = acc * alpha[:, None] + tl.dot(p.to(kl.dtype).to(tl.float32), kl.to(tl.float32), input_precision=PRECISION)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + heads[:, None] * o_sh + t * o_st + offs_c[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & c_ok[None, :])
