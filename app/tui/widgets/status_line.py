"""The chat's status line: model, time to first token, tokens/s, context used, share of
experts served from the GPU, memory."""

from __future__ import annotations

from textual.widgets import Static

from hybridmoe.backend.session import Stats
from hybridmoe.backend.units import fmt_bytes


def stats_words(stats: Stats, context: int | None, main_device: str, context_used: int | None = None) -> list[str]:
    parts = []
    if stats.time_to_first_token_s is not None:
        parts.append(f"first token {stats.time_to_first_token_s:.2f} s")
    if stats.decode_tokens_per_s:
        parts.append(f"{stats.decode_tokens_per_s:,.1f} tok/s")
    used = context_used if context_used is not None else stats.prompt_tokens + stats.generated_tokens
    parts.append(f"context {used:,}/{context:,}" if context else f"context {used:,}")
    if main_device == "cpu":
        parts.append("CPU only")
    elif stats.main_device_expert_share is not None:
        parts.append(f"{stats.main_device_expert_share:.0%} of experts on GPU")
    memory = [f"{'RAM' if name == 'host' else name} {fmt_bytes(b)}" for name, b in stats.peak_memory_bytes.items()]
    if memory:
        parts.append("peak " + ", ".join(memory))
    return parts


class StatusLine(Static):
    DEFAULT_CSS = """
    StatusLine { height: auto; max-height: 2; padding: 0 1; }
    """

    def __init__(self, **kwargs):
        super().__init__("", markup=False, **kwargs)
        self.model_name = ""

    def say(self, *parts: str) -> None:
        self.update("  ·  ".join(p for p in (self.model_name, *parts) if p))

    def show_stats(self, stats: Stats, context: int | None, main_device: str, context_used: int | None = None) -> None:
        self.say(*stats_words(stats, context, main_device, context_used))

    def show_live(self, tokens: int, seconds: float, first_token_s: float | None) -> None:
        rate = f"{tokens / seconds:,.1f} tok/s" if seconds > 0 and tokens > 1 else ""
        first = f"first token {first_token_s:.2f} s" if first_token_s is not None else "waiting for the first token"
        self.say("generating", first, rate, "Esc stops")
