"""Per-layer, per-expert activation counts: recorded by the engine, read by the `frequency` strategy.

File format (JSON, stable; written atomically):
    {"format": "hybridmoe-expert-stats/1", "model": "<name>", "tokens": N,
     "n_experts": E, "layers": {"3": [count of expert 0, count of expert 1, ...], ...}}
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from backend.errors import ModelError, UsageError

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

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "model": self.model,
            "tokens": self.tokens,
            "n_experts": self.n_experts,
            "layers": {str(k): v for k, v in sorted(self.layers.items())},
        }

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write to a temporary name and rename so a crash never leaves a half-written file.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ExpertStats":
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
