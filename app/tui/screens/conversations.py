"""The stored conversations, most recent first: Enter reopens one, Delete removes it."""

from __future__ import annotations

from datetime import datetime

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Footer, Label, OptionList, Static
from textual.widgets.option_list import Option

from hybridmoe.app.history import Conversation, History, HistoryError
from hybridmoe.app.tui.screens.dialogs import ConfirmDialog


def _when(iso: str) -> str:
    try:
        return datetime.fromisoformat(iso).astimezone().strftime("%Y-%m-%d %H:%M")
    except ValueError:
        return iso


class ConversationsScreen(ModalScreen[int | None]):
    """Dismisses with the id of the conversation to open, or None."""

    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("delete,d", "delete", "Delete"),
    ]

    def __init__(self, history: History):
        super().__init__(classes="dialog")
        self.history = history

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog-box wide"):
            yield Label("Conversations", classes="dialog-title")
            yield OptionList(id="conversation-list")
            yield Static("No conversations yet.", id="no-conversations")
        yield Footer()

    def on_mount(self) -> None:
        self._fill()

    def _fill(self) -> None:
        try:
            conversations = self.history.conversations()
        except HistoryError as error:  # said; the list is empty (a damaged file was set aside)
            self.app.show_error(error)
            conversations = []
        options = self.query_one(OptionList)
        options.clear_options()
        options.add_options([Option(self._label(c), id=str(c.id)) for c in conversations])
        options.display = bool(conversations)
        self.query_one("#no-conversations").display = not conversations
        if conversations:
            options.highlighted = 0
            options.focus()

    @staticmethod
    def _label(c: Conversation) -> str:
        return f"{c.title}\n  {_when(c.updated_at)} · {c.message_count} messages · {c.model}"

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(int(event.option.id))

    def action_close(self) -> None:
        self.dismiss(None)

    def action_delete(self) -> None:
        options = self.query_one(OptionList)
        if options.highlighted is None:
            return
        option = options.get_option_at_index(options.highlighted)
        conversation_id = int(option.id)
        try:
            conversation = self.history.get(conversation_id)
        except HistoryError as error:
            self.app.show_error(error)
            self._fill()
            return
        title = conversation.title if conversation else "?"

        def confirmed(yes: bool | None) -> None:
            if yes:
                try:
                    self.history.delete(conversation_id)
                except HistoryError as error:
                    self.app.show_error(error)
                self._fill()

        self.app.push_screen(ConfirmDialog("Delete conversation", f"Delete “{title}” and its messages?",
                                           "Delete", dangerous=True), confirmed)
