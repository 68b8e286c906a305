"""The Triton kernels of ``stored_experts``: a decode step's GPU routed experts read in the
GGUF blocks the file stores, two launches a layer whatever the number of experts hit.

They are ``decode_experts_kernels``' two launches (gate and up with the activation for every
(token, slot) pair, then down weighted by the routing weight) with the weights dequantized from
their blocks by ``stored_linear_kernels._tile`` (every GGML block type the engine reads, bit
for bit ggml's values) instead of read from a widened copy. Gate, up and down each have a
stack of their own, in a type of their own: llama.cpp's mixes give down more bits than gate
and up (Q4_K_M: Q6_K in half the layers), and nothing forbids gate and up to differ.

Each weight is dequantized once per (token, slot) pair that reads it and summed in float32; the
results are rounded to the compute dtype where ``experts.expert_mlp`` rounds them.

Imported only where Triton is (the tests run these in Triton's interpreter, which must be
switched on before this module is first imported).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridmoe.backend.engine.decode_experts_kernels import _activate, _rounded, _slot
from hybridmoe.backend.engine.stored_linear_kernels import _tile


@triton.jit
def _rows_dot(v_ptr, w_ptr, grid_ptr, signs_ptr, rows, r_ok, K, row_bytes, TYPE: tl.constexpr, QK: tl.constexpr,
              TS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over the K columns of W[rows, c] * v[c] for the BLOCK_R `rows`, float32: W in blocks
    of `TYPE`, `row_bytes` a row."""
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, c = _tile(w_ptr, rows, r_ok, k0, K, row_bytes, grid_ptr, signs_ptr, TYPE, QK, TS, CHUNK, BLOCK_K)
        v = tl.load(v_ptr + c, mask=c < K, other=0).to(tl.float32)  # [chunks, CHUNK]
        acc += tl.sum(tl.sum(w * v[None, :, :], axis=2), axis=1)
    return acc


@triton.jit
def gate_up_kernel(x_ptr, ids_ptr, slot_ptr, h_ptr, gate_ptr, gate_grid, gate_signs, up_ptr, up_grid, up_signs,
                   gate_bias_ptr, up_bias_ptr, K, I, k, n_experts, gate_stride_e, gate_row_bytes, up_stride_e,
                   up_row_bytes, alpha, limit,
                   GATE_TYPE: tl.constexpr, GATE_QK: tl.constexpr, GATE_TS: tl.constexpr, GATE_CHUNK: tl.constexpr,
                   UP_TYPE: tl.constexpr, UP_QK: tl.constexpr, UP_TS: tl.constexpr, UP_CHUNK: tl.constexpr,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[p, i] = act(gate_i(x[t]), up_i(x[t])) for pair p = t * k + slot, BLOCK_I values of i."""
    p = tl.program_id(0)
    s, valid = _slot(ids_ptr, slot_ptr, p, n_experts)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < tl.where(valid, I, 0)  # (a scalar-and-vector `&` is not a mask to the interpreter)
    x_ptr += (p // k) * K
    gate = _rows_dot(x_ptr, gate_ptr + s * gate_stride_e, gate_grid, gate_signs, i, i_ok, K, gate_row_bytes,
                     GATE_TYPE, GATE_QK, GATE_TS, GATE_CHUNK, BLOCK_I, BLOCK_K)
    up = _rows_dot(x_ptr, up_ptr + s * up_stride_e, up_grid, up_signs, i, i_ok, K, up_row_bytes,
                   UP_TYPE, UP_QK, UP_TS, UP_CHUNK, BLOCK_I, BLOCK_K)
    gate = _rounded(gate, x_ptr)
    up = _rounded(up, x_ptr)
    if HAS_BIAS:
        gate = _rounded(gate + tl.load(gate_bias_ptr + s * I + i, mask=i_ok, other=0).to(tl.float32), x_ptr)
        up = _rounded(up + tl.load(up_bias_ptr + s * I + i, mask=i_ok, other=0).to(tl.float32), x_ptr)
    tl.store(h_ptr + p * I + i, _activate(gate, up, x_ptr, alpha, limit, ACT), mask=i < I)


@triton.jit
def down_kernel(h_ptr, ids_ptr, slot_ptr, weights_ptr, y_ptr, x_ptr, w_ptr, grid_ptr, signs_ptr, bias_ptr, I, H,
                n_experts, w_stride_e, row_bytes,
                TYPE: tl.constexpr, QK: tl.constexpr, TS: tl.constexpr, CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[p, r] = weight[p] * down_r(h[p]) (0 for a pair the group does not hold), BLOCK_H rows r;
    x_ptr only gives the compute dtype the products are rounded to."""
    p = tl.program_id(0)
    s, valid = _slot(ids_ptr, slot_ptr, p, n_experts)
    r = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r_ok = r < tl.where(valid, H, 0)
    acc = _rows_dot(h_ptr + p * I, w_ptr + s * w_stride_e, grid_ptr, signs_ptr, r, r_ok, I, row_bytes, TYPE, QK, TS,
                    CHUNK, BLOCK_H, BLOCK_K)
    out = _rounded(acc, x_ptr)
    if HAS_BIAS:
        out = _rounded(out + tl.load(bias_ptr + s * H + r, mask=r_ok, other=0).to(tl.float32), x_ptr)
    weight = tl.load(weights_ptr + p).to(tl.float32)
    tl.store(y_ptr + p * H + r, tl.where(r_ok, out * weight, 0.0), mask=r < H)
