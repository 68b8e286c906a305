"""The chat's status line: model, time to first token, tokens/s beside the plan's expected
figure, context used, share of experts served from the GPU, memory.

It is one line at any width: an 80-column terminal must not wrap it (a wrapped status line
pushes the input down and hides the chat's last line). What does not fit goes, least useful
first: wider separators, then the model name's tail, then the last parts (the parts are given
most useful first).
"""

from __future__ import annotations

from textual.widgets import Static

from hybridmoe.app.tui.widgets.plan_view import tokens_per_s
from hybridmoe.backend.session import Stats
from hybridmoe.backend.units import fmt_bytes

SEPARATOR, TIGHT_SEPARATOR = "  ·  ", " · "
# A model name is cut no shorter than this (with "…"): below it, it no longer says which model.
MIN_NAME = 16
# The widget's padding, left and right: its text has the width less this.
PADDING = 2


def stats_words(stats: Stats, context: int | None, main_device: str, context_used: int | None = None,
                expected: float | None = None) -> list[str]:
    """A finished answer's figures, most useful first: the decode speed with the plan's expected
    figure (`expected`, the same the Plan screen shows), the context used, the first token's wait,
    where the experts ran, the memory."""
    parts = []
    if stats.decode_tokens_per_s:
        parts.append(f"{stats.decode_tokens_per_s:,.1f} tok/s" + (f" (expected {tokens_per_s(expected)})" if expected else ""))
    used = context_used if context_used is not None else stats.prompt_tokens + stats.generated_tokens
    parts.append(f"context {used:,}/{context:,}" if context else f"context {used:,}")
    if stats.time_to_first_token_s is not None:
        parts.append(f"first token {stats.time_to_first_token_s:.2f} s")
    if main_device == "cpu":
        parts.append("CPU only")
    elif stats.main_device_expert_share is not None:
        parts.append(f"{stats.main_device_expert_share:.0%} of experts on GPU")
    memory = [f"{'RAM' if name == 'host' else name} {fmt_bytes(b)}" for name, b in stats.peak_memory_bytes.items()]
    if memory:
        parts.append("peak " + ", ".join(memory))
    return parts


def one_line(name: str, parts: list[str], width: int) -> str:
    """`name` and `parts` in one line of at most `width` characters (module docstring). The
    first part is never dropped, only cut."""
    for separator in (SEPARATOR, TIGHT_SEPARATOR):
        line = separator.join(p for p in (name, *parts) if p)
        if len(line) <= width:
            return line
    rest = TIGHT_SEPARATOR.join(parts)
    room = width - len(rest) - len(TIGHT_SEPARATOR)
    if name and room >= MIN_NAME:
        return f"{name[:room - 1]}…{TIGHT_SEPARATOR}{rest}"
    short = name[:MIN_NAME - 1] + "…" if len(name) > MIN_NAME else name
    kept = list(parts)
    while len(kept) > 1:
        kept.pop()
        line = TIGHT_SEPARATOR.join(p for p in (short, *kept) if p)
        if len(line) <= width:
            return line
    line = TIGHT_SEPARATOR.join(p for p in (short, *kept) if p)
    if len(line) > width and kept:
        line = kept[0]  # the message before the name
    return line if len(line) <= width else line[:max(width - 1, 0)] + "…"


class StatusLine(Static):
    DEFAULT_CSS = """
    StatusLine { height: 1; padding: 0 1; }
    """

    def __init__(self, **kwargs):
        super().__init__("", markup=False, **kwargs)
        self.model_name = ""
        self._parts: list[str] = []

    def say(self, *parts: str) -> None:
        self._parts = [p for p in parts if p]
        self._show()

    def on_resize(self) -> None:
        self._show()

    def _show(self) -> None:
        # (`size` is the content's, inside the padding.) Before its first layout the widget has
        # no width: the terminal's is the best guess.
        width = self.size.width or self.app.size.width - PADDING
        line = one_line(self.model_name, self._parts, max(width, 1))
        self.update(line)
        # What had to go is still there on hover.
        whole = SEPARATOR.join(p for p in (self.model_name, *self._parts) if p)
        self.tooltip = whole if whole != line else None

    def show_stats(self, stats: Stats, context: int | None, main_device: str, context_used: int | None = None,
                   expected: float | None = None) -> None:
        self.say(*stats_words(stats, context, main_device, context_used, expected))

    def show_live(self, tokens: int, seconds: float, first_token_s: float | None) -> None:
        rate = f"{tokens / seconds:,.1f} tok/s" if seconds > 0 and tokens > 1 else ""
        first = f"first token {first_token_s:.2f} s" if first_token_s is not None else "waiting for the first token"
        self.say("generating", rate, first, "Esc stops")
