"""Damaged files of the user's (the conversation history, the settings) never crash the app
or lose what was typed: the damage is said, a damaged history is set aside (never deleted)
and a new one started, and every screen goes on working on defaults."""

from __future__ import annotations

import sqlite3
import struct

import pytest

from hybridmoe.app.history import History, HistoryError
from hybridmoe.app.services import Services
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.dialogs import ErrorDialog
from hybridmoe.app.tui.screens.hardware import HardwareScreen
from hybridmoe.app.tui.screens.models import ModelsScreen
from hybridmoe.app.tui.widgets.chat_message import ChatMessage
from hybridmoe.app.tui.widgets.prompt import PromptInput
from hybridmoe.backend import settings as settings_module
from hybridmoe.backend.settings import Settings, settings_path
from tests.tui.fakes import ANSWER, FakeServices
from tests.tui.helpers import text_of, until, until_screen

PAGE = 4096  # SQLite's default page size, which the history uses
# The page overwritten: with the conversations below, listing them still works and the next
# write meets the damage (what a user saw: the app starts, the chats are listed, sending fails).
DAMAGED_PAGE = 2


def history_path():
    return settings_module.data_dir() / "history.sqlite3"


def a_history_with_conversations(path) -> None:
    history = History(path)
    for n in range(4):
        conversation = history.create("/models/m", title=f"chat {n}")
        for i in range(12):
            history.add(conversation.id, "user" if i % 2 == 0 else "assistant", f"message {i} " * 40)
    history.close()


def damage(path, page: int = DAMAGED_PAGE, *, announce: bool = False) -> bytes:
    """Overwrite one page with garbage; ``announce``: bump the file change counter too, as a
    write by another process does, so a connection already open reads the page again."""
    with open(path, "r+b") as f:
        f.seek(page * PAGE)
        f.write(b"\xa5" * PAGE)
        if announce:
            f.seek(24)
            counter = struct.unpack(">I", f.read(4))[0]
            f.seek(24)
            f.write(struct.pack(">I", counter + 1))
    return path.read_bytes()


def stored(path) -> list[list[tuple[str, str]]]:
    """Every conversation in the history file: its messages as (role, content)."""
    history = History(path)
    try:
        return [[(m.role, m.content) for m in history.messages(c.id)] for c in reversed(history.conversations())]
    finally:
        history.close()


async def ready_chat(pilot, app) -> ChatScreen:
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                what="the model to load")
    return app.screen


async def send(pilot, chat: ChatScreen, text: str) -> None:
    before = len(chat.query(ChatMessage))
    prompt = chat.query_one(PromptInput)
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")
    await until(pilot, lambda: len(chat.query(ChatMessage)) == before + 2 and not chat.generating,
                what="the answer")


def test_the_chosen_page_reproduces_the_reported_damage(tmp_path):
    """The fixture itself: SQLite lists the conversations of the damaged file, and the next
    write fails, as the report says."""
    path = tmp_path / "history.sqlite3"
    a_history_with_conversations(path)
    damage(path)
    db = sqlite3.connect(path)
    assert len(db.execute("SELECT * FROM conversations").fetchall()) == 4
    with pytest.raises(sqlite3.DatabaseError, match="malformed"), db:
        db.execute("INSERT INTO messages (conversation_id, role, content, created_at) VALUES (1, 'user', 'hi', 'now')")
        db.execute("UPDATE conversations SET updated_at = 'now' WHERE id = 1")
    db.close()


async def test_a_damaged_history_is_set_aside_and_the_message_is_sent_and_kept(configured):
    a_history_with_conversations(history_path())
    damaged_bytes = damage(history_path())
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        dialog = await until_screen(pilot, app, ErrorDialog)
        [aside] = history_path().parent.glob("history.sqlite3.damaged-*")
        message = text_of(dialog.query_one("#error-message"))
        assert str(history_path()) in message and str(aside) in message and "new, empty history" in message
        assert "Nothing was deleted" in text_of(dialog.query_one("#error-hint"))
        await pilot.press("enter")
        chat = await ready_chat(pilot, app)
        await send(pilot, chat, "is my message kept?")
        assert app.is_running and not isinstance(app.screen, ErrorDialog)
        assert [m.text for m in chat.query(ChatMessage)] == ["is my message kept?", "".join(ANSWER)]
    assert aside.read_bytes() == damaged_bytes  # set aside as it was, not repaired, not deleted
    assert stored(history_path()) == [[("user", "is my message kept?"), ("assistant", "".join(ANSWER))]]


async def test_a_history_damaged_during_the_session_keeps_the_conversation(configured):
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = await ready_chat(pilot, app)
        for n in range(3):
            await send(pilot, chat, f"question {n} " * 300)  # a few pages of them
        damage(history_path(), 1, announce=True)
        await send(pilot, chat, "and this one?")
        dialog = await until_screen(pilot, app, ErrorDialog)
        [aside] = history_path().parent.glob("history.sqlite3.damaged-*")
        assert str(aside) in text_of(dialog.query_one("#error-message"))
        assert "your last message included, is in the new history" in text_of(dialog.query_one("#error-hint"))
        await pilot.press("enter")
        on_screen = [(m.role, m.text) for m in chat.query(ChatMessage)]
        assert len(on_screen) == 8 and on_screen[-2] == ("user", "and this one?")
        await send(pilot, chat, "still there?")  # the new history takes the rest, no second dialog
        assert not isinstance(app.screen, ErrorDialog)
        on_screen = [(m.role, m.text) for m in chat.query(ChatMessage)]
    assert stored(history_path()) == [on_screen]


def test_a_file_that_is_no_database_is_set_aside_never_over_an_earlier_one(tmp_path):
    path = tmp_path / "history.sqlite3"
    for attempt in range(2):  # the same second, most likely: the names must still differ
        path.write_bytes(b"not a database at all" * 400)
        history = History(path)
        assert isinstance(history.damage, HistoryError) and history.damage.replaced
        assert "file is not a database" in history.damage.what
        assert history.damage.set_aside.read_bytes() == b"not a database at all" * 400
        assert history.conversations() == []
        history.close()
    assert len(list(tmp_path.glob("history.sqlite3.damaged-*"))) == 2


class DetectsThisMachine(FakeServices):
    """The real detection of this machine and the real model search (both read the
    settings), without the ~1 s bandwidth probe."""

    def detect_hardware(self, measure_bandwidth: bool, *, wait: bool = False, on_wait=None):
        return Services.detect_hardware(self, False, wait=wait, on_wait=on_wait)

    def list_local_models(self):
        return Services.list_local_models(self)


@pytest.mark.parametrize("text, needle", [
    ("context = [\n", "is not valid TOML"),
    ('context = -5\nbackend = "gpu-magic"\n', "context must be a number of tokens from 1 to"),
])
async def test_a_broken_settings_file_is_said_once_and_every_screen_goes_on(text, needle, tmp_path):
    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text(text)
    app = HybridMoeApp(DetectsThisMachine(tmp_path / "store"))
    async with app.run_test(size=(120, 40)) as pilot:
        dialog = await until_screen(pilot, app, ErrorDialog)
        message = text_of(dialog.query_one("#error-message"))
        assert str(settings_path()) in message and needle in message and "using the default" in message
        assert app.settings == Settings()
        await pilot.press("enter")
        await pilot.press("f5")
        hardware = await until_screen(pilot, app, HardwareScreen)
        await until(pilot, lambda: "Detecting" not in text_of(hardware.query_one("#hardware-summary")),
                    what="the hardware")
        await pilot.press("f3")
        models = await until_screen(pilot, app, ModelsScreen)
        await until(pilot, lambda: "model(s) on this machine" in text_of(models.query_one("#models-detail")),
                    what="the models")
        assert not isinstance(app.screen, ErrorDialog)  # said once
