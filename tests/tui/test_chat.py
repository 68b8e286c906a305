"""The chat against the fake backend: streaming, stop, the prompt's keys, regenerate,
history, copying, settings, the command palette."""

from __future__ import annotations

import sys
import types

import pytest

from hybridmoe.app.history import History
from hybridmoe.app.state import load_state
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.chat_settings import ChatSettingsScreen
from hybridmoe.app.tui.screens.conversations import ConversationsScreen
from hybridmoe.app.tui.widgets.chat_message import ChatMessage
from hybridmoe.app.tui.widgets.prompt import PromptInput
from hybridmoe.app.tui.widgets.status_line import StatusLine
from hybridmoe.backend import settings as settings_module
from textual.widgets import Checkbox, Input, Markdown, TextArea
from tests.tui.fakes import ANSWER, FakeBackend, local_model
from tests.tui.helpers import text_of, until, until_screen

LONG = [f"word{i} " for i in range(400)]


async def _ready_chat(pilot, app) -> ChatScreen:
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                what="the model to load")
    return app.screen


async def _ask(pilot, chat: ChatScreen, text: str) -> ChatMessage:
    before = len(chat.query(ChatMessage))
    prompt = chat.query_one(PromptInput)
    prompt.focus()
    prompt.text = text
    await pilot.press("enter")
    await until(pilot, lambda: len(chat.query(ChatMessage)) == before + 2, timeout=5, what="the answer to start")
    return chat.query(ChatMessage).last()


async def _answered(pilot, chat: ChatScreen) -> ChatMessage:
    await until(pilot, lambda: not chat.generating, what="the answer")
    return chat.query(ChatMessage).last()


def _history() -> History:
    return History(settings_module.data_dir() / "history.sqlite3")


async def test_answer_streams_in_full_with_stats_and_can_be_regenerated_and_copied(configured, monkeypatch):
    copied = []
    monkeypatch.setitem(sys.modules, "pyperclip", types.SimpleNamespace(copy=copied.append))
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = await _ready_chat(pilot, app)
        assert chat.query_one("#load-panel").display is False

        # Enter sends; Shift+Enter and Ctrl+J start a new line; an empty prompt sends nothing
        prompt = chat.query_one(PromptInput)
        prompt.focus()
        await pilot.press(*"one", "shift+enter", *"two", "ctrl+j", *"three")
        assert prompt.text == "one\ntwo\nthree" and not chat.query(ChatMessage)
        await pilot.press("enter")
        await until(pilot, lambda: len(chat.query(ChatMessage)) == 2, timeout=5)
        answer = await _answered(pilot, chat)
        assert chat.query(ChatMessage).first().text == "one\ntwo\nthree" and prompt.text == ""
        await pilot.press("enter")
        assert len(chat.query(ChatMessage)) == 2

        # the whole answer, streamed, then rendered once in full; the statistics below
        assert answer.role == "assistant" and answer.text == "".join(ANSWER)
        assert answer.query_one(Markdown).source == "".join(ANSWER)
        status = text_of(chat.query_one(StatusLine))
        assert "42.0 tok/s" in status and "62% of experts on GPU" in status and "context" in status
        turns = configured.backend.sessions[0].calls[0]
        assert [(t.role, t.content) for t in turns] == [("user", "one\ntwo\nthree")]

        # copy the answer, its code block, a focused message
        await pilot.press("ctrl+t")
        assert app.clipboard == "".join(ANSWER) and copied[-1] == app.clipboard
        await pilot.press("ctrl+b")
        assert app.clipboard == "print('hi')"
        chat.query(ChatMessage).first().focus()
        await pilot.press("c")
        assert app.clipboard == "one\ntwo\nthree"

        # regenerate: the last answer goes, a new one comes from the same prompt
        await pilot.press("ctrl+r")
        await until(pilot, lambda: len(configured.backend.sessions[0].calls) == 2, timeout=5)
        await _answered(pilot, chat)
        assert chat.query(ChatMessage).last() is not answer
        assert [m.role for m in chat.query(ChatMessage)] == ["user", "assistant"]
        assert [t.content for t in configured.backend.sessions[0].calls[1]] == ["one\ntwo\nthree"]
    history = _history()
    assert [m.role for m in history.messages(history.conversations()[0].id)] == ["user", "assistant"]


async def test_escape_stops_and_keeps_the_partial_answer(configured, tmp_path):
    configured.backend = FakeBackend(script=LONG, delay=0.02)
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = await _ready_chat(pilot, app)
        answer = await _ask(pilot, chat, "Count")
        await until(pilot, lambda: len(answer.pieces) >= 3, what="a few pieces")
        await pilot.press("escape")
        await _answered(pilot, chat)
        assert 3 <= len(answer.pieces) < len(LONG)
        assert "".join(LONG).startswith(answer.text) and answer.text
        assert answer.query_one(Markdown).source == answer.text
        assert "stopped" in str(answer.query_one(".message-author").content)

        # choosing another model while an answer streams: the answer stops, then it loads
        other = local_model(tmp_path / "other", "olmoe-1b-7b")
        second = await _ask(pilot, chat, "Again")
        await until(pilot, lambda: len(second.pieces) >= 1)
        app.open_chat(str(other.path))
        await until(pilot, lambda: chat.session is configured.backend.sessions[-1]
                    and len(configured.backend.sessions) == 2, what="the other model")
        assert configured.backend.loads[-1][0] == other.path and configured.backend.sessions[0].closed
        assert second.text and len(second.pieces) < len(LONG)
    stored = _history().messages(_history().conversations()[0].id)
    assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[1].content == answer.text and stored[1].finish_reason == "cancelled"
    assert stored[3].finish_reason == "cancelled"


async def test_history_is_kept_and_reopened(configured):
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = await _ready_chat(pilot, app)
        await _ask(pilot, chat, "First question")
        await _answered(pilot, chat)
        await pilot.press("ctrl+n")
        await until(pilot, lambda: not chat.query(ChatMessage))
        await _ask(pilot, chat, "Second question")
        await _answered(pilot, chat)

    app = HybridMoeApp(configured)  # a restart: same data directory
    async with app.run_test(size=(120, 40)) as pilot:
        chat = await _ready_chat(pilot, app)
        assert not chat.query(ChatMessage)
        await pilot.press("ctrl+o")
        await until_screen(pilot, app, ConversationsScreen)
        listing = app.screen.query_one("#conversation-list")
        assert listing.option_count == 2
        assert "Second question" in str(listing.get_option_at_index(0).prompt)  # most recent first
        await pilot.press("down", "enter")
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and len(chat.query(ChatMessage)) == 2)
        texts = [m.text for m in chat.query(ChatMessage)]
        assert texts == ["First question", "".join(ANSWER)]
        await _ask(pilot, chat, "Follow-up")  # continues that conversation, with its context
        await _answered(pilot, chat)
        last_call = configured.backend.sessions[-1].calls[-1]
        assert [t.content for t in last_call] == ["First question", "".join(ANSWER), "Follow-up"]
    history = _history()
    assert len(history.messages(history.conversations()[0].id)) == 4


def test_conversations_used_within_one_second_list_the_last_used_first(tmp_path):
    history = History(tmp_path / "history.sqlite3")
    first = history.create("model")
    second = history.create("model")
    history.add(first.id, "user", "again")  # well within the second `second` was made in
    assert [c.id for c in history.conversations()] == [first.id, second.id]
    history.update(second.id, title="renamed")
    assert [c.id for c in history.conversations()] == [second.id, first.id]


async def test_system_prompt_and_sampling_settings(configured):
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = await _ready_chat(pilot, app)
        await pilot.press("ctrl+s")
        await until_screen(pilot, app, ChatSettingsScreen)
        dialog = app.screen
        dialog.query_one("#system-prompt", TextArea).text = "Be brief."
        dialog.query_one("#sampling-top_p", Input).value = "2"
        await pilot.click("#save")  # the button ...
        assert isinstance(app.screen, ChatSettingsScreen)  # refused, with the reason
        assert "top_p" in text_of(dialog.query_one("#settings-error"))
        dialog.query_one("#sampling-top_p", Input).value = "0.9"
        dialog.query_one("#sampling-temperature", Input).value = "0"
        # Recording the expert usage: off by default, and it says that it keeps no text
        record = dialog.query_one("#record-usage", Checkbox)
        assert record.value is False
        assert "No prompt, answer or other text is kept" in text_of(dialog.query_one("#record-usage-help"))
        record.value = True
        await pilot.press("ctrl+s")  # ... or the key
        await until(pilot, lambda: isinstance(app.screen, ChatScreen), what="the dialog to close")
        assert app.settings.record_stats
        await _ask(pilot, chat, "Hi")
        await _answered(pilot, chat)
        turns = configured.backend.sessions[0].calls[0]
        assert [(t.role, t.content) for t in turns] == [("system", "Be brief."), ("user", "Hi")]
    state = load_state(settings_module.data_dir())
    assert state.system_prompt == "Be brief." and state.sampling["temperature"] == 0 and state.sampling["top_p"] == 0.9
    assert settings_module.load().record_stats  # a preference: in settings.toml


async def test_every_action_is_in_the_command_palette(configured):
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = await _ready_chat(pilot, app)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"conversations reopen")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await until_screen(pilot, app, ConversationsScreen)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is chat)
        from hybridmoe.app.tui.commands import ActionsProvider

        names = [name for name, _, _ in ActionsProvider(chat)._commands()]
        disabled = {"stop", "regenerate"}  # nothing to stop or regenerate yet: left out, they would do nothing
        for binding in [*ChatScreen.BINDINGS, *HybridMoeApp.BINDINGS]:
            assert (binding.tooltip in names) != (binding.action in disabled), (binding, names)
        assert not any(name.startswith("Cursor") for name in names)  # the prompt's own keys are not commands


async def test_loading_shows_progress_and_can_be_cancelled(configured):
    configured.backend = FakeBackend(hold_load=True)
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.loading_target is not None)
        chat = app.screen
        bar = chat.query_one("#load-bar")
        await until(pilot, lambda: bar.progress == 1 and bar.total == 4, what="the first layer's progress")
        assert chat.query_one("#load-panel").display
        await pilot.press("escape")
        await until(pilot, lambda: chat.loading_target is None, what="the cancel")
        assert chat.session is None
        assert "Ctrl+L" in text_of(chat.query_one(StatusLine))
        configured.backend.hold_load = False
        await pilot.press("ctrl+l")
        await _ready_chat(pilot, app)


@pytest.mark.parametrize("markdown,expected", [
    ("no code", []),
    ("```\na\n```\ntext\n~~~py\nb\n~~~", ["a", "b"]),
    ("```python\nunfinished", ["unfinished"]),
])
def test_code_blocks(markdown, expected):
    from hybridmoe.app.tui.widgets.chat_message import code_blocks

    assert code_blocks(markdown) == expected
