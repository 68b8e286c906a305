"""The Plan as a picture: verdict and speed, one memory bar per device, one bar per MoE layer.

The bars are text (Rich ``Text``), so they render the same in every terminal and in
snapshots; the numbers next to them are the Plan's, formatted as the CLI formats them. Each
kind of cell has a glyph of its own as well as a colour: a monochrome terminal, or a reader
who does not tell green from blue, still tells them apart.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Static

from hybridmoe.backend.plan.plan import DevicePlan, Plan
from hybridmoe.backend.units import fmt_bytes, fmt_rate

BAR = 44  # characters; with the labels it fits an 80-column terminal

# What the memory bar distinguishes (the brief's four: weights, KV cache, reserve, free).
SEGMENTS = (
    ("weights", "█", "green"),
    ("KV cache", "▓", "dark_orange"),
    ("reserve", "▒", "magenta"),
    ("free", "░", "bright_black"),
)
GPU_STYLE, CPU_STYLE = "green", "blue"
GPU_CELL, CPU_CELL = "█", "▒"


def device_parts(device: DevicePlan) -> dict[str, int]:
    """Bytes of the four segments; everything that is not KV or a reserve counts as weights."""
    by = device.bytes_by_class
    kv = by.get("kv_cache", 0)
    reserve = by.get("prefill_reserve", 0) + by.get("activations", 0)
    weights = sum(by.values()) - kv - reserve
    return {"weights": weights, "KV cache": kv, "reserve": reserve, "free": max(device.free_bytes, 0)}


def memory_bar(device: DevicePlan, width: int = BAR) -> Text:
    parts = device_parts(device)
    scale_to = max(device.budget_bytes, device.used_bytes, 1)
    text = Text()
    cells_left = width
    for name, char, style in SEGMENTS:
        cells = round(width * parts[name] / scale_to) if parts[name] else 0
        cells = min(cells, cells_left)
        text.append(char * cells, style=style)
        cells_left -= cells
    if cells_left and parts["free"]:
        text.append("░" * cells_left, style="bright_black")  # rounding leftovers are free space
    elif cells_left:
        text.append(" " * cells_left)
    if device.used_bytes > device.budget_bytes:
        text.append(" over by " + fmt_bytes(device.used_bytes - device.budget_bytes), style="bold red")
    return text


def memory_picture(plan: Plan, width: int = BAR) -> Text:
    out = Text()
    for i, device in enumerate(plan.devices):
        if i:
            out.append("\n")
        out.append(f"{device.name}\n", style="bold")
        out.append_text(memory_bar(device, width))
        out.append(f"  {fmt_bytes(device.used_bytes)} of {fmt_bytes(device.budget_bytes)}\n")
        parts = device_parts(device)
        out.append("  ")
        for name, char, style in SEGMENTS:
            out.append(char, style=style)
            out.append(f" {name} {fmt_bytes(parts[name])}  ")
    return out


def layer_picture(plan: Plan, width: int = BAR) -> Text:
    """Per MoE layer: main-device experts (left) against CPU experts (right)."""
    out = Text()
    e = plan.n_routed_experts
    if not plan.moe_layers:
        return Text("This model has no MoE layers.")
    gpu = "GPU" if plan.main_device != "cpu" else "main device"
    out.append(GPU_CELL, style=GPU_STYLE)
    out.append(f" experts on the {gpu}   ")
    out.append(CPU_CELL, style=CPU_STYLE)
    out.append(" experts in host RAM, computed by the CPU\n")
    for i, layer in enumerate(plan.moe_layers):
        on_gpu = len(plan.gpu_experts.get(layer, ()))
        cells = round(width * on_gpu / e) if e else 0
        if on_gpu and not cells:
            cells = 1  # a layer with any GPU expert shows it
        out.append(f"layer {layer:>3} ")
        out.append(GPU_CELL * cells, style=GPU_STYLE)
        out.append(CPU_CELL * (width - cells), style=CPU_STYLE)
        out.append(f" {on_gpu:>4}/{e}")
        if i < len(plan.moe_layers) - 1:
            out.append("\n")
    return out


def verdict_text(plan: Plan) -> Text:
    wl = plan.workload
    out = Text()
    out.append(f"{plan.model}", style="bold")
    out.append(f" on {plan.hardware}: {wl.context:,} tokens × {wl.users} conversation(s), "
               f"KV {plan.kv_cache_dtype or wl.kv_dtype}, {wl.strategy}, backend {wl.backend}\n")
    if plan.fits:
        out.append("Fits", style="bold green")
        out.append(f" — {plan.reason}")
    else:
        out.append("Does not fit", style="bold red")
        out.append(f" — {plan.reason}")
    return out


def speed_cell(plan: Plan | None) -> str:
    """A table cell with the plan's decode speed: the expected figure, then the bound ("12.3 ≤30.1")."""
    if plan is None:
        return "?"
    if not plan.fits:
        return "does not fit"
    expected, bound = plan.decode_tokens_per_s_expected, plan.decode_tokens_per_s_upper_bound
    if expected and bound:
        return f"{tokens_per_s(expected)} ≤{tokens_per_s(bound)}"
    if expected or bound:
        return tokens_per_s(expected or bound)
    return "unknown"


def speed_text(plan: Plan) -> Text:
    out = Text()
    bound = plan.decode_tokens_per_s_upper_bound
    expected = plan.decode_tokens_per_s_expected
    if expected:
        out.append("Expected decode: ")
        out.append(f"{tokens_per_s(expected)} tokens/s", style="bold")
        out.append(f" ({plan.decode_expected_how})")
    if bound:
        out.append("\n" if expected else "")
        out.append("Upper bound: at most " if expected else "Estimated decode: at most ")
        out.append(f"{tokens_per_s(bound)} tokens/s", style="bold" if not expected else "")
        out.append(f", bound by {plan.decode_bound_by}")
    elif not expected and plan.host_bytes_per_token and not plan.host_bandwidth_bytes_per_s:
        out.append("Estimated decode: not known until the host memory bandwidth is measured "
                   "(Ctrl+D on the Plan screen measures it)")
    elif not expected:
        out.append(f"Estimated decode: {plan.decode_bound_by}")
    if plan.host_bandwidth_bytes_per_s and plan.host_bytes_per_token:
        # The bound is only as good as this figure: say where it came from.
        out.append(f"\nHost memory bandwidth: {fmt_rate(plan.host_bandwidth_bytes_per_s)}, "
                   f"{plan.host_bandwidth_source}")
    if plan.workload.users > 1 and plan.decode_tokens_per_s_per_user:
        each = plan.decode_tokens_per_s_per_user_expected
        out.append(f"\n{plan.workload.users} conversations together: "
                   + (f"expected {tokens_per_s(each)} tokens/s each, "
                      f"{tokens_per_s(plan.decode_tokens_per_s_aggregate_expected)} in all; " if each else "")
                   + f"at most {tokens_per_s(plan.decode_tokens_per_s_per_user)} tokens/s each, "
                   f"{tokens_per_s(plan.decode_tokens_per_s_aggregate)} in all")
    for note in plan.precision_notes:
        out.append(f"\nPrecision: {note}")
    gpu_experts, total = plan.gpu_expert_count, plan.n_routed_experts * len(plan.moe_layers)
    if plan.main_device == "cpu":
        out.append(f"\nNo GPU: all {total:,} routed experts are in host RAM, computed by the CPU; "
                   f"it reads {fmt_bytes(plan.host_bytes_per_token)} per token")
    elif total and gpu_experts == total:
        out.append(f"\nAll {total:,} routed experts are on the GPU: the CPU computes none")
    elif total:
        out.append(f"\nRouted experts on the GPU: {gpu_experts:,} of {total:,} ({gpu_experts / total:.0%}); "
                   f"host reads {fmt_bytes(plan.host_bytes_per_token)} per token")
    return out


def tokens_per_s(rate: float) -> str:
    """A speed estimate to three significant figures: its arithmetic is not finer than that
    (39,400, not 39,449.4), with one decimal below 100."""
    if rate >= 100:
        return f"{float(f'{rate:.3g}'):,.0f}"
    return f"{rate:.1f}"


def notes_text(plan: Plan) -> Text:
    out = Text()
    for s in plan.suggestions:
        out.append("• ", style="yellow")
        out.append(s + "\n")
    for w in plan.warnings:
        out.append("! ", style="bold yellow")
        out.append(w + "\n")
    out.rstrip()
    return out


class PlanView(Widget):
    """Shows one Plan; ``show(plan)`` replaces it."""

    DEFAULT_CSS = """
    PlanView { height: auto; }
    """

    def compose(self) -> ComposeResult:
        with Vertical(id="plan-summary"):
            yield Static(id="plan-verdict")
            yield Static(id="plan-speed")
            yield Static(id="plan-notes")
            yield Static(id="plan-memory")
        with VerticalScroll(id="plan-layers-scroll"):
            yield Static(id="plan-layers")

    plan: Plan | None = None

    def on_mount(self) -> None:
        if self.plan is not None:
            self._render_plan(self.plan)

    def show(self, plan: Plan) -> None:
        self.plan = plan
        # Not mounted yet: on_mount draws it. Mounted without its parts: it is being removed
        # (the screen closed as the plan came), and there is nothing to draw on.
        if self.is_mounted and self.query("#plan-verdict"):
            self._render_plan(plan)

    def _render_plan(self, plan: Plan) -> None:
        self.query_one("#plan-verdict", Static).update(verdict_text(plan))
        self.query_one("#plan-speed", Static).update(speed_text(plan))
        notes = notes_text(plan)
        notes_widget = self.query_one("#plan-notes", Static)
        notes_widget.update(notes)
        notes_widget.display = bool(notes.plain)
        self.query_one("#plan-memory", Static).update(memory_picture(plan))
        self.query_one("#plan-layers", Static).update(layer_picture(plan))
