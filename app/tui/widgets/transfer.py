"""Getting a model onto this disk: a download and, when needed, a conversion, with one
progress bar (bytes, rate, time left), Cancel, and Resume.

Resuming is the hub's work: a cancelled or interrupted pull leaves its partial files, and
pulling the same repository again continues them, even after the app was restarted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from textual import work
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Button, Label, ProgressBar, Static

from hybridmoe.app.tui.workers import ReportsWorkerErrors, WorkerFailed
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.hub.meter import fmt_duration
from hybridmoe.backend.session import Cancelled, CancelToken, Progress
from hybridmoe.backend.units import fmt_bytes, fmt_rate

STAGE_WORDS = {"download": "Downloading", "convert": "Converting", "quantize": "Quantizing"}


@dataclass(frozen=True)
class Job:
    """Download ``repo`` (one GGUF quantization with ``quant``), or start from the local
    ``model``; then, with ``convert_to``, convert it to that GGUF quantization."""

    repo: str = ""
    quant: str | None = None
    convert_to: str = ""
    model: LocalModel | None = None

    def label(self) -> str:
        if self.repo:
            what = self.repo + (f" {self.quant}" if self.quant else "")
        else:
            what = self.model.name if self.model else "?"
        return what + (f" → GGUF {self.convert_to.upper()}" if self.convert_to else "")


def progress_words(p: Progress, rate: float | None, eta: float | None) -> str:
    """"12.0 GiB of 60.1 GiB (20.0%) · 105.0 MB/s · 8:12 left"."""
    stage = STAGE_WORDS.get(p.stage, p.stage.capitalize())
    if p.unit == "B" and p.total:
        text = f"{stage}: {fmt_bytes(p.done)} of {fmt_bytes(p.total)} ({100 * p.done / p.total:.1f}%)"
    elif p.total:
        text = f"{stage}: {p.done:g} of {p.total:g} {p.unit}"
    else:
        text = f"{stage}: {p.message or p.done}"
    if rate:
        text += f" · {fmt_rate(rate)}"
    if eta is not None and p.total and p.done < p.total:
        text += f" · {fmt_duration(eta)} left"
    files_total = getattr(p, "files_total", 0)
    if files_total:
        text += f" · file {min(getattr(p, 'files_done', 0) + 1, files_total)} of {files_total}"
    return text


class _RateWindow:
    """Rate and ETA for stages whose events do not carry them (conversion)."""

    def __init__(self):
        self.stage, self.t0, self.done0 = "", 0.0, 0.0

    def measure(self, p: Progress) -> tuple[float | None, float | None]:
        rate = getattr(p, "rate_bytes_per_s", None)
        eta = getattr(p, "eta_s", None)
        if rate is not None or eta is not None:
            return rate, eta
        now = time.monotonic()
        if p.stage != self.stage:
            self.stage, self.t0, self.done0 = p.stage, now, p.done
            return None, None
        if now - self.t0 < 0.5 or p.done <= self.done0:
            return None, None
        rate = (p.done - self.done0) / (now - self.t0)
        eta = (p.total - p.done) / rate if p.total else None
        return (rate if p.unit == "B" else None), eta


class TransferPanel(ReportsWorkerErrors, Widget):
    """Runs one Job; posts ``Finished`` with the model's path, or ``Stopped``."""

    DEFAULT_CSS = """
    TransferPanel { height: auto; }
    TransferPanel ProgressBar { margin: 1 0; }
    """

    class Progressed(Message, bubble=False):
        def __init__(self, progress: Progress):
            super().__init__()
            self.progress = progress

    class Finished(Message):
        """The model is on disk at ``path``; ``obtained``: the files hybridmoe made (pull, conversion)."""

        def __init__(self, job: Job, path: Path, obtained: tuple[Path, ...]):
            super().__init__()
            self.job, self.path, self.obtained = job, path, obtained

    class Stopped(Message):
        def __init__(self, job: Job, message: str, hint: str):
            super().__init__()
            self.job, self.message, self.hint = job, message, hint

    def __init__(self, job: Job, *, autostart: bool = False, resuming: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.job = job
        self.autostart = autostart
        self.resuming = resuming  # an earlier attempt left partial files: the button says Resume
        self.cancel_token = CancelToken()
        self.running = False
        self._rates = _RateWindow()

    def compose(self) -> ComposeResult:
        yield Label(self.job.label(), id="transfer-title", classes="section-title")
        yield ProgressBar(total=None, show_eta=False, id="transfer-bar")
        yield Static("", id="transfer-detail")
        with Horizontal(classes="buttons"):
            yield Button("Resume" if self.resuming else "Start", variant="primary", id="transfer-start")
            yield Button("Cancel", variant="error", id="transfer-cancel", disabled=True)

    def on_mount(self) -> None:
        if self.autostart:
            self.start()
        else:
            self._set_buttons(running=False, label="Resume" if self.resuming else "Start")

    def on_unmount(self) -> None:
        # Quitting mid-download: stop the threads at their next chunk (the app waits for its
        # worker threads before it exits); the partial files stay for a resume.
        self.cancel_token.cancel()

    def start(self) -> None:
        if self.running:
            return
        self.running = True
        self.cancel_token = CancelToken()
        self._set_buttons(running=True)
        self.query_one("#transfer-detail", Static).update("Starting …")
        self._run(self.job, self.cancel_token)

    def cancel(self) -> None:
        if self.running:
            self.cancel_token.cancel()
            self.query_one("#transfer-detail", Static).update("Cancelling after the current chunk …")

    def _set_buttons(self, *, running: bool, label: str = "Resume") -> None:
        start = self.query_one("#transfer-start", Button)
        start.disabled = running
        start.label = label
        cancel = self.query_one("#transfer-cancel", Button)
        cancel.disabled = not running
        cancel.display = running  # nothing to cancel once it stopped or failed
        bar = self.query_one("#transfer-bar", ProgressBar)
        if running:
            bar.display = True
        elif bar.total is None:  # stopped before any size was known: no bar pulsing on as if at work
            bar.display = False

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "transfer-start":
            event.stop()
            self.start()
        elif event.button.id == "transfer-cancel":
            event.stop()
            self.cancel()

    @work(thread=True, exclusive=True, exit_on_error=False, group="transfer")
    def _run(self, job: Job, cancel: CancelToken) -> None:
        services = self.app.services  # type: ignore[attr-defined]
        obtained: list[Path] = []
        try:
            model = job.model
            if job.repo:
                model = services.pull(job.repo, job.quant, self._report, cancel)
                obtained.append(Path(model.path))
            if job.convert_to:
                path = services.convert(model, job.convert_to, self._report, cancel)
                obtained.append(Path(path))
            else:
                path = model.path
        except Cancelled as stopped:
            self.post_message(self.Stopped(job, stopped.what, stopped.hint or "Resume continues where it stopped."))
            return
        self.post_message(self.Finished(job, Path(path), tuple(obtained)))

    def _report(self, progress: Progress) -> None:
        # Called on download and conversion threads: post, never touch widgets here.
        self.post_message(self.Progressed(progress))

    def on_transfer_panel_progressed(self, event: Progressed) -> None:
        p = event.progress
        rate, eta = self._rates.measure(p)
        bar = self.query_one("#transfer-bar", ProgressBar)
        if p.total:
            bar.update(total=p.total, progress=p.done)
        self.query_one("#transfer-detail", Static).update(progress_words(p, rate, eta))

    def on_transfer_panel_finished(self, event: Finished) -> None:
        self.running = False
        self._set_buttons(running=False, label="Done")
        self.query_one("#transfer-start", Button).disabled = True
        bar = self.query_one("#transfer-bar", ProgressBar)
        bar.update(total=bar.total or 1, progress=bar.total or 1)
        self.query_one("#transfer-detail", Static).update(f"Done: {event.path}")

    def on_transfer_panel_stopped(self, event: Stopped) -> None:
        self.running = False
        self._set_buttons(running=False)
        self.query_one("#transfer-detail", Static).update(f"Stopped: {event.message}. {event.hint}")

    def on_worker_failed(self, event: WorkerFailed) -> None:
        # The App shows the error; here only the buttons come back (the message bubbles on).
        self.running = False
        self._set_buttons(running=False, label="Retry")
        self.query_one("#transfer-detail", Static).update(f"Failed: {getattr(event.error, 'what', event.error)}")
