"""The terminal line of `hybridmoe convert`: bytes written, rate, time left, current tensor.

The converter reports ``Progress`` events (bytes of the output written, of the estimated
total); the rate and ETA are measured here, over the whole stage so far (a conversion's pace
is steady, unlike a download's).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from app.hub_render import ProgressLine
from backend.hub.meter import fmt_duration
from backend.session import Progress
from backend.units import fmt_bytes, fmt_rate

_STAGES = {"convert": "converting", "quantize": "quantizing (llama.cpp)"}


class ConvertProgress:
    """A ``ProgressCallback`` drawing one line on `stream` when it is a terminal."""

    def __init__(self, stream: TextIO = sys.stderr, clock=time.monotonic):
        self.line = ProgressLine(stream)
        self.clock = clock
        self.stage = ""
        self.started = 0.0

    def __call__(self, p: Progress) -> None:
        now = self.clock()
        if p.stage != self.stage:
            self.stage, self.started = p.stage, now
        self.line.show(self.text(p, now - self.started))

    def text(self, p: Progress, elapsed: float) -> str:
        rate = p.done / elapsed if elapsed > 0.5 and p.done else None
        eta = (p.total - p.done) / rate if rate and p.total else None
        pct = f"{100 * p.done / p.total:5.1f}%" if p.total else ""
        return (f"{_STAGES.get(p.stage, p.stage)} {pct} {fmt_bytes(p.done)} / {fmt_bytes(p.total)}  "
                f"{fmt_rate(rate)}  ETA {fmt_duration(eta)}  {p.message}")

    def show(self, text: str) -> None:
        self.line.show(text)

    def done(self) -> None:
        self.line.done()
