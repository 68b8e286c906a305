"""One message of the conversation: who said it, and the text as Markdown.

An answer being generated is streamed through ``Markdown.get_stream()`` (which batches
appends when tokens arrive faster than the widget can lay them out); when it ends, the
whole text is rendered once more from the pieces kept here, so the final view is exactly
the generated text even if the stream coalesced or reflowed something on the way.
"""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widget import Widget
from textual.widgets import Label, Markdown
from textual.widgets.markdown import MarkdownStream

_FENCE_OPEN = re.compile(r"^(`{3,}|~{3,})")


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of ``markdown``, in order; a fence left open (an answer
    stopped mid-block) counts up to the end."""
    blocks: list[str] = []
    current: list[str] | None = None
    fence = ""
    for line in markdown.splitlines():
        stripped = line.strip()
        if current is None:
            opened = _FENCE_OPEN.match(stripped)
            if opened:
                fence, current = opened.group(1), []
        elif stripped.startswith(fence) and not stripped.strip(fence[0]):
            blocks.append("\n".join(current))
            current = None
        else:
            current.append(line)
    if current:
        blocks.append("\n".join(current))
    return blocks


class ChatMessage(Widget, can_focus=True):
    """Focus it (Tab or click) to copy it (c) or its last code block (b)."""

    BINDINGS = [
        Binding("c", "copy_text", "Copy message"),
        Binding("b", "copy_code", "Copy code block"),
    ]

    DEFAULT_CSS = """
    ChatMessage { height: auto; }
    ChatMessage Markdown { margin: 0; }
    """

    def __init__(self, role: str, text: str = "", *, author: str = "", note: str = "", message_id: int | None = None,
                 finish_reason: str | None = None, stats: dict | None = None):
        super().__init__(classes=f"message {role}")
        self.role = role
        self.author = author or ("You" if role == "user" else "Assistant")
        self.note = note
        self.message_id = message_id  # row in the history, once stored
        # What the history keeps beside the text of an answer (stored again after a damaged
        # history was replaced by a new one).
        self.finish_reason = finish_reason
        self.stats = stats
        self.pieces: list[str] = [text] if text else []
        self._stream: MarkdownStream | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def compose(self) -> ComposeResult:
        yield Label(self._header(), classes="message-author")
        yield Markdown(self.text)

    def _header(self) -> str:
        return f"{self.author}  ({self.note})" if self.note else self.author

    def set_note(self, note: str) -> None:
        self.note = note
        self.query_one(".message-author", Label).update(self._header())

    # ---- streaming -----------------------------------------------------------------------------

    def begin_stream(self) -> None:
        self._stream = Markdown.get_stream(self.query_one(Markdown))

    async def append(self, piece: str) -> None:
        self.pieces.append(piece)
        if self._stream is not None:
            await self._stream.write(piece)

    async def end_stream(self, note: str = "") -> None:
        """Stop streaming and render the whole text once."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        await self.query_one(Markdown).update(self.text)
        self.set_note(note)

    # ---- copying -----------------------------------------------------------------------------

    def action_copy_text(self) -> None:
        self.app.copy_text(self.text, "message")  # type: ignore[attr-defined]

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.text)
        if not blocks:
            self.notify("This message has no code block.", severity="warning")
            return
        self.app.copy_text(blocks[-1], "code block")  # type: ignore[attr-defined]
