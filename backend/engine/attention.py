"""Grouped-query attention with the variants our families use.

- q/k RMSNorm per head (Qwen3-MoE, GLM-4.5 with use_qk_norm) or over the whole projection
  (OLMoE), optional clipping of q/k/v (OLMoE `clip_qkv`), biases where the checkpoint has them;
- sliding windows (GPT-OSS alternating layers, Mixtral/Qwen when configured), whose cache keeps only
  the blocks the window reaches;
- attention sinks (GPT-OSS): one learned logit per head that joins the softmax and is dropped.

Plain attention goes through ``F.scaled_dot_product_attention`` (flash kernels on CPU and
CUDA, no [T, S] score matrix in memory); attention with sinks, and MLA's absorbed form, use
``eager_attention``, which computes the scores explicitly in query chunks.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hybridmoe.backend.engine import native_kernels, paged_decode
from hybridmoe.backend.engine.kv_cache import PagedKV, Segment, causal_mask
from hybridmoe.backend.engine.layers import Linear, RMSNorm
from hybridmoe.backend.engine.native_attention import decode_attention, prompt_attention
from hybridmoe.backend.engine.native_linear import NativeLinear
from hybridmoe.backend.engine.rope import Rotary
from hybridmoe.backend.models.layer_description import GroupedQueryAttention

# Upper bound on score elements materialised at once by eager_attention (per query chunk).
_EAGER_SCORE_BUDGET = 1 << 24

# Decode calls on CUDA keep off cuDNN's attention, PyTorch's first choice on Hopper: it builds
# an execution plan for each new shape, and a decode step's key count is new at every step
# (measured on an H200: 5.1 ms of host time a call, where the whole step's GPU work took 1.3 ms).
_DECODE_QUERIES = 8
_DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
    rounded_to: torch.dtype | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for q [1, H, T, D], k [1, KV, S, D], v [1, KV, S, Dv].

    KV heads are shared by H/KV query heads without copying them: the query heads of a group
    are stacked into one matrix per KV head. `mask` [T, S] is True where attending is allowed.
    With `sinks` [H] (GPT-OSS) the softmax runs in the scores' dtype as the reference does;
    otherwise in float32. `rounded_to`: float32 products of the queries and of the softmax's
    weights rounded to that dtype (the cache's: the native decode step's rounding, see ``attend``).
    """
    if rounded_to is not None:
        q, k, v = q.to(rounded_to).float(), k.float(), v.float()
    _, n_heads, n_q, dim = q.shape
    n_kv, n_keys = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    out = q.new_empty(1, n_heads, n_q, v.shape[-1])
    keys_t = k.transpose(-1, -2)
    chunk = max(1, _EAGER_SCORE_BUDGET // (n_heads * max(n_keys, 1)))
    for t0 in range(0, n_q, chunk):
        t1 = min(n_q, t0 + chunk)
        n = t1 - t0
        grouped = q[:, :, t0:t1].reshape(1, n_kv, group * n, dim)
        scores = (torch.matmul(grouped, keys_t) * scale).view(1, n_heads, n, n_keys)
        if mask is not None:
            scores = scores.masked_fill(~mask[t0:t1], float("-inf"))
        if sinks is not None:
            sink = sinks.view(1, n_heads, 1, 1).expand(1, n_heads, n, 1).to(scores.dtype)
            combined = torch.cat((scores, sink), dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        else:
            probs = F.softmax(scores, dim=-1, dtype=torch.float32)
        if rounded_to is not None:
            probs = probs.to(rounded_to)
        probs = probs.to(v.dtype).reshape(1, n_kv, group * n, n_keys)
        out[:, :, t0:t1] = torch.matmul(probs, v).view(1, n_heads, n, -1)
    return out


def _rounded(q: torch.Tensor, k: torch.Tensor) -> bool:
    """A float16 cache under float32 queries on the CPU (a GGUF there: model._cache_dtype),
    which attention rounds to as llama.cpp does (native/src/attention_decode.cpp)."""
    return k.dtype == torch.float16 and q.dtype == torch.float32 and q.device.type == "cpu" and native_kernels.enabled()


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start_pos: int,
    key_positions: torch.Tensor | None,
    window: int | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed) attention of the new queries over the returned keys."""
    n_q, n_keys = q.shape[2], k.shape[2]
    if key_positions is None and window is None and n_q == 1:
        if sinks is None:
            out = decode_attention(q, k, v, scale)
            if out is not None:
                return out
        mask, causal = None, False  # one query at the end sees every key
    elif key_positions is None and window is None and start_pos == 0:
        mask, causal = None, True  # square causal: let the kernel build it
    else:
        q_pos = torch.arange(start_pos, start_pos + n_q, device=q.device)
        mask, causal = causal_mask(q_pos, key_positions, n_keys, window), False
    # A float16 cache under float32 activations (a GGUF on the CPU: model._cache_dtype): the
    # queries and the softmax's weights rounded to float16 as the decode step rounds them
    # (native/src/attention_decode.cpp), which is llama.cpp's arithmetic; SDPA's fused kernels
    # cannot round the weights.
    rounded = _rounded(q, k)
    if causal and (sinks is not None or rounded):  # the eager path takes the mask
        mask = causal_mask(torch.arange(n_q, device=q.device), None, n_keys, None)
    if rounded and sinks is None:
        return eager_attention(q, k, v, mask, scale, rounded_to=torch.float16)
    if k.dtype != q.dtype:  # widened exactly
        k, v = k.to(q.dtype), v.to(q.dtype)
    if sinks is not None:
        return eager_attention(q, k, v, mask, scale, sinks)
    dtype = q.dtype
    if q.device.type == "cpu" and dtype != torch.float32:
        # PyTorch's reduced-precision attention kernels on CPUs without bf16 arithmetic run
        # about 8x slower than fp32 ones (2.7 ms against 0.34 ms for one decode query over
        # 260 keys, 32 heads, measured): attend in fp32 and round the result once.
        q, k, v = q.float(), k.float(), v.float()
    v_dim = v.shape[-1]
    if q.device.type == "cpu" and v_dim < q.shape[-1]:
        # PyTorch's CPU flash kernel wants one head size for q, k and v; MLA's values (128)
        # are narrower than its keys (192), which sends it to the math path: a [T, S] score
        # matrix, its mask built and checked (2.8x slower at 512 tokens, 16 heads, measured).
        # Zero columns of v add nothing to the output, which keeps its first v_dim columns.
        v = F.pad(v, (0, q.shape[-1] - v_dim))
    with sdpa_kernel(_DECODE_BACKENDS) if q.device.type == "cuda" and n_q <= _DECODE_QUERIES else nullcontext():
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    return out[..., :v_dim].to(dtype)


class Attention(nn.Module):
    latent: ClassVar[bool] = False  # every attention block says whether it is latent attention (mla.py)

    def __init__(
        self,
        *,
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rotary: Rotary,
        cache: PagedKV,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        norm_per_head: bool = True,
        clip_qkv: float | None = None,
        sinks: torch.Tensor | None = None,
    ):
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o
        # On a CPU main device the three projections run as one native call (also when they
        # are stored in different formats: one wake-up of the threads, one pass over x).
        self.qkv = NativeLinear.fused(q, k, v)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rotary = rotary
        self.cache = cache
        self.q_norm, self.k_norm = q_norm, k_norm
        self.norm_per_head = norm_per_head
        self.clip_qkv = clip_qkv
        self.register_buffer("sinks", sinks, persistent=False)
        self.scale = head_dim**-0.5

    def describe(self) -> GroupedQueryAttention:
        return GroupedQueryAttention(
            heads=self.n_heads, kv_heads=self.n_kv_heads, head_dim=self.head_dim, value_dim=self.cache.v.shape[-1],
            qk_norm=None if self.q_norm is None else "per_head" if self.norm_per_head else "whole",
            window=self.cache.window, sinks=self.sinks is not None, clip_qkv=self.clip_qkv,
            rotary=self.rotary.describe(),
            projections_native=self.qkv is not None and self.o.runs_native,
            cache_dtype=str(self.cache.k.dtype).removeprefix("torch."))

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """x [T, hidden]: the rows of one or more sequences (``segments``); the projections
        run over all rows at once, attention per sequence over its own cache."""
        n = x.shape[0]
        if self.qkv is not None:
            q, k, v = self.qkv(x).split((self.q.out_features, self.k.out_features, self.v.out_features), dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        if self.q_norm is not None and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(n, self.n_heads, self.head_dim)
        k = k.view(n, self.n_kv_heads, self.head_dim)
        v = v.view(n, self.n_kv_heads, self.head_dim)
        per_head = self.q_norm is not None and self.norm_per_head
        if paged_decode.applies(x, segments, self.cache, self.head_dim, self.head_dim, self.sinks):
            try:
                out = paged_decode.attend(q, k, v, segments, self.cache, self.rotary, self.q_norm if per_head else None,
                                          self.k_norm if per_head else None, self.scale)
                return self.o(out)
            except Exception as error:  # noqa: BLE001 - a card or Triton build the kernels cannot run on
                paged_decode.failed(x.device, error)
        if per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        out = q.new_empty(n, self.n_heads * self.head_dim)
        for seg in segments:
            out[seg.rows] = self._attend(q[seg.rows], k[seg.rows], v[seg.rows], seg)
        return self.o(out)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segment) -> torch.Tensor:
        """One sequence's rows [n, heads, d] -> attention output [n, heads * d]."""
        n = q.shape[0]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, d]
        cos, sin = self.rotary.tables(seg.start, n, q.dtype)
        q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
        if n > 1 and _rounded(q, self.cache.k) and self.cache.window is None and self.sinks is None:
            # A prompt over a float16 cache: its rows as decode steps (the decode kernels round
            # as llama.cpp does, which SDPA cannot: see ``attend``). Faster than the eager
            # products: a 512-token prompt of the mid-size IQ2_XXS model 1.89 -> 1.70 s.
            self.cache.write(seg.seq, k, v, seg.start)
            out = prompt_attention(q, self.cache.k, self.cache.v, seg.seq.table_array(self.cache.group), seg.start,
                                   self.scale)
            return out.to(q.dtype).squeeze(0).transpose(0, 1).reshape(n, -1)
        keys, values, key_positions = self.cache.update(seg.seq, k, v, seg.start)
        out = attend(q, keys, values, seg.start, key_positions, self.cache.window, self.scale, self.sinks)
        return out.squeeze(0).transpose(0, 1).reshape(n, -1)
