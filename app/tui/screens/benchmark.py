"""The benchmark of the chat's model (`hybridmoe bench generate` in the CLI), in a dialog.

hybridmoe.backend.bench.generate measures prefill and decode tokens/s with each backend in a process
of its own (its memory and threads its own). Those processes load the model again, so the
app's copy (the model service's, which the chat answers with) is unloaded first: two copies
of a large model would not fit. The chat loads it again when it is shown. Esc cancels: the running process is killed.
"""

from __future__ import annotations

import time
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar, Static

from hybridmoe.app.tui.workers import ReportsWorkerErrors, WorkerFailed
from hybridmoe.backend.session import CancelToken, Progress

BACKEND_NAMES = {"engine": "the embedded engine", "llamacpp": "llama.cpp"}
TICK_S = 0.5


def _name(path: Path) -> str:
    """A model's name as a person knows it: its folder, not the config.json inside."""
    return path.parent.name if path.name == "config.json" else path.name


def open_benchmark(app) -> None:
    """Offer to benchmark the chat's model (or the default one)."""
    if not app.model:
        app.notify("No model chosen yet: F6 runs the setup, F3 picks a model.", severity="warning")
        return
    if not isinstance(app.screen, BenchmarkScreen):
        app.push_screen(BenchmarkScreen(app.model))


class BenchmarkScreen(ReportsWorkerErrors, ModalScreen[None]):
    BINDINGS = [Binding("escape", "close", "Cancel / close")]

    class Resolved(Message):
        def __init__(self, path: Path, backends: tuple[str, ...]):
            super().__init__()
            self.path, self.backends = path, backends

    class Progressed(Message):
        def __init__(self, progress: Progress):
            super().__init__()
            self.progress = progress

    class Measured(Message):
        def __init__(self, summary: dict, table: str):
            super().__init__()
            self.summary, self.table = summary, table

    def __init__(self, model: str):
        super().__init__(classes="dialog")
        self.model = model
        self.path: Path | None = None
        self.backends: tuple[str, ...] = ()
        self.cancel = CancelToken()
        self.running = False
        self.summary: dict | None = None
        self._started = 0.0
        self._stage = ""

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label(f"Benchmark: {_name(Path(self.model))}", classes="dialog-title")
            yield Static("Looking at the model …", id="bench-about")
            yield ProgressBar(total=None, show_eta=False, id="bench-bar")
            yield Static("", id="bench-status")
            with VerticalScroll(id="bench-results"):  # the per-part breakdown is long: it scrolls, the buttons stay
                yield Static("", id="bench-table", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Start", variant="primary", id="bench-start", disabled=True)
                yield Button("Close", id="bench-close")

    def on_mount(self) -> None:
        self.query_one("#bench-bar").display = False
        self.set_interval(TICK_S, self._tick)
        self._resolve(self.model)

    @work(thread=True, exclusive=True, exit_on_error=False, group="bench-resolve")
    def _resolve(self, model: str) -> None:
        services = self.app.services
        path = Path(services.resolve_model(model))
        self.post_message(self.Resolved(path, services.bench_backends(path)))

    def on_benchmark_screen_resolved(self, event: Resolved) -> None:
        self.path, self.backends = event.path, event.backends
        sizes = self.app.services.bench_sizes
        who = " and ".join(BACKEND_NAMES.get(b, b) for b in self.backends)
        gguf_note = "" if "llamacpp" in self.backends else (
            " llama.cpp is compared on GGUF files (with llama-cpp-python installed) only.")
        self.query_one("#bench-about", Static).update(
            f"Measures prefill and decode tokens/s of {_name(self.path)} with {who}, each in a process of its "
            f"own: a {sizes['prompt_tokens']}-token prompt, {sizes['gen_tokens']} generated tokens, the median of "
            f"{sizes['repeats'] * sizes.get('rounds', 1)} runs (the backends taking turns), all experts on the CPU."
            f"{gguf_note} A large model takes minutes to load.\n"
            "The chat's copy of the model is unloaded first, to leave the memory to the benchmark; "
            "the chat loads it again when you go back to it."
        )
        start = self.query_one("#bench-start", Button)
        start.disabled = False
        start.focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "bench-start":
            self.action_start()
        else:
            self.action_close()

    def action_start(self) -> None:
        if self.running or self.path is None:
            return
        models = self.app.models
        refused = models.busy()
        if refused:
            self.notify(f"Not started: {refused}.", severity="warning")
            return
        models.unload("for the benchmark")
        self.running, self.summary, self.cancel = True, None, CancelToken()
        self._started, self._stage = time.monotonic(), "starting"
        self.query_one("#bench-table", Static).update("")
        bar = self.query_one("#bench-bar", ProgressBar)
        bar.update(total=len(self.backends), progress=0)
        bar.display = True
        self.query_one("#bench-start", Button).disabled = True
        self.query_one("#bench-close", Button).label = "Cancel"
        self._tick()
        self._measure(self.path, self.cancel)

    @work(thread=True, exclusive=True, exit_on_error=False, group="bench")
    def _measure(self, path: Path, cancel: CancelToken) -> None:
        services = self.app.services
        summary = services.benchmark(path, lambda p: self.post_message(self.Progressed(p)), cancel)
        self.post_message(self.Measured(summary, services.bench_table(summary)))

    def on_benchmark_screen_progressed(self, event: Progressed) -> None:
        p = event.progress
        self.query_one("#bench-bar", ProgressBar).update(total=p.total, progress=p.done)
        self._stage = p.message
        self._tick()

    def _tick(self) -> None:
        if self.running:
            elapsed = time.monotonic() - self._started
            self.query_one("#bench-status", Static).update(
                f"{self._stage.capitalize()} … {elapsed:,.0f} s (Esc cancels)")

    def on_benchmark_screen_measured(self, event: Measured) -> None:
        self.summary = event.summary
        self._stopped("Done.")
        self.query_one("#bench-bar", ProgressBar).update(progress=len(self.backends))
        self.query_one("#bench-table", Static).update(event.table)

    def on_worker_failed(self, event: WorkerFailed) -> None:
        # The App shows the error (or, for a cancel, a notification); the dialog gets usable again.
        if event.worker.group == "bench":
            self._stopped("Stopped.")

    def _stopped(self, status: str) -> None:
        self.running = False
        self.query_one("#bench-status", Static).update(status)
        self.query_one("#bench-start", Button).disabled = False
        self.query_one("#bench-start", Button).label = "Run again"
        self.query_one("#bench-close", Button).label = "Close"

    def action_close(self) -> None:
        if self.running:
            self.cancel.cancel()  # the worker kills the process and reports the cancel
        else:
            self.dismiss(None)
