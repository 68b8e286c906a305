"""Per-layer, per-expert activation counts: recorded by the engine, read by the `frequency` strategy.

File format (JSON, stable; written atomically):
    {"format": "hybridmoe-expert-stats/1", "model": "<name>", "tokens": N,
     "n_experts": E, "layers": {"3": [count of expert 0, count of expert 1, ...], ...}}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hybridmoe.backend.errors import ModelError, UsageError
from hybridmoe.backend.files import write_atomic

FORMAT = "hybridmoe-expert-stats/1"


@dataclass
class ExpertStats:
    model: str
    n_experts: int
    tokens: int = 0
    layers: dict[int, list[int]] = field(default_factory=dict)

    def record(self, layer: int, expert_ids) -> None:
        """Count one activation for each expert id (an iterable of ints, repeats allowed)."""
        counts = self.layers.setdefault(layer, [0] * self.n_experts)
        for e in expert_ids:
            counts[int(e)] += 1

    def activation_share(self, layer: int, experts) -> float | None:
        """Share of layer's recorded activations that fell on `experts`; None without data."""
        counts = self.layers.get(layer)
        total = sum(counts) if counts else 0
        if not total:
            return None
        return sum(counts[e] for e in experts) / total

    def ranked_pairs(self) -> list[tuple[int, int, int]]:
        """(count, layer, expert) for every recorded pair, most used first; ties by position."""
        pairs = [(c, layer, e) for layer, counts in self.layers.items() for e, c in enumerate(counts)]
        pairs.sort(key=lambda p: (-p[0], p[1], p[2]))
        return pairs

    def merged(self, other: ExpertStats) -> ExpertStats:
        """These counts plus ``other``'s: the same model's usage recorded in another session.
        Layers only one of them has are kept as they are."""
        self._check_same_shape(other)
        layers = {layer: list(counts) for layer, counts in self.layers.items()}
        for layer, counts in other.layers.items():
            mine = layers.setdefault(layer, [0] * self.n_experts)
            layers[layer] = [a + b for a, b in zip(mine, counts, strict=True)]
        return ExpertStats(model=self.model or other.model, n_experts=self.n_experts,
                           tokens=self.tokens + other.tokens, layers=layers)

    def since(self, earlier: ExpertStats | None) -> ExpertStats:
        """What was counted after ``earlier``, an older snapshot of the same running count
        (None: nothing before). A recorder only ever adds, so no difference is negative."""
        if earlier is None:
            return ExpertStats(model=self.model, n_experts=self.n_experts, tokens=self.tokens,
                               layers={layer: list(counts) for layer, counts in self.layers.items()})
        self._check_same_shape(earlier)
        layers = {}
        for layer, counts in self.layers.items():
            before = earlier.layers.get(layer, [0] * self.n_experts)
            delta = [a - b for a, b in zip(counts, before, strict=True)]
            if any(d < 0 for d in delta):
                raise ValueError(f"layer {layer}: the earlier snapshot counts more than this one; "
                                 "they are not snapshots of the same recording")
            layers[layer] = delta
        return ExpertStats(model=self.model, n_experts=self.n_experts, tokens=self.tokens - earlier.tokens,
                           layers=layers)

    @property
    def activations(self) -> int:
        return sum(sum(counts) for counts in self.layers.values())

    def _check_same_shape(self, other: ExpertStats) -> None:
        if other.n_experts != self.n_experts:
            raise ModelError(
                f"expert statistics of {other.model or 'a model'} count {other.n_experts} experts per layer, "
                f"those of {self.model or 'this model'} {self.n_experts}: they are not the same model's",
                "Record statistics for this model in a file of its own.",
            )

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "tokens": self.tokens,
            "n_experts": self.n_experts,
            "layers": {str(k): v for k, v in sorted(self.layers.items())},
        }

    def save(self, path: str | os.PathLike) -> None:
        write_atomic(path, json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | os.PathLike) -> ExpertStats:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise UsageError(f"statistics file {path} does not exist", "Record one with `hybridmoe run --record-stats FILE`.")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelError(f"statistics file {path} is not readable JSON: {e}", "Record it again.")
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ModelError(f"{path} is not a hybridmoe expert statistics file (expected format {FORMAT!r})")
        try:
            n = int(d["n_experts"])
            layers = {int(k): [int(c) for c in v] for k, v in d["layers"].items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"statistics file {path} is malformed: {e}", "Record it again.")
        for layer, counts in layers.items():
            if len(counts) != n or any(c < 0 for c in counts):
                raise ModelError(f"statistics file {path}: layer {layer} has {len(counts)} counts for {n} experts")
        return cls(model=str(d.get("model", "")), n_experts=n, tokens=int(d.get("tokens", 0)), layers=layers)
