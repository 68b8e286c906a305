"""Waiting in Pilot tests for work that happens on threads, and reading what is shown."""

from __future__ import annotations

import asyncio
import time

from rich.text import Text


async def until(pilot, condition, timeout: float = 15.0, what: str = "") -> None:
    """Let the app run until ``condition()`` holds (worker threads post their results)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except Exception:  # a widget not mounted yet, say
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        # A plain sleep: the app runs meanwhile; pilot.pause would also force a screen update
        # at every poll, which only costs time here.
        await asyncio.sleep(0.02)


async def until_screen(pilot, app, screen_class, timeout: float = 15.0):
    """Wait until a screen of ``screen_class`` is on top and composed; return it."""
    await until(pilot, lambda: isinstance(app.screen, screen_class) and app.screen.is_mounted
                and app.screen.children, timeout, what=screen_class.__name__)
    await pilot.pause()
    return app.screen


def text_of(static) -> str:
    """The plain text a Static shows."""
    content = static.content
    if isinstance(content, Text):
        return content.plain
    return str(content)


async def first_answer(pilot, chat, text: str, timeout: float = 15.0):
    """Send `text` as the chat's first message and wait for the whole answer; return it."""
    from hybridmoe.app.tui.widgets.chat_message import ChatMessage
    from hybridmoe.app.tui.widgets.prompt import PromptInput

    chat.query_one(PromptInput).text = text
    await pilot.press("enter")
    await until(pilot, lambda: len(chat.query(ChatMessage)) == 2 and not chat.generating, timeout,
                what="the answer")
    return chat.query(ChatMessage).last()
