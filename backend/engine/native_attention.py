"""Decode attention on the CPU through the native kernels (``native/src/attention_decode.cpp``).

One new token per call attends over the whole cache: PyTorch's attention kernels are built
for many queries and, over a bf16 cache on a CPU without bf16 arithmetic, spent more time
per layer than the layer's projections (2.7 ms for 32 heads over 260 positions, measured).
The kernel reads the cache in place (float32, bfloat16 or float16), each key and value row once per group
of query heads sharing it, in float32.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.plan.decode_path import NATIVE_CACHE_DTYPES

_CACHE_DTYPES = tuple(getattr(torch, name) for name in NATIVE_CACHE_DTYPES)  # what the kernels read


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """softmax(scale q k^T) v for one query per head, or None when the kernels cannot run it.

    q [1, Hq, 1, D]; k, v [1, Hkv, S, D] (views of the cache: rows contiguous). Returns
    [1, Hq, 1, Dv] in q's dtype."""
    if not native_kernels.enabled() or q.device.type != "cpu" or k.dtype != v.dtype:
        return None
    if k.dtype not in _CACHE_DTYPES or k.stride(-1) != 1 or v.stride(-1) != 1:
        return None
    heads, dim = q.shape[1], q.shape[3]
    out = torch.empty((heads, v.shape[3]), dtype=torch.float32)
    native_kernels._native.attend_decode(q.reshape(heads, dim).float().contiguous(), k[0], v[0], k.shape[2], scale, out)
    return out.to(q.dtype).view(1, heads, 1, -1)


def paged_decode_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                           table: torch.Tensor | list[int], length: int, scale: float) -> torch.Tensor | None:
    """decode_attention over a block-allocated cache, or None when the kernels cannot run it.

    q [1, Hq, 1, D]; k_blocks [n_blocks, Hkv, B, D], v_blocks [n_blocks, Hkv, B, Dv] (rows
    contiguous); table: the sequence's block ids in order (int64 tensor or list), position s in
    block table[s // B], row s % B; the first `length` positions are attended. Returns
    [1, Hq, 1, Dv] in q's dtype."""
    if not native_kernels.enabled() or q.device.type != "cpu" or k_blocks.device.type != "cpu":
        return None
    if k_blocks.dtype != v_blocks.dtype or k_blocks.dtype not in _CACHE_DTYPES:
        return None
    if k_blocks.stride(-1) != 1 or v_blocks.stride(-1) != 1:
        return None
    if not isinstance(table, torch.Tensor):
        table = torch.tensor(table, dtype=torch.int64)
    heads, dim = q.shape[1], q.shape[3]
    out = torch.empty((heads, v_blocks.shape[3]), dtype=torch.float32)
    native_kernels._native.attend_decode_paged(q.reshape(heads, dim).float().contiguous(), k_blocks, v_blocks,
                                               table.to("cpu", torch.int64).contiguous(), length, scale, out)
    return out.to(q.dtype).view(1, heads, 1, -1)


# Score elements (rows x query heads x positions) one call of prompt_attention's kernels keeps.
_PROMPT_SCORE_BUDGET = 1 << 24


def prompt_attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, table, start: int,
                     scale: float) -> torch.Tensor:
    """A prompt's causal attention as decode steps of its rows over a block-allocated cache
    (the rows' keys and values written): row t attends positions 0 .. start + t, through the
    decode kernels, so that a prompt's rows are a decode step's bits. q [1, Hq, T, D] ->
    [1, Hq, T, Dv] float32. Rows go in groups whose score matrices fit _PROMPT_SCORE_BUDGET."""
    heads, n = q.shape[1], q.shape[2]
    rows = q[0].transpose(0, 1).float().contiguous()  # [T, Hq, D]
    table = np.ascontiguousarray(table, dtype=np.int64)
    out = torch.empty((n, heads, v_blocks.shape[3]), dtype=torch.float32)
    per_call = max(1, _PROMPT_SCORE_BUDGET // (heads * (start + n)))
    for t0 in range(0, n, per_call):
        t1 = min(n, t0 + per_call)
        tables = np.ascontiguousarray(np.broadcast_to(table, (t1 - t0, table.shape[0])))
        lengths = np.arange(start + t0 + 1, start + t1 + 1, dtype=np.int64)
        native_kernels._native.attend_decode_rows(rows[t0:t1], k_blocks, v_blocks, tables, lengths, scale, out[t0:t1])
    return out.transpose(0, 1).unsqueeze(0)
