"""Modal dialogs: an error, a yes/no question, a choice from a list."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Label, OptionList, Static
from textual.widgets.option_list import Option

from hybridmoe.app.tui.errors import ErrorReport


class ErrorDialog(ModalScreen[None]):
    """The message and what to do about it; never a traceback."""

    BINDINGS = [Binding("escape,enter", "dismiss", "Close")]

    def __init__(self, report: ErrorReport):
        super().__init__(classes="dialog")
        self.report = report

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box error"):
            yield Label(self.report.title, classes="dialog-title")
            yield Static(self.report.message, id="error-message")
            if self.report.hint:
                yield Static(self.report.hint, id="error-hint")
            with Horizontal(classes="dialog-buttons"):
                yield Button("OK", variant="primary", id="ok")

    def on_mount(self) -> None:
        self.query_one("#ok", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None)


class ConfirmDialog(ModalScreen[bool]):
    """A question with a clearly named yes button; Escape is no."""

    BINDINGS = [Binding("escape", "no", "Cancel")]

    def __init__(self, title: str, message: str, yes: str = "Yes", *, dangerous: bool = False):
        super().__init__(classes="dialog")
        self.title_text, self.message, self.yes, self.dangerous = title, message, yes, dangerous

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.title_text, classes="dialog-title")
            yield Static(self.message, id="confirm-message")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes, variant="error" if self.dangerous else "primary", id="yes")
                yield Button("Cancel", id="no")

    def on_mount(self) -> None:
        self.query_one("#no" if self.dangerous else "#yes", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")

    def action_no(self) -> None:
        self.dismiss(False)


class ChoiceDialog(ModalScreen[str | None]):
    """Pick one of ``choices`` (value, label); Escape picks nothing."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, choices: list[tuple[str, str]], message: str = ""):
        super().__init__(classes="dialog")
        self.title_text, self.choices, self.message = title, choices, message

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box"):
            yield Label(self.title_text, classes="dialog-title")
            if self.message:
                yield Static(self.message)
            yield OptionList(*[Option(label, id=value) for value, label in self.choices], id="choices")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


class TextScreen(ModalScreen[None]):
    """A long text to read (a model's inspection), scrollable."""

    BINDINGS = [Binding("escape,enter", "dismiss", "Close")]

    def __init__(self, title: str, text: str):
        super().__init__(classes="dialog")
        self.title_text, self.text = title, text

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label(self.title_text, classes="dialog-title")
            with VerticalScroll(id="text-body"):
                yield Static(self.text, markup=False)
