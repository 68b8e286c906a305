"""The Triton kernels of ``decode_experts``: a decode step's routed experts on the GPU in two
launches, whatever the number of experts hit.

A (token, slot) pair routed to a GPU-resident expert is a row of work; pairs of experts the
group does not hold (CPU experts, id -1) come out as zeros. The expert's matrices are read in
place from the group's stacks, in the form they are held: the compute dtype, int8 with one
scale per row, or 4-bit codes (two to a byte, the even column low) with group scales, mins
and a 16-entry table (``int4_weights``). Sums are float32; the results are rounded to the
compute dtype where the reference path (``experts.expert_mlp``) rounds them, so the two agree
to the order of the sums.

Imported only where Triton is (PyTorch's CUDA builds bring it; the tests run the kernels in
Triton's interpreter, which must be switched on before this module is first imported).
"""

from __future__ import annotations

import triton
import triton.language as tl

FORMS = {"dense": 0, "int8": 1, "int4": 2}
ACTS = {"silu": 0, "clamped_swiglu": 1}
# int4 tables the kernels compute instead of looking up: code - 8 ("int"), code ("uint").
TABLES = {"int": 0, "uint": 1}
LOOKUP = 2


@triton.jit
def _slot(ids_ptr, slot_ptr, p, n_experts):
    """The pair's index in the stacks (0 when not held) and whether the group holds it."""
    e = tl.load(ids_ptr + p)
    held = (e >= 0) & (e < n_experts)
    s = tl.load(slot_ptr + tl.where(held, e, 0))
    valid = held & (s >= 0)
    return tl.where(valid, s, 0).to(tl.int64), valid


@triton.jit
def _rows_dot(v_ptr, w_ptr, scale_ptr, min_ptr, table_ptr, rows, row_ok, K, k0, w_stride_r, s_stride_r,
              FORM: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, TABLE: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """sum over BLOCK_K columns from k0 of W[rows, c] * v[c], float32 (int8: before the row scale)."""
    if FORM == 2:
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # code bytes: columns 2j (low nibble) and 2j + 1
        j_ok = j < K // 2
        m = row_ok[:, None] & j_ok[None, :]
        even = tl.load(v_ptr + 2 * j, mask=j_ok, other=0).to(tl.float32)
        odd = tl.load(v_ptr + 2 * j + 1, mask=j_ok, other=0).to(tl.float32)
        b = tl.load(w_ptr + rows[:, None] * w_stride_r + j[None, :], mask=m, other=0).to(tl.int32)
        lo = b & 15
        hi = b >> 4
        if TABLE == 0:
            vl = (lo - 8).to(tl.float32)
            vh = (hi - 8).to(tl.float32)
        elif TABLE == 1:
            vl = lo.to(tl.float32)
            vh = hi.to(tl.float32)
        else:
            vl = tl.load(table_ptr + lo)
            vh = tl.load(table_ptr + hi)
        g = rows[:, None] * s_stride_r + ((2 * j) // GROUP)[None, :]
        part = (vl * even[None, :] + vh * odd[None, :]) * tl.load(scale_ptr + g, mask=m, other=0).to(tl.float32)
        if HAS_MIN:
            part += tl.load(min_ptr + g, mask=m, other=0).to(tl.float32) * (even + odd)[None, :]
    else:
        c = k0 + tl.arange(0, BLOCK_K)
        c_ok = c < K
        v = tl.load(v_ptr + c, mask=c_ok, other=0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * w_stride_r + c[None, :], mask=row_ok[:, None] & c_ok[None, :], other=0)
        part = w.to(tl.float32) * v[None, :]
    return tl.sum(part, axis=1)


@triton.jit
def _rounded(v, like_ptr):
    """v rounded to the dtype `like_ptr` points to, as float32."""
    return v.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _activate(gate, up, like_ptr, alpha, limit, ACT: tl.constexpr):
    """The expert's activation of its gate and up values (float32, already rounded to the
    compute dtype `like_ptr` points to), rounded where torch rounds it."""
    if ACT == 0:  # silu(gate) * up
        h = _rounded(_rounded(gate * tl.sigmoid(gate), like_ptr) * up, like_ptr)
    else:  # GPT-OSS: clamped SwiGLU with slope alpha, up shifted by one
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = _rounded((up + 1) * _rounded(gate * tl.sigmoid(gate * alpha), like_ptr), like_ptr)
    return h


@triton.jit
def gate_up_kernel(x_ptr, ids_ptr, slot_ptr, h_ptr, w_ptr, scale_ptr, min_ptr, table_ptr, bias_ptr,
                   K, I, k, n_experts, w_stride_e, w_stride_r, s_stride_e, s_stride_r,
                   gate_step, up_first, up_step, alpha, limit,
                   FORM: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, TABLE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[p, i] = act(gate_i(x[t]), up_i(x[t])) for pair p = t * k + slot, BLOCK_I values of i."""
    p = tl.program_id(0)
    s, valid = _slot(ids_ptr, slot_ptr, p, n_experts)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < tl.where(valid, I, 0)  # (a scalar-and-vector `&` is not a mask to the interpreter)
    gate_rows = i * gate_step
    up_rows = up_first + i * up_step
    w_ptr += s * w_stride_e
    scale_ptr += s * s_stride_e
    min_ptr += s * s_stride_e
    x_ptr += (p // k) * K
    gate = tl.zeros([BLOCK_I], dtype=tl.float32)
    up = tl.zeros([BLOCK_I], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        gate += _rows_dot(x_ptr, w_ptr, scale_ptr, min_ptr, table_ptr, gate_rows, i_ok, K, k0, w_stride_r,
                          s_stride_r, FORM, GROUP, HAS_MIN, TABLE, BLOCK_K)
        up += _rows_dot(x_ptr, w_ptr, scale_ptr, min_ptr, table_ptr, up_rows, i_ok, K, k0, w_stride_r,
                        s_stride_r, FORM, GROUP, HAS_MIN, TABLE, BLOCK_K)
    if FORM == 1:
        gate *= tl.load(scale_ptr + gate_rows, mask=i_ok, other=0).to(tl.float32)
        up *= tl.load(scale_ptr + up_rows, mask=i_ok, other=0).to(tl.float32)
    gate = _rounded(gate, x_ptr)
    up = _rounded(up, x_ptr)
    if HAS_BIAS:
        bias_ptr += s * 2 * I
        gate = _rounded(gate + tl.load(bias_ptr + gate_rows, mask=i_ok, other=0).to(tl.float32), x_ptr)
        up = _rounded(up + tl.load(bias_ptr + up_rows, mask=i_ok, other=0).to(tl.float32), x_ptr)
    tl.store(h_ptr + p * I + i, _activate(gate, up, x_ptr, alpha, limit, ACT), mask=i < I)


@triton.jit
def down_kernel(h_ptr, ids_ptr, slot_ptr, weights_ptr, y_ptr, x_ptr, w_ptr, scale_ptr, min_ptr, table_ptr,
                bias_ptr, I, H, n_experts, w_stride_e, w_stride_r, s_stride_e, s_stride_r,
                FORM: tl.constexpr, GROUP: tl.constexpr, HAS_MIN: tl.constexpr, TABLE: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[p, r] = weight[p] * down_r(h[p]) (0 for a pair the group does not hold), BLOCK_H rows r;
    x_ptr only gives the compute dtype the products are rounded to."""
    p = tl.program_id(0)
    s, valid = _slot(ids_ptr, slot_ptr, p, n_experts)
    r = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r_ok = r < tl.where(valid, H, 0)
    w_ptr += s * w_stride_e
    scale_ptr += s * s_stride_e
    min_ptr += s * s_stride_e
    h_ptr += p * I
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        acc += _rows_dot(h_ptr, w_ptr, scale_ptr, min_ptr, table_ptr, r, r_ok, I, k0, w_stride_r, s_stride_r,
                         FORM, GROUP, HAS_MIN, TABLE, BLOCK_K)
    if FORM == 1:
        acc *= tl.load(scale_ptr + r, mask=r_ok, other=0).to(tl.float32)
    out = _rounded(acc, x_ptr)
    if HAS_BIAS:
        out = _rounded(out + tl.load(bias_ptr + s * H + r, mask=r_ok, other=0).to(tl.float32), x_ptr)
    weight = tl.load(weights_ptr + p).to(tl.float32)
    tl.store(y_ptr + p * H + r, tl.where(r_ok, out * weight, 0.0), mask=r < H)
