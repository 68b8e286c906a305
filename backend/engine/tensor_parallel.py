"""Tensor parallelism: every layer split across the GPUs of one machine, driven by one process.

Each card holds a share of every layer: its query heads (with the KV heads they read; MLA's
latent cache, which every head reads, whole), its slice of each dense and shared MLP, its
dealt share of the layer's GPU experts and its rows of the LM head. A layer's attention and
feed-forward block are built once per card from those slices (``Build.card``), and run as
``Shards``: the same input on every card, the partial outputs summed in float32 on the main
card (the all-reduce of a multi-process design) and rounded once. The head's slices are
concatenated instead (``HeadShards``). Norms, the embedding and the residual stream stay on
the main card; routing runs on every card from the same input, so every card makes the same
choices; the CPU experts run once, with the main card's share.

One process drives all cards, so the session, the batcher, the KV cache's block tables and
sampling are those of one device: the tables are shared, each card keeps its heads' entries.
Cards other than the main one are launched first: CUDA runs their work while the main card's
part waits for the CPU experts.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hybridmoe.backend.formats.quant import QuantTensor
from hybridmoe.backend.formats.weights import dense


class Shards(nn.Module):
    """The cards' parts of one block: each gets the same arguments (moved to its device), the
    partial outputs are summed in float32 on the first card's device and rounded to the
    input's dtype once."""

    def __init__(self, parts: list[nn.Module | None], devices: list[torch.device]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.devices = devices

    def forward(self, x: torch.Tensor, *args) -> torch.Tensor:
        outs = []
        for c in range(len(self.parts) - 1, -1, -1):  # the main card (0) last: see the module note
            if self.parts[c] is not None:  # a card may hold no columns of a narrow MLP
                outs.append(self.parts[c](x.to(self.devices[c], non_blocking=True), *args))
        total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for out in reversed(outs):
            total += out.to(total.device, non_blocking=True).float()
        return total.to(x.dtype)


class HeadShards(nn.Module):
    """The LM head split by vocabulary rows: the cards' logits side by side."""

    runs_native: ClassVar[bool] = False

    def __init__(self, parts: list[nn.Module], devices: list[torch.device]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.devices = devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [part(x.to(dev, non_blocking=True)) for part, dev in zip(self.parts, self.devices)]
        return torch.cat([o.to(x.device, non_blocking=True) for o in outs], dim=-1)


def part(count: int, card: int, cards: int, align: int = 1) -> tuple[int, int]:
    """Card `card`'s range of `count` units (heads, MLP columns, vocabulary rows), as even as
    whole groups of `align` divide (when `count` is a multiple of it): MLP columns are split
    on 32-column boundaries, so that a card's slice of a row-split matrix keeps whole 32-weight
    blocks and its stored form (``columns``). A card may get none."""
    if count % align:
        align = 1
    units = count // align
    return units * card // cards * align, units * (card + 1) // cards * align


def kv_heads(q_heads: tuple[int, int], n_heads: int, n_kv_heads: int) -> tuple[int, int]:
    """The KV heads a card's query heads read (grouped-query attention): with more cards than
    KV heads, several cards keep a copy of the same one."""
    group = n_heads // n_kv_heads
    return q_heads[0] // group, (q_heads[1] - 1) // group + 1


def columns(stored, start: int, stop: int):
    """Columns start:stop of a stored [out, in] matrix: a copy of the stored bytes when the
    range falls on whole blocks (GGUF blocks, int4 groups, MXFP4 blocks, fp8 tiles), else the
    matrix dequantized to float32 and sliced (the caller rounds it to the compute dtype)."""
    if isinstance(stored, torch.Tensor):
        return stored[:, start:stop].contiguous()
    if isinstance(stored, QuantTensor) and stored.ndim == 2:
        rows = stored.shape[0]
        p = stored.parts
        if stored.layout == "gguf":
            from gguf import GGML_QUANT_SIZES

            block, size = GGML_QUANT_SIZES[stored.meta["ggml_type"]]
            if start % block == 0 and stop % block == 0:
                data = p["data"][:, start // block * size : stop // block * size].contiguous()
                return QuantTensor(stored.format, "gguf", (rows, stop - start), {"data": data}, stored.meta)
        elif stored.format.startswith("int4_g"):
            g = stored.meta["group_size"]
            if start % g == 0 and stop % g == 0 and start % 8 == 0 and stop % 8 == 0:
                parts = {"weight_packed": p["weight_packed"][:, start // 8 : stop // 8].contiguous(),
                         "weight_scale": p["weight_scale"][:, start // g : stop // g].contiguous()}
                return QuantTensor(stored.format, "hf", (rows, stop - start), parts, stored.meta)
        elif stored.format == "mxfp4":
            if start % 32 == 0 and stop % 32 == 0:
                parts = {"blocks": p["blocks"][:, start // 32 : stop // 32].contiguous(),
                         "scales": p["scales"][:, start // 32 : stop // 32].contiguous()}
                return QuantTensor("mxfp4", "hf", (rows, stop - start), parts, stored.meta)
    return dense(stored, torch.float32, "cpu")[:, start:stop].contiguous()
