"""Counting which routed experts the running model activates.

Counts accumulate in one int64 tensor per MoE layer, the rows of one table (a NumPy bincount
per layer call, no Python per token: PyTorch's bincount and in-place add cost about 60 us a
call inside a decode step, against about 6 us; the native decode chain counts in the table
itself). Ids still on a GPU are counted there, in a table of that device's added to the
host's when the counts are read: counting them on the host would make the host wait for the
device at every MoE layer of a decode step. ``to_expert_stats`` hands the counts to the
planner's ``ExpertStats`` (its JSON file format is the one the ``frequency`` placement
strategy reads), and ``main_share`` says how many activations the main-device experts served
under the current placement.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping

import numpy as np
import torch

from hybridmoe.backend.plan.stats import ExpertStats


class ExpertRecorder:
    def __init__(self, model: str, n_experts: int, moe_layers: Collection[int],
                 placement: Mapping[int, Collection[int]] | None = None):
        self.model = model
        self.n_experts = n_experts
        self.tokens = 0
        self.enabled = True
        layers = sorted(moe_layers)
        self._table = torch.zeros(len(layers), n_experts, dtype=torch.int64)
        table = self._table.numpy()  # the same memory
        self._flat = table.reshape(-1)
        self._row = {layer: i for i, layer in enumerate(layers)}
        self._counts = dict(zip(layers, self._table))
        self._views = dict(zip(layers, table))
        self._on_devices: dict[torch.device, torch.Tensor] = {}  # counts not yet added to the table
        self.placement = {int(k): tuple(int(e) for e in v) for k, v in (placement or {}).items()}

    def record(self, layer: int, topk_ids: torch.Tensor | np.ndarray) -> None:
        """Count the experts chosen by one layer call (topk_ids [T, k], on any device)."""
        if not self.enabled:
            return
        if isinstance(topk_ids, torch.Tensor) and topk_ids.device.type != "cpu":
            table = self._on_devices.get(topk_ids.device)
            if table is None:
                table = self._on_devices[topk_ids.device] = torch.zeros_like(self._table, device=topk_ids.device)
            flat = topk_ids.reshape(-1)
            table[self._row[layer]].index_add_(0, flat, torch.ones_like(flat))
            return
        ids = topk_ids if isinstance(topk_ids, np.ndarray) else topk_ids.numpy()
        self._views[layer] += np.bincount(ids.reshape(-1), minlength=self.n_experts)

    @property
    def counts(self) -> dict[int, torch.Tensor]:
        """Activations per MoE layer: int64 [n_experts] per layer (views of one table)."""
        for table in self._on_devices.values():
            self._table += table.cpu()
        # Dropped, not zeroed: made inside inference mode, they cannot change outside it.
        self._on_devices.clear()
        return self._counts

    def table(self, layers: Collection[int]) -> tuple[np.ndarray, np.ndarray]:
        """(every layer's counts as one flat int64 array, where each of `layers`' counts start
        in it) for a caller that counts in place while ``enabled`` (the native decode chain)."""
        return self._flat, np.array([self._row[layer] * self.n_experts for layer in layers], dtype=np.int64)

    def add_tokens(self, n: int) -> None:
        if self.enabled:
            self.tokens += n

    def reset(self) -> None:
        self.tokens = 0
        for c in self.counts.values():
            c.zero_()

    def main_share(self) -> float | None:
        """Share of all recorded activations served by main-device experts (None: no data)."""
        total = sum(int(c.sum()) for c in self.counts.values())
        if not total:
            return None
        on_main = sum(int(self.counts[layer][list(ids)].sum()) for layer, ids in self.placement.items()
                      if layer in self.counts and ids)
        return on_main / total

    def to_expert_stats(self) -> ExpertStats:
        return ExpertStats(
            model=self.model,
            n_experts=self.n_experts,
            tokens=self.tokens,
            layers={layer: c.tolist() for layer, c in sorted(self.counts.items())},
        )

    def to_dict(self) -> dict:
        d = self.to_expert_stats().to_dict()
        d["main_share"] = self.main_share()
        return d

    def save(self, path: str | os.PathLike) -> None:
        """Write the statistics file the planner reads (atomically)."""
        self.to_expert_stats().save(path)
