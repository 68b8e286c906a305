"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2).

Each token is cached as its compressed latent c (kv_lora_rank, after kv_a_layernorm) and
one rotary key shared by all heads (qk_rope_head_dim): 576 values per token and layer for
DeepSeek-V3 instead of 2 x 128 heads x 192. Per head, keys and values are
k_nope = W_UK c and v = W_UV c, with W_UK, W_UV the two halves of kv_b_proj.

Two ways to attend over the cache, with the same result:
- expanded: rebuild k_nope and v for every cached token (kv_b_proj over S tokens), then
  ordinary attention with 192-wide keys. Cheap when many queries share that work (prefill).
- absorbed: fold W_UK into the query (q_nope W_UK, kv_lora_rank wide) so the scores are
  taken against the latents directly, and apply W_UV after attention to the attended
  latent. Nothing per cached token is recomputed, which is what decode needs.
A cost model picks one per call; ``absorb`` forces either (tests compare them).

A GGUF's kv_b stays as the file stores it on a CPU main device (``latent_maps``: the absorbed
form then runs natively on the stored maps, and the expanded form rebuilds kv_b for its call,
which the cost model counts) and on a GPU (``stored_latent``: the absorbed form's two per-head
products read its blocks with Triton kernels, in the paged decode step and here; the expanded
form, and calls of more rows than those kernels take, dequantize it for the call).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.backend.engine import paged_decode
from hybridmoe.backend.models import layer_description
from hybridmoe.backend.engine.attention import attend, eager_attention
from hybridmoe.backend.engine.kv_cache import PagedLatent, Segment, causal_mask
from hybridmoe.backend.engine.latent_maps import StoredMaps
from hybridmoe.backend.engine.stored_latent import StoredLatent
from hybridmoe.backend.engine.layers import Linear, RMSNorm
from hybridmoe.backend.engine.rope import Rotary

# The expanded form's cost of rebuilding stored maps for its call (StoredMaps.dense, ~0.8 ms a
# layer of 2 M weights), in multiply-adds per kv_b weight, against the absorbed form's native
# path. Measured on the DeepSeek-shaped Q4_0 benchmark model (2-core Zen 4, whole prompts, both
# forms forced; attention ms for 8 layers, absorbed / expanded, two runs): 16 tokens 12 / 25,
# 24 tokens 13 / 21, 32 tokens 19-22 / 31-35, 48 tokens 24 / 22, 64 tokens 26-47 / 28-31, 128
# tokens 71 / 48. This puts the cost model's switch for a whole prompt at about 52 tokens; a
# chat turn's few tokens after a long history stay absorbed.
_REBUILD_COST = 16


class MLAttention(nn.Module):
    latent: ClassVar[bool] = True

    def __init__(
        self,
        *,
        q_proj: Linear | None,
        q_a: Linear | None,
        q_a_norm: RMSNorm | None,
        q_b: Linear | None,
        kv_a: Linear,
        kv_a_norm: RMSNorm,
        kv_b_weight: torch.Tensor | None,
        o: Linear,
        n_heads: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        kv_lora_rank: int,
        rotary: Rotary,
        cache: PagedLatent,
        scale: float,
        stored_maps: StoredMaps | None = None,
        stored_kv_b: StoredLatent | None = None,
    ):
        super().__init__()
        self.q_proj, self.q_a, self.q_a_norm, self.q_b = q_proj, q_a, q_a_norm, q_b
        self.kv_a, self.kv_a_norm, self.o = kv_a, kv_a_norm, o
        # kv_b [H*(nope+v), kv_lora] in the compute dtype, or as the file stores it: on the CPU
        # (stored_maps), on a GPU (stored_kv_b).
        self.register_buffer("kv_b_weight", kv_b_weight, persistent=False)
        self.stored_maps = stored_maps
        self.stored_kv_b = stored_kv_b
        self.n_heads, self.nope_dim, self.rope_dim, self.v_dim = n_heads, nope_dim, rope_dim, v_dim
        self.kv_lora_rank = kv_lora_rank
        self.rotary = rotary
        self.cache = cache
        self.scale = scale
        self.absorb: bool | None = None  # None: choose by cost

    def describe(self) -> layer_description.LatentAttention:
        linears = [self.kv_a, self.o] + ([self.q_proj] if self.q_proj is not None else [self.q_a, self.q_b])
        kv_b = self.kv_b_weight
        return layer_description.LatentAttention(
            heads=self.n_heads, nope_dim=self.nope_dim, rope_dim=self.rope_dim, value_dim=self.v_dim,
            kv_lora_rank=self.kv_lora_rank, q_lora_rank=None if self.q_a is None else self.q_a.out_features,
            absorbed_allowed=self.absorb is not False, rotary=self.rotary.describe(),
            projections_native=all(lin.runs_native for lin in linears),
            kv_b_native=self.stored_maps is not None or (kv_b is not None and (
                kv_b.dtype in (torch.float32, torch.bfloat16, torch.float16) and kv_b.is_contiguous())),
            cache_dtype=str(self.cache.kv.dtype).removeprefix("torch."))

    def _use_absorbed(self, n_q: int, n_keys: int) -> bool:
        if self.absorb is not None:
            return self.absorb
        h, c, r = self.n_heads, self.kv_lora_rank, self.rope_dim
        per_token_expand = h * c * (self.nope_dim + self.v_dim)
        absorbed = n_q * per_token_expand + n_q * n_keys * h * (2 * c + r)
        expanded = n_keys * per_token_expand + n_q * n_keys * h * (self.nope_dim + r + self.v_dim)
        if self.stored_maps is not None:  # kv_b rebuilt for the call
            expanded += _REBUILD_COST * per_token_expand
        return absorbed <= expanded

    def kv_b(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b [H*(nope+v), kv_lora]: the held one, or the stored form dequantized now."""
        if self.kv_b_weight is not None:
            return self.kv_b_weight
        return (self.stored_maps if self.stored_maps is not None else self.stored_kv_b).dense(dtype)

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """x [T, hidden]: the rows of one or more sequences; projections over all rows,
        attention per sequence over its own cache."""
        n, c = x.shape[0], self.kv_lora_rank
        q = self.q_proj(x) if self.q_proj is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        compressed = self.kv_a(x)
        latent = self.kv_a_norm(compressed[:, :c])
        if ((self.kv_b_weight is not None or self.stored_kv_b is not None) and self.absorb is not False
                and paged_decode.applies_latent(latent, segments, self.cache, c, self.rope_dim)):
            try:
                kv_b = self.stored_kv_b if self.kv_b_weight is None else self.kv_b_weight.view(
                    self.n_heads, self.nope_dim + self.v_dim, c)
                return self.o(paged_decode.attend_latent(q, latent, compressed[:, c:], segments, self.cache,
                                                         self.rotary, kv_b, self.nope_dim, self.scale))
            except Exception as error:  # noqa: BLE001 - a card or Triton build the kernels cannot run on
                paged_decode.failed(x.device, error)
        out = x.new_empty(n, self.n_heads * self.v_dim)
        for seg in segments:
            r = seg.rows
            out[r] = self._attend(q[r], latent[r], compressed[r, c:], seg)
        return self.o(out)

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, seg: Segment) -> torch.Tensor:
        """One sequence's rows -> attention output [n, heads * v_dim]."""
        n, start_pos = q.shape[0], seg.start
        h, nope, rope, c = self.n_heads, self.nope_dim, self.rope_dim, self.kv_lora_rank
        q = q.reshape(n, h, nope + rope).transpose(0, 1).unsqueeze(0)  # [1, H, n, nope+rope]
        q_nope, q_rope = q[..., :nope], q[..., nope:]
        k_rope = k_rope.reshape(1, 1, n, rope)

        cos, sin = self.rotary.tables(start_pos, n, q.dtype)
        q_rope = self.rotary.apply(q_rope, cos, sin)
        k_rope = self.rotary.apply(k_rope, cos, sin)
        if self.stored_maps is not None and self._use_absorbed(n, start_pos + n):
            self.cache.write(seg.seq, latent, k_rope.reshape(n, rope), start_pos)
            q_full = torch.cat((q_nope, q_rope), dim=-1).squeeze(0).transpose(0, 1).reshape(n, -1)
            table = seg.seq.table_array(self.cache.group)
            return self.stored_maps.attend(q_full, self.cache.kv, table, start_pos, self.scale).to(q.dtype)
        cached = self.cache.update(seg.seq, latent, k_rope.reshape(n, rope), start_pos)  # [S, c + rope]
        # A float16 cache under float32 activations (model._cache_dtype): widened exactly, the
        # absorbed form's queries and weights rounded to it as the native kernels round them.
        rounded = torch.float16 if cached.dtype == torch.float16 and q.dtype == torch.float32 else None
        cached = cached.to(q.dtype)
        n_keys = cached.shape[0]

        if self._use_absorbed(n, n_keys):
            # kv_b's blocks read in place on a GPU (few rows), else kv_b in the compute dtype.
            stored = self.stored_kv_b if self.stored_kv_b is not None and self.stored_kv_b.reads_stored(n) else None
            w = None if stored is not None else self.kv_b(q.dtype).view(h, nope + self.v_dim, c)
            # [1, H, n, c]: W_UK folded into q
            q_latent = stored.query(q_nope[0]).unsqueeze(0) if w is None else torch.matmul(q_nope, w[:, :nope])
            q_full = torch.cat((q_latent, q_rope), dim=-1)
            keys = cached.view(1, 1, n_keys, c + rope)
            values = cached[:, :c].view(1, 1, n_keys, c)
            mask = None
            if n > 1 or start_pos + n != n_keys:
                q_pos = torch.arange(start_pos, start_pos + n, device=q.device)
                mask = causal_mask(q_pos, None, n_keys, None)
            attended = eager_attention(q_full, keys, values, mask, self.scale, rounded_to=rounded)  # [1, H, n, c]
            if w is None:  # W_UV after attention
                out = stored.values(attended[0]).unsqueeze(0)
            else:
                out = torch.matmul(attended, w[:, nope:].transpose(1, 2))
        else:
            kv_b = self.kv_b(q.dtype)
            kv = F.linear(cached[:, :c], kv_b).view(n_keys, h, nope + self.v_dim).transpose(0, 1)
            k_nope, values = kv[..., :nope], kv[..., nope:]
            k_shared = cached[:, c:].view(1, n_keys, rope).expand(h, n_keys, rope)
            keys = torch.cat((k_nope, k_shared), dim=-1).unsqueeze(0)
            q_full = torch.cat((q_nope, q_rope), dim=-1)
            out = attend(q_full, keys, values.unsqueeze(0), start_pos, None, None, self.scale)
        return out.squeeze(0).transpose(0, 1).reshape(n, h * self.v_dim)
