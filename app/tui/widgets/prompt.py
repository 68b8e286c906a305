"""The prompt: a TextArea where Enter sends and Shift+Enter or Ctrl+J starts a new line.

Many terminals send the same byte for Enter and Shift+Enter; Ctrl+J (a line feed) works in
all of them, so both are offered. Pasted text keeps its newlines (paste is not a key press).
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    DEFAULT_CSS = """
    PromptInput { height: auto; max-height: 10; min-height: 3; }
    """

    class Submitted(Message):
        def __init__(self, prompt: "PromptInput", text: str):
            super().__init__()
            self.prompt, self.text = prompt, text

    def __init__(self, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(self, text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
