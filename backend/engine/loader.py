"""Reads a family's non-expert weights into layers on the main device.

Everything here is read in full for every token (attention, norms, routers, shared
experts, dense layers, embeddings, head), so it is materialised once on the main device in
the compute dtype; except the projections of a quantized file: on a CPU main device they run
through the native kernels (``native_linear``), which read the stored matrix in place, and on
a GPU a GGUF's block matrices stay as stored there, read by the Triton kernels of
``stored_linear``. Names are the checkpoint's HF names; shapes are checked against the
config so that a mismatched checkpoint fails at load with the tensor named.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.backend.engine.layers import GatedMLP, Linear, RMSNorm
from hybridmoe.backend.engine.native_linear import native_linear
from hybridmoe.backend.engine.stored_linear import stored_linear
from hybridmoe.backend.engine.tensor_parallel import columns
from hybridmoe.backend.formats.weights import WeightSource, dense, require


class Loader:
    def __init__(self, weights: WeightSource, device: torch.device, dtype: torch.dtype):
        self.weights = weights
        self.device = device
        self.dtype = dtype

    def has(self, name: str) -> bool:
        return name in self.weights

    def tensor(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None, *,
               rows: tuple[int, int] | None = None) -> torch.Tensor:
        """`name` in the compute dtype (or `dtype`) on the device; `rows`: only those (a card's
        share under tensor parallelism)."""
        return dense(self._stored(name, shape, rows), dtype or self.dtype, self.device)

    def _stored(self, name: str, shape: tuple[int, ...] | None, rows: tuple[int, int] | None):
        """`name` as stored (checked against `shape`), or only `rows` of it."""
        stored = require(self.weights, name, shape)
        return stored if rows is None else stored[rows[0] : rows[1]]

    def optional(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None):
        return self.tensor(name, shape, dtype) if self.has(name) else None

    def linear(self, prefix: str, out_features: int, in_features: int, *, bias: bool | None = None,
               rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> nn.Module:
        """`prefix`.weight [out, in] and, when `bias` is True (or None and present), `prefix`.bias.

        Under tensor parallelism a card holds `rows` of the matrix (and of its bias: its heads,
        its MLP columns) or `cols` (it sums its part of the product; the bias is then added by
        one card only: pass bias=False on the others)."""
        if bias is None:
            bias = self.has(f"{prefix}.bias")
        b = self.tensor(f"{prefix}.bias", (out_features,), rows=rows) if bias else None
        stored = self._stored(f"{prefix}.weight", (out_features, in_features), rows)
        if cols is not None:
            stored = columns(stored, *cols)
        return self.projection(stored, b)

    def projection(self, stored, bias: torch.Tensor | None = None) -> nn.Module:
        """y = x W^T (+ b) for a stored [out, in] matrix: natively on a CPU main device (in its
        stored form, or dequantized once when the kernels do not read that form), in its GGUF
        blocks on a GPU, else as a tensor in the compute dtype on the main device."""
        native = native_linear(stored, bias, self.device, self.dtype)
        if native is not None:
            return native
        held = stored_linear(stored, bias, self.device)
        if held is not None:
            return held
        w = dense(stored, self.dtype, self.device)
        return native_linear(w.contiguous(), bias, self.device, self.dtype) or Linear(w, bias)

    def norm(self, name: str, dim: int, eps: float, *, round_before_weight: bool = True) -> RMSNorm:
        return RMSNorm(self.tensor(name, (dim,)), eps, round_before_weight=round_before_weight)

    def mlp(self, prefix: str, hidden: int, intermediate: int, act: str = "silu",
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
            part: tuple[int, int] | None = None) -> GatedMLP:
        """A gated MLP; `part`: only those columns of its intermediate (a card's slice)."""
        gate, up, down = names
        return GatedMLP(
            self.linear(f"{prefix}.{gate}", intermediate, hidden, bias=False, rows=part),
            self.linear(f"{prefix}.{up}", intermediate, hidden, bias=False, rows=part),
            self.linear(f"{prefix}.{down}", hidden, intermediate, bias=False, cols=part),
            act,
        )
