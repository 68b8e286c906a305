"""MLA's kv_b on a CPU main device, as the model file stores it.

Latent attention reads all of kv_b, the latent's per-head key and value maps, for every token:
the absorbed form folds W_UK into the query and applies W_UV to the attended latent. A GGUF
stores kv_b split, ``attn_k_b`` (each head's W_UK transposed: the absorbed form's rows) and
``attn_v_b``, quantized like the other projections. Widened to the compute dtype at load, as
the engine held them before, a CPU decode read them at 16 bits a weight: the DeepSeek-shaped
Q4_0 benchmark model read 33.5 MB of kv_b a token where its file holds 9.4 MB, and
DeepSeek-V3 in Q4_0 would read 2.05 GB a token where the file holds 0.58.

``StoredMaps`` keeps the two as stored (views of the file's mapping); the native absorbed
attention (``mla_attend_rows``: ``native/src/mla_decode.h``) reads them in place with the
kernels' GEMVs, for decode steps and for the prompt rows for which the cost model picks the
absorbed form (``MLAttention``). The expanded form, cheaper for long prompts, needs kv_b whole:
``dense`` rebuilds it for that call, and the cost model counts that.

Numerics: a quantized map meets Q8-rounded activations, as every quantized projection on the
CPU does (and as llama.cpp computes it); float maps are read as floats.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.native_kernels import Unsupported, native_format
from hybridmoe.backend.engine.native_linear import NativeLinear
from hybridmoe.backend.formats.quant import dequantize
from hybridmoe.backend.formats.weights import WeightSource


class StoredMaps:
    """kv_b's maps as a GGUF stores them: k_b rows [H * kv_lora, nope], v_b rows [H * v, kv_lora]."""

    def __init__(self, k_b: Any, v_b: Any, n_heads: int, nope: int, v_dim: int, kv_lora: int, dtype: torch.dtype):
        if tuple(k_b.shape) != (n_heads * kv_lora, nope) or tuple(v_b.shape) != (n_heads * v_dim, kv_lora):
            raise Unsupported("maps of another shape than the config's")  # loaded whole, whose check names it
        # Each map as a dense projection's matrix: the row-interleaved copy where the format has
        # one (q4_0x8 reads the 128-long key rows eight at a time, as it does every projection's),
        # else the stored form; a map in a format the kernels do not read is held in the compute
        # dtype, as the plan counts every such matrix (models/tensors.py).
        k_map, v_map = (NativeLinear(t if native_format(t) is not None else dequantize(t, dtype)) for t in (k_b, v_b))
        try:
            self.native = native_kernels._native.LatentMaps.split(k_map.native, v_map.native, n_heads, nope, v_dim,
                                                                  kv_lora)
        except ValueError as err:
            raise Unsupported(str(err)) from None
        self._keep = [k_map, v_map]  # what the kernels read

    @property
    def bytes(self) -> int:
        return int(self.native.bytes)

    def attend(self, q: torch.Tensor, cache: torch.Tensor, table: np.ndarray, start: int, scale: float) -> torch.Tensor:
        """The absorbed attention of one sequence's rows q [n, H * (nope + rope)] (rotary parts
        rotated) at positions start.. over its latent cache [blocks, B, kv_lora + rope] (their
        rows already written; `table`: the sequence's block table) -> float32 [n, H * v]."""
        n, rope = q.shape[0], cache.shape[-1] - self.native.c
        cache_np = cache.view(torch.uint16).numpy() if cache.dtype == torch.bfloat16 else cache.numpy()
        tables = np.ascontiguousarray(np.broadcast_to(table, (n, len(table))))
        lengths = np.arange(start + 1, start + n + 1, dtype=np.int64)  # causal: row i sees positions .. start + i
        out = np.empty((n, self.native.n_heads * self.native.v), dtype=np.float32)
        native_kernels._native.mla_attend_rows(q.float().contiguous().numpy(), self.native, cache_np, tables, lengths,
                                               rope, scale, out)
        return torch.from_numpy(out)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj [H * (nope + v), kv_lora] in `dtype`, dequantized now by the kernels (the
        expanded form's; PyTorch's decoders took 4x as long)."""
        n = self.native
        held = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.empty(n.n_heads * (n.nope + n.v), n.c, dtype=held)
        n.to_dense(out.view(torch.uint16).numpy() if held == torch.bfloat16 else out.numpy())
        return out.to(dtype)


def stored_maps(weights: WeightSource, name: str, heads: tuple[int, int], nope: int, v_dim: int, kv_lora: int,
                device: torch.device, dtype: torch.dtype) -> StoredMaps | None:
    """kv_b (`name`, kv_b_proj's HF name) as stored, for `heads` (first, end: a card's share
    under tensor parallelism, or all), where the device is the CPU, the file stores kv_b split
    and the kernels read its formats at these widths; else None (the caller loads kv_b whole in
    the compute dtype)."""
    split = getattr(weights, "kv_b_split", None)
    if device.type != "cpu" or not native_kernels.enabled() or split is None:
        return None
    parts = split(name)
    if parts is None:
        return None
    (h0, h1), (k_b, v_b) = heads, parts
    try:
        return StoredMaps(k_b[h0 * kv_lora : h1 * kv_lora], v_b[h0 * v_dim : h1 * v_dim], h1 - h0, nope, v_dim, kv_lora,
                          dtype)
    except Unsupported:
        return None
