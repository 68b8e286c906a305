"""Latent attention over kv_b's maps as a GGUF stores them (attn_k_b / attn_v_b, read in place:
backend/engine/latent_maps.py, native/src/mla_decode.h) against the math on their floats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.backend.bench.synthetic_experts import FLOAT_FORMATS, random_matrix
from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.latent_maps import StoredMaps
from hybridmoe.backend.engine.native_kernels import Unsupported
from hybridmoe.backend.formats.gguf_weights import join_kv_b
from hybridmoe.backend.formats.weights import dense

from .test_native_experts import act_group, q8, rel_err

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")

H, NOPE, ROPE, V, C, B = 4, 64, 16, 32, 256, 16  # C: whole K-quant super-blocks for the value maps
SCALE = 0.2


def reference(q, k_b, v_b, cache, table, start):
    """Per row t (position start + t, causal) and head: the absorbed form in float32, with the
    maps' inputs rounded to 8 bits where a map is quantized (as the kernels read them)."""
    k = dense(k_b, torch.float32, "cpu").view(H, C, NOPE)
    v = dense(v_b, torch.float32, "cpu").view(H, V, C)
    rk = (lambda x: x) if isinstance(k_b, torch.Tensor) else (lambda x: q8(x, act_group(k_b.format)))
    rv = (lambda x: x) if isinstance(v_b, torch.Tensor) else (lambda x: q8(x, act_group(v_b.format)))
    rows = cache[torch.as_tensor(table)].reshape(-1, C + ROPE).float()
    out = torch.empty(q.shape[0], H * V)
    for t in range(q.shape[0]):
        seen = rows[: start + t + 1]
        for h in range(H):
            qh = q[t].view(H, NOPE + ROPE)[h]
            q_latent = k[h] @ rk(qh[:NOPE])
            scores = SCALE * (seen[:, :C] @ q_latent + seen[:, C:] @ qh[NOPE:])
            latent = torch.softmax(scores, 0) @ seen[:, :C]
            out[t, h * V : (h + 1) * V] = v[h] @ rv(latent)
    return out


@pytest.mark.parametrize("rows", [1, 3, 6])  # 6: a second group of four rows in the GEMVs
@pytest.mark.parametrize("k_fmt,v_fmt", [("bf16", "bf16"), ("f32", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_k"),
                                         ("q8_0", "q6_k"), ("q5_0", "q4_k")])  # the last: a Q4_K_M DeepSeek's
def test_stored_maps_compute_the_absorbed_form(isa, k_fmt, v_fmt, rows):
    rng = np.random.default_rng(rows)
    k_b, v_b = random_matrix(rng, k_fmt, (H * C, NOPE)), random_matrix(rng, v_fmt, (H * V, C))
    maps = StoredMaps(k_b, v_b, H, NOPE, V, C, torch.float32)
    # The row-interleaved copy where the format has one (as every dense projection's).
    held = [f"{f}x8" if f in ("q4_0", "q8_0", "q4_k") else f for f in (k_fmt, v_fmt)]
    assert maps.native.format == (held[0] if held[0] == held[1] else "+".join(held))
    cache = torch.randn(3, B, C + ROPE, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    table, start = np.array([2, 0, 1], dtype=np.int64), 40 - rows  # the rows' positions span blocks
    q = torch.randn(rows, H * (NOPE + ROPE), generator=torch.Generator().manual_seed(7))
    out = maps.attend(q, cache, table, start, SCALE)
    ref = reference(q, k_b, v_b, cache, table, start)
    quantized = k_fmt not in FLOAT_FORMATS or v_fmt not in FLOAT_FORMATS
    # Unrounded activations: 1e-2 off. The latent (attention's output) is summed in another
    # order than here, and a Q8 code of it now and then rounds the other way: 1e-3 at one row.
    assert rel_err(out, ref) < (2e-3 if quantized else 1e-5)


def test_the_stored_bytes_are_what_a_token_reads():
    rng = np.random.default_rng(0)
    k_b, v_b = random_matrix(rng, "q4_0", (H * C, NOPE)), random_matrix(rng, "q8_0", (H * V, C))
    maps = StoredMaps(k_b, v_b, H, NOPE, V, C, torch.float32)
    assert maps.bytes == k_b.nbytes + v_b.nbytes == H * C * NOPE // 32 * 18 + H * V * C // 32 * 34


def test_maps_of_another_shape_than_the_configs_are_refused():
    """(The model then loads kv_b whole, whose shape check names the tensor.)"""
    rng = np.random.default_rng(0)
    v_b = random_matrix(rng, "q8_0", (H * V, C))
    with pytest.raises(Unsupported):
        StoredMaps(random_matrix(rng, "q8_0", (H * C, NOPE)), v_b, H + 1, NOPE, V, C, torch.float32)


@pytest.mark.parametrize("k_fmt,v_fmt", [("bf16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_k"), ("q5_0", "q6_k")])
def test_the_expanded_forms_kv_b_is_the_maps_rebuilt(isa, k_fmt, v_fmt):
    """kv_b_proj from the maps (the kernels' dequantization) is GGUF's split undone exactly."""
    rng = np.random.default_rng(1)
    k_b, v_b = random_matrix(rng, k_fmt, (H * C, NOPE)), random_matrix(rng, v_fmt, (H * V, C))
    maps, want = StoredMaps(k_b, v_b, H, NOPE, V, C, torch.float32), join_kv_b(k_b, v_b, H).float()
    assert torch.equal(maps.dense(torch.float32), want)
    assert torch.equal(maps.dense(torch.bfloat16), want.to(torch.bfloat16))  # rounded as PyTorch rounds
