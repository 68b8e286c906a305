"""A decode step's attention on the GPU in two kernel launches (and, for latent attention,
two matrix products around them).

The reference path (``attention.Attention._attend``) handles each sequence of a step in turn:
the rotary tables sliced and cast, the rotation of q and k (some fifteen element-wise
kernels), the per-head q/k norms (four each), the cache write through host-made block indices
(two host-to-device copies and two scatters), a gather of every cache block the sequence
holds and their reshaping, then the attention: some 30 kernel launches a layer (``mla``'s
absorbed form about as many). On a GPU the launches, not the bytes, set a decode step's time
(a launch costs the host 10-30 us on the H200 machines; the mid-size model's whole step is
~1 ms of GPU work). Here (``paged_decode_kernels``) one kernel norms and rotates q and k and
writes the cache, one attends over the blocks in place, for every row of the step at once;
the positions and block tables go to the device once per step, for all layers.

- grouped-query attention (``attend``): one program per (row, head) for each kernel;
- latent attention, absorbed (``attend_latent``): the latent queries are the reference's
  product with W_UK; one program per (row, block of 16 heads) scores them and the rotary
  queries against the cached [latent | rotary key] rows with tensor-core products and sums the
  latents; W_UV follows as in the reference. With kv_b held as the file stores it
  (``stored_latent``) both products are per-head GEMVs over its blocks.

Taken by decode rows (one token per sequence) on CUDA for layers without a sliding window
or attention sinks, up to ``MAX_KEYS`` positions per sequence (one program walks its
sequence's blocks: beyond that a split over the keys would be needed to keep the card busy,
and the reference path's flash kernels do that).
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from hybridmoe.backend.engine.decode_experts import triton_available
from hybridmoe.backend.engine.kv_cache import B, PagedKV, PagedLatent, Segment
from hybridmoe.backend.engine.layers import RMSNorm
from hybridmoe.backend.engine.rope import Rotary
from hybridmoe.backend.engine.stored_latent import StoredLatent

log = logging.getLogger(__name__)

MAX_KEYS = 4096
MAX_HEAD_DIM = 256
MAX_LATENT = 1024  # a block of heads keeps [16, latent] float32 sums in registers

# Devices on which the kernels failed (Triton could not build them for the card, say): their
# steps take the reference path from then on, and the reason is logged once.
_failed: dict[torch.device, str] = {}


def _decode_rows(x: torch.Tensor, segments: list[Segment]) -> bool:
    """A step of decode rows on a CUDA device the kernels have not failed on."""
    return (x.device.type == "cuda" and x.device not in _failed
            and all(s.n == 1 and s.start < MAX_KEYS for s in segments) and triton_available())


def applies(x: torch.Tensor, segments: list[Segment], cache: PagedKV, head_dim: int, value_dim: int,
            sinks: torch.Tensor | None) -> bool:
    """Whether a grouped-query call's attention runs here (else the reference path)."""
    return (cache.window is None and sinks is None and max(head_dim, value_dim) <= MAX_HEAD_DIM
            and _decode_rows(x, segments))


def applies_latent(x: torch.Tensor, segments: list[Segment], cache: PagedLatent, kv_lora_rank: int,
                   rope_dim: int) -> bool:
    """Whether a latent-attention call runs here: its widths powers of two from 16 (the
    tensor-core products' tiles) and its cache in the compute dtype."""
    def tile(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    return (tile(kv_lora_rank) and tile(rope_dim) and kv_lora_rank <= MAX_LATENT
            and cache.kv.dtype == x.dtype and _decode_rows(x, segments))


def failed(device: torch.device, error: Exception) -> None:
    """The kernels raised on `device`: the reference path serves its steps from now on."""
    _failed[device] = f"{type(error).__name__}: {error}"
    log.warning("GPU decode attention kernels unavailable on %s (%s); attention there takes the slower path",
                device, _failed[device])


def step_meta(segments: list[Segment], cache: PagedKV | PagedLatent, device: torch.device) -> torch.Tensor:
    """[rows, 1 + blocks] int64 on `device`: each row's position, then its sequence's block
    table (padded with -1). Made once per step and cache group: every layer reads the same."""
    key = tuple((s.seq, s.seq.version, s.start) for s in segments)
    held = cache.group.decode_meta
    if held is not None and held[0] == key and held[1].device == device:
        return held[1]
    tables = [s.seq.tables[cache.group][: s.start // B + 1] for s in segments]
    width = 1 + max(len(t) for t in tables)
    rows = [[s.start, *t] + [-1] * (width - 1 - len(t)) for s, t in zip(segments, tables)]
    meta = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    cache.group.decode_meta = (key, meta)
    return meta


@cache
def _rotation(layout: str, rotary_dim: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Index vectors over a head's features for ``rope_store_kernel``: out[i] = x[a(i)] cos +
    sign(i) x[b(i)] sin, with cos and sin at i mod rotary_dim/2."""
    half = rotary_dim // 2
    a, b, sign = list(range(head_dim)), list(range(head_dim)), [0.0] * head_dim
    for i in range(rotary_dim):
        j = i % half
        if layout == "halves":  # (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves
            a[i], b[i] = i, (i + half) % rotary_dim
        else:  # pairs (x[2j], x[2j+1]) rotated, their results laid out as halves
            a[i], b[i] = (2 * j, 2 * j + 1) if i < half else (2 * j + 1, 2 * j)
        sign[i] = -1.0 if i < half else 1.0
    as_tensor = lambda v, dtype: torch.tensor(v, dtype=dtype, device=device)  # noqa: E731
    return as_tensor(a, torch.int32), as_tensor(b, torch.int32), as_tensor(sign, torch.float32)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment], cache: PagedKV,
           rotary: Rotary, q_norm: RMSNorm | None, k_norm: RMSNorm | None, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, Dv] of n decode rows (views of the projections'
    output) -> attention output [n, Hq * Dv]; k and v written into the cache, q and k normed
    per head (`q_norm`, `k_norm`) and rotated first, as ``Attention._attend`` does."""
    import triton

    from hybridmoe.backend.engine import paged_decode_kernels as kernels

    n, n_heads, dim = q.shape
    n_kv, value_dim = v.shape[1], v.shape[2]
    device = q.device
    meta = step_meta(segments, cache, device)
    q_out = torch.empty((n, n_heads, dim), dtype=q.dtype, device=device)
    out = torch.empty((n, n_heads * value_dim), dtype=q.dtype, device=device)
    dp = triton.next_power_of_2(max(dim, value_dim))
    a, b, sign = _rotation(rotary.layout, rotary.rotary_dim, dim, device)
    norm = q_norm is not None
    q_weight = q_norm.weight.to(q.dtype) if norm else q
    k_weight = k_norm.weight.to(q.dtype) if norm else q
    kc, vc = cache.k, cache.v
    kernels.rope_store_kernel[(n, n_heads + n_kv)](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out,
        q_weight, k_weight, q_norm.eps if norm else 0.0, rotary.cos, rotary.sin, rotary.rotary_dim // 2, a, b, sign,
        meta, meta.stride(0), kc, vc, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), n_heads, dim,
        value_dim, rotary.rotary_dim, BLOCK=B, DP=dp, HAS_NORM=norm,
        ROUND_BEFORE_WEIGHT=bool(norm and q_norm.round_before_weight), FLOAT32_MATH=rotary.float32_math,
        num_warps=1)
    kernels.attend_kernel[(n, n_heads)](
        q_out, out, meta, meta.stride(0), kc, vc, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), n_heads,
        n_heads // n_kv, dim, value_dim, scale, BLOCK=B, DP=dp, num_warps=4)
    return out


def attend_latent(q: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor, segments: list[Segment],
                  cache: PagedLatent, rotary: Rotary, kv_b: torch.Tensor | StoredLatent, nope_dim: int,
                  scale: float) -> torch.Tensor:
    """Latent attention of n decode rows in its absorbed form, as ``MLAttention._attend``
    computes it: q [n, H * (nope + rope)], the normed latent [n, C] and the unrotated rotary
    key [n, rope] (views of the projections' output); kv_b [H, nope + v, C], or held as stored
    (its ``query`` and ``values`` the two products). Writes the cache and returns [n, H * v]."""
    from hybridmoe.backend.engine import paged_decode_kernels as kernels

    n, c = latent.shape
    dense = isinstance(kv_b, torch.Tensor)
    n_heads, rope = kv_b.shape[0] if dense else kv_b.n_heads, rope_key.shape[1]
    device = q.device
    meta = step_meta(segments, cache, device)
    q_rope = torch.empty((n, n_heads, rope), dtype=q.dtype, device=device)
    a, b, sign = _rotation(rotary.layout, rotary.rotary_dim, rope, device)
    kv = cache.kv
    kernels.latent_rope_store_kernel[(n, n_heads + 1)](
        q, q.stride(0), latent, latent.stride(0), rope_key, rope_key.stride(0), q_rope, rotary.cos, rotary.sin,
        rotary.rotary_dim // 2, a, b, sign, meta, meta.stride(0), kv, kv.stride(0), kv.stride(1), n_heads, nope_dim,
        rope, c, BLOCK=B, RP=rope, CP=c, FLOAT32_MATH=rotary.float32_math, num_warps=1)
    # W_UK folded into the queries: [H, n, nope] x [H, nope, C].
    q_nope = q.view(n, n_heads, -1)[:, :, :nope_dim].transpose(0, 1)
    q_latent = torch.matmul(q_nope, kv_b[:, :nope_dim]) if dense else kv_b.query(q_nope)
    attended = torch.empty((n_heads, n, c), dtype=q.dtype, device=device)
    heads_per_program = 16
    kernels.latent_attend_kernel[(n, -(-n_heads // heads_per_program))](
        q_latent, q_latent.stride(0), q_latent.stride(1), q_rope, attended, attended.stride(0), attended.stride(1),
        meta, meta.stride(0), kv, kv.stride(0), kv.stride(1), n_heads, c, rope, scale, BLOCK=B, KT=32,
        HB=heads_per_program, CP=c, RP=rope, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=8 if c >= 512 else 4)  # a [32, C] float32 tile of the cache and [16, C] sums per program
    # W_UV after attention: [H, n, C] x [H, C, v] -> [n, H * v].
    out = torch.matmul(attended, kv_b[:, nope_dim:].transpose(1, 2)) if dense else kv_b.values(attended)
    return out.transpose(0, 1).reshape(n, -1)
