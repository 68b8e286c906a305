"""Worker failures, reported in one place.

Slow work runs in ``@work(thread=True, exclusive=True, exit_on_error=False)`` workers on the
screen or widget that shows its result. Textual posts ``Worker.StateChanged`` to that node
only (it does not bubble), so every node that runs workers mixes in ``ReportsWorkerErrors``:
its one ``on_worker_state_changed`` turns a failure into a bubbling ``WorkerFailed`` message.
The node itself may handle that message first (to reset its buttons, say); the App handles
it last and shows the error dialog. Nothing a worker raises ever crashes the app.
"""

from __future__ import annotations

from textual.message import Message
from textual.worker import Worker, WorkerState


class WorkerFailed(Message):
    """A worker raised ``error``. Bubbles to the App, which shows it."""

    def __init__(self, worker: Worker, error: BaseException):
        super().__init__()
        self.worker = worker
        self.error = error


class ReportsWorkerErrors:
    """Mix into a Screen or Widget (before the Textual base class) that runs workers."""

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        if event.state == WorkerState.ERROR and event.worker.error is not None:
            self.post_message(WorkerFailed(event.worker, event.worker.error))  # type: ignore[attr-defined]
