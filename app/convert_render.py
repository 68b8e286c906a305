"""What `hybridmoe convert` prints: the progress line (bytes written, rate, time left, current
tensor) and, at the end, the file and the types its tensors were stored in.

The converter reports ``Progress`` events (bytes of the output written, of the estimated
total); the rate and ETA are measured here, over the whole stage so far (a conversion's pace
is steady, unlike a download's).
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import TextIO

from hybridmoe.app.hub_render import ProgressLine
from hybridmoe.backend.hub.meter import fmt_duration
from hybridmoe.backend.session import Progress
from hybridmoe.backend.units import fmt_bytes, fmt_rate

# Tensor names listed per type before "and N more" (grouped by layer, see compact_names).
MAX_LISTED = 8

_STAGES = {"convert": "converting", "quantize": "quantizing (llama.cpp)", "check": "checking"}


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
        try:
            self.line.show(text)
        except OSError:  # the terminal went away (SIGHUP): the conversion stops cleanly without its line
            self.line.enabled = False

    def done(self) -> None:
        try:
            self.line.done()
        except OSError:
            self.line.enabled = False


def stored_types_text(path: Path, types) -> str:
    """"Wrote PATH (SIZE, Q8_0; tensors: Q8_0 40, F32 25)"; when some weights could not take
    the requested type (``hybridmoe.backend.convert.StoredTypes``), which ones kept which type, and why."""
    counts = ", ".join(f"{name} {len(names)}" for name, names in
                       sorted(types.by_type.items(), key=lambda item: (-len(item[1]), item[0])))
    quant = types.quant.upper()
    size = fmt_bytes(Path(path).stat().st_size)
    if not types.kept:
        return f"Wrote {path} ({size}, {quant}; tensors: {counts})"
    n_kept = sum(len(names) for names in types.kept.values())
    rows = ", ".join(str(r) for r in types.rows)
    lines = [f"Wrote {path} ({size}; tensors: {counts})",
             f"  {n_kept} weight tensors did not take {quant}: their rows ({rows} weights) are not whole "
             f"blocks of {types.block}, so they kept another type:"]
    for name, names in sorted(types.kept.items()):
        lines.append(f"    {name} ({len(names)}): {compact_names(names)}")
    return "\n".join(lines)


def compact_names(names: list[str], limit: int = MAX_LISTED) -> str:
    """Tensor names with the layers folded: "blk.0-2,5.ffn_down_exps.weight, output.weight"."""
    layers: dict[str, list[int]] = {}
    for name in names:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        key = m.group(2) if m else name
        layers.setdefault(key, [])
        if m:
            layers[key].append(int(m.group(1)))
    parts = [f"blk.{_ranges(sorted(found))}.{key}" if found else key for key, found in layers.items()]
    shown = ", ".join(parts[:limit])
    return shown + (f", and {len(parts) - limit} more" if len(parts) > limit else "")


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)
