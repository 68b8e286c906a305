"""The API server dialog (F7): serve the loaded model (the chat's) over the OpenAI API, see
its address and the requests it is answering, stop it. Closing the dialog leaves the server
running."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from hybridmoe.app.server.runner import DEFAULT_HOST, DEFAULT_PORT
from hybridmoe.app.tui.api_server import ChatModelServer
from hybridmoe.backend.errors import HybridMoeError, UsageError

# Finished requests listed.
_RECENT = 5
# How often the counts are refreshed, and the chat's model checked, in seconds.
_REFRESH_S = 0.5


def watch_model(app, control: ChatModelServer) -> None:
    """Stop the server once the model it serves is gone (another was loaded, or it was unloaded)."""
    if control.model_gone():
        model = control.model
        control.stop()
        app.notify(f"The chat changed model: the API server for {model} stopped. F7 starts it for the new one.",
                   severity="warning", timeout=10)


class ServerScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "dismiss", "Close")]
    DEFAULT_CSS = """
    ServerScreen #server-settings { height: auto; }
    ServerScreen #server-settings Label { padding: 1 1 0 0; }
    ServerScreen #server-settings Input { width: 1fr; margin-right: 1; }
    ServerScreen #server-port { max-width: 12; }
    ServerScreen #server-status { margin-bottom: 1; }
    ServerScreen #server-counts { margin-top: 1; }
    ServerScreen #server-recent { color: $text-muted; height: auto; }
    """

    def __init__(self, control: ChatModelServer):
        super().__init__(classes="dialog")
        self.control = control

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("API server (OpenAI-compatible)", classes="dialog-title")
            yield Static("", id="server-status")
            with Horizontal(id="server-settings"):
                yield Label("Host")
                yield Input(DEFAULT_HOST, id="server-host")
                yield Label("Port")
                yield Input(str(DEFAULT_PORT), id="server-port", type="integer")
                yield Label("API key")
                yield Input(id="server-key", password=True, placeholder=f"optional on {DEFAULT_HOST}")
            yield Static("", id="server-counts")
            yield Static("", id="server-recent", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Start", variant="primary", id="server-toggle")
                yield Button("Close", id="server-close")

    def on_mount(self) -> None:
        self.refresh_view()
        self.set_interval(_REFRESH_S, self.refresh_view)
        self.query_one("#server-toggle", Button).focus()

    def refresh_view(self) -> None:
        control = self.control
        watch_model(self.app, control)
        running = control.running
        status = self.query_one("#server-status", Static)
        if running:
            at_once = ("one request at a time" if control.parallel == 1 else
                       f"up to {control.parallel} requests at once, the chat's included")
            status.update(f"Serving [b]{escape(control.model)}[/b] at [b]{escape(control.url)}[/b] (the base URL "
                          f"for OpenAI clients), {at_once}.\nEsc closes this dialog; the server keeps running.")
        else:
            loaded = self.app.models.loaded is not None
            status.update("Stopped. Start serves the chat's model to programs on "
                          + ("this machine (or others, with a host and an API key)." if loaded else
                             "this machine, once a model is loaded (F2)."))
        self.query_one("#server-toggle", Button).label = "Stop" if running else "Start"
        for field in self.query(Input):
            field.disabled = running
        counts = control.counts()
        self.query_one("#server-counts", Static).update(
            f"{counts.running} of {control.parallel} answering · {counts.waiting} waiting · "
            f"{control.in_progress} requests open · {counts.completed} answered" if running and counts else "")
        recent = control.recent(_RECENT) if running else []
        self.query_one("#server-recent", Static).update("\n".join(r.line() for r in reversed(recent)))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "server-close":
            self.dismiss(None)
        elif self.control.running:
            self.control.stop()
            self.notify("The API server stopped.")
        else:
            self.start()
        self.refresh_view()

    def start(self) -> None:
        host = self.query_one("#server-host", Input).value.strip() or DEFAULT_HOST
        port_text = self.query_one("#server-port", Input).value.strip()
        key = self.query_one("#server-key", Input).value.strip() or None
        try:
            if not port_text.isdigit() or int(port_text) > 65535:
                raise UsageError(f"{port_text!r} is not a TCP port", "Give a number from 1 to 65535, such as 8000.")
            self.control.start(self.app.services, host, int(port_text), key)
        except HybridMoeError as error:
            self.app.show_error(error)
            return
        # Checked from the App, so that it goes on when this dialog is closed.
        app, control = self.app, self.control
        control.watchdog = app.set_interval(1.0, lambda: watch_model(app, control))
        self.notify(f"Serving {self.control.model} at {self.control.url}")
