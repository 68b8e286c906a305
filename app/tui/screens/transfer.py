"""A download or conversion started from the Models screen, in a dialog of its own."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label

from hybridmoe.app.tui.widgets.transfer import Job, TransferPanel


class TransferScreen(ModalScreen[Path | None]):
    """Starts the job at once; dismisses with the model's path when done. Escape cancels a
    running job (its partial files stay for a resume) or closes the dialog."""

    BINDINGS = [Binding("escape", "close", "Cancel / close")]

    def __init__(self, job: Job):
        super().__init__(classes="dialog")
        self.job = job

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("Getting a model", classes="dialog-title")
            yield TransferPanel(self.job, autostart=True)

    def on_transfer_panel_finished(self, event: TransferPanel.Finished) -> None:
        event.stop()
        for path in event.obtained:
            self.app.remember_obtained(path)
        self.dismiss(event.path)

    def action_close(self) -> None:
        panel = self.query_one(TransferPanel)
        if panel.running:
            panel.cancel()
        else:
            self.dismiss(None)
