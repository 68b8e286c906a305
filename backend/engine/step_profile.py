"""Where a decode step's time goes, and how many bytes each part reads.

A decode token on the CPU is a chain of native calls (``cpu_decode``); the end-to-end speed
is the memory bandwidth only if every call reads at the wall and nothing sits between them.
With a GPU, the hybrid scheduler's MoE layers record the host's time in the parts of a layer
(``hybrid``): issuing the router and the GPU experts, waiting for the GPU, the CPU experts.
While ``recording()`` is active, the decode step times each call and adds it to its part,
with the bytes the call read (the stored weights of a projection once per step, the experts
of the union of the rows' choices, each row's cache positions), so that a benchmark can set
every part's GB/s against the machine's bandwidth. Off (the default), the cost is one global
read per call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# The parts, in the order a report lists them, and what each covers.
PARTS = {
    "experts": "routed experts",
    "qkv": "attention q|k|v projections",
    "o": "attention output projection",
    "shared": "shared experts",
    "mlp": "dense MLP layers",
    "router": "router logits",
    "attend": "attention over the cache",
    "gpu_experts": "GPU and shared experts (issuing them)",
    "device_wait": "waiting for the GPU (a layer's inputs to the CPU experts)",
    "small": "norms, rope, cache write, top-k, activations",
    "head": "LM head",
    "sampling": "sampling",
    "rest": "between calls (Python, embedding, cache bookkeeping)",
}


@dataclass
class StepProfile:
    """Seconds and bytes per part, summed over the steps recorded."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))

    def add(self, part: str, seconds: float, nbytes: int = 0) -> None:
        self.seconds[part] += seconds
        self.bytes[part] += nbytes

    def close(self, total_seconds: float) -> None:
        """The parts measured inside steps that took `total_seconds` in all: what no part
        holds is time between the calls."""
        self.seconds["rest"] += max(0.0, total_seconds - sum(self.seconds.values()))

    def per_token(self, tokens: int) -> dict[str, dict[str, float]]:
        """{part: {"seconds", "bytes"}} per token, parts that took time or read bytes."""
        return {p: {"seconds": self.seconds[p] / tokens, "bytes": self.bytes[p] / tokens}
                for p in PARTS if self.seconds[p] or self.bytes[p]}


active: StepProfile | None = None


def clock() -> float:
    """The start of a timed call while a profile records, else 0 (no clock read)."""
    return time.perf_counter() if active is not None else 0.0


def lap(part: str, t0: float, nbytes: int = 0) -> float:
    """Add the time since `t0` (from ``clock`` or a previous lap) and `nbytes` read to `part`
    of the recording profile; the time now, for the next lap (0 when not recording)."""
    if active is None:
        return 0.0
    now = time.perf_counter()
    active.add(part, now - t0, nbytes)
    return now


@contextmanager
def recording() -> Iterator[StepProfile]:
    """Record the decode steps run inside the block into a new profile."""
    global active
    profile, saved = StepProfile(), active
    active = profile
    try:
        yield profile
    finally:
        active = saved
