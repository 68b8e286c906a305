"""Where a decode step's time goes, and how many bytes each part reads.

A decode token on the CPU is a chain of native calls (``cpu_decode``); the end-to-end speed
is the memory bandwidth only if every call reads at the wall and nothing sits between them.
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

    def timed(self, part: str, t0: float, nbytes: int = 0) -> None:
        """Add the time since `t0` to `part`."""
        self.add(part, time.perf_counter() - t0, nbytes)

    def close(self, total_seconds: float) -> None:
        """The parts measured inside steps that took `total_seconds` in all: what no part
        holds is time between the calls."""
        self.seconds["rest"] += max(0.0, total_seconds - sum(self.seconds.values()))

    def per_token(self, tokens: int) -> dict[str, dict[str, float]]:
        """{part: {"seconds", "bytes"}} per token, parts that took time or read bytes."""
        return {p: {"seconds": self.seconds[p] / tokens, "bytes": self.bytes[p] / tokens}
                for p in PARTS if self.seconds[p] or self.bytes[p]}


active: StepProfile | None = None


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
