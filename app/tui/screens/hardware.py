"""What this machine has (the doctor's report, in plain words first) and its memory, live;
measuring it again (with the memory bandwidth), and benchmarking the chat's model on it."""

from __future__ import annotations

import psutil
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Label, Static

from hybridmoe.app.render import hardware_text
from hybridmoe.app.tui.hardware_words import summary_lines, warnings
from hybridmoe.app.tui.screens.benchmark import open_benchmark
from hybridmoe.app.tui.widgets.nav_bar import NavBar
from hybridmoe.app.tui.workers import ReportsWorkerErrors, WorkerFailed
from hybridmoe.backend.units import fmt_bytes

MEMORY_INTERVAL_S = 1.0
BAR = 40


def usage_bar(used: int, total: int, width: int = BAR) -> Text:
    cells = round(width * used / total) if total else 0
    share = used / total if total else 0.0
    style = "red" if share > 0.9 else "yellow" if share > 0.75 else "green"
    return Text.assemble(("█" * cells, style), ("░" * (width - cells), "bright_black"))


def memory_text() -> Text:
    vm = psutil.virtual_memory()
    swap = psutil.swap_memory()
    rss = psutil.Process().memory_info().rss
    out = Text()
    out.append("RAM   ")
    out.append_text(usage_bar(vm.total - vm.available, vm.total))
    out.append(f" {fmt_bytes(vm.total - vm.available)} used of {fmt_bytes(vm.total)}, "
               f"{fmt_bytes(vm.available)} available\n")
    out.append("swap  ")
    out.append_text(usage_bar(swap.used, swap.total) if swap.total else Text("none", style="bright_black"))
    if swap.total:
        out.append(f" {fmt_bytes(swap.used)} used of {fmt_bytes(swap.total)}")
    out.append(f"\nhybridmoe itself: {fmt_bytes(rss)} resident")
    return out


class HardwareScreen(ReportsWorkerErrors, Screen):
    BINDINGS = [
        Binding("ctrl+d", "detect", "Measure", tooltip="Detect this machine again, with its memory bandwidth"),
        Binding("b", "benchmark", "Benchmark", tooltip="Benchmark the model: prefill and decode tokens/s"),
    ]

    class Detected(Message):
        def __init__(self, hardware):
            super().__init__()
            self.hardware = hardware

    class Waiting(Message):
        """The measurement waits for model work (an answer, a load) to end."""

        def __init__(self, what: str):
            super().__init__()
            self.what = what

    def compose(self) -> ComposeResult:
        yield NavBar("hardware")
        with VerticalScroll(id="hardware-body"):
            yield Label("This machine", classes="section-title")
            yield Static("Detecting …", id="hardware-summary")
            yield Static("", id="hardware-warnings", classes="warnings")
            yield Label("Memory now", classes="section-title")
            yield Static(memory_text(), id="hardware-memory")
            yield Label("Details (hybridmoe doctor)", classes="section-title")
            yield Static("", id="hardware-details", markup=False)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.set_interval(MEMORY_INTERVAL_S, self._sample_memory)
        if self.app.hardware is not None:
            self._show(self.app.hardware)
        else:
            self._detect(self.app.settings.measure_bandwidth)

    def _sample_memory(self) -> None:
        self.query_one("#hardware-memory", Static).update(memory_text())

    def action_detect(self) -> None:
        self.query_one("#hardware-summary", Static).update("Detecting (and measuring the memory bandwidth) …")
        self._detect(True, wait=True)

    def action_benchmark(self) -> None:
        open_benchmark(self.app)

    @work(thread=True, exclusive=True, exit_on_error=False, group="detect")
    def _detect(self, measure_bandwidth: bool, wait: bool = False) -> None:
        # Asked for (Ctrl+D), the measurement waits for an answer to end; on the way past it
        # is skipped, and the profile says so.
        hardware = self.app.services.detect_hardware(
            measure_bandwidth=measure_bandwidth, wait=wait, on_wait=lambda what: self.post_message(self.Waiting(what)))
        self.post_message(self.Detected(hardware))

    def on_worker_failed(self, event: WorkerFailed) -> None:
        # The App shows what went wrong (the message bubbles on); the summary must not go on
        # saying "Detecting".
        if event.worker.group == "detect":
            self.query_one("#hardware-summary", Static).update("The hardware could not be detected (see the message); "
                                                               "Ctrl+D tries again.")

    def on_hardware_screen_waiting(self, event: Waiting) -> None:
        self.query_one("#hardware-summary", Static).update(
            f"The memory bandwidth is measured when {event.what} has ended: measuring beside it would "
            "measure a busy machine …")

    def on_hardware_screen_detected(self, event: Detected) -> None:
        self.app.hardware = event.hardware
        self._show(event.hardware)

    def _show(self, hardware) -> None:
        self.query_one("#hardware-summary", Static).update("\n".join(summary_lines(hardware)))
        notes = warnings(hardware)
        box = self.query_one("#hardware-warnings", Static)
        box.update("\n".join(f"! {w}" for w in notes))
        box.display = bool(notes)
        self.query_one("#hardware-details", Static).update(hardware_text(hardware))
