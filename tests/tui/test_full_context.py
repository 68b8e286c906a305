"""A chat whose message does not fit, and a conversation that outgrows the context, on the tiny
real model with a 256-token context: the chat is never stuck. A message too long goes back
into the input (it is not kept as sent) with the keys that help; a full conversation leaves
out its oldest turns (a setting, on by default; the system prompt stays) and says so."""

from __future__ import annotations

from hybridmoe.app.history import History
from hybridmoe.app.services import Services
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen, without_oldest_turn
from hybridmoe.app.tui.screens.dialogs import ErrorDialog
from hybridmoe.app.tui.widgets.chat_message import ChatMessage
from hybridmoe.app.tui.widgets.prompt import PromptInput
from hybridmoe.backend.session import Message
from hybridmoe.backend.settings import Settings, data_dir
from tests.tui.helpers import until, until_screen

LONG = " ".join(f"word{i}" for i in range(400))  # some 1,200 tokens of the tiny vocabulary
SHORT_ANSWERS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                 "max_tokens": 8}


def paragraph(n: int) -> str:
    return " ".join(f"topic{n} item{i}" for i in range(14))  # some 80 tokens: three fill 256


async def _loaded_chat(app, pilot, drop_oldest_turns: bool = True) -> ChatScreen:
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                timeout=90, what="the engine to load the model")
    app.update_state(sampling=SHORT_ANSWERS, drop_oldest_turns=drop_oldest_turns)
    return app.screen


async def _send(pilot, chat: ChatScreen, text: str) -> None:
    chat.query_one(PromptInput).text = text
    await pilot.press("enter")
    await until(pilot, lambda: not chat.generating, timeout=60, what="the answer")
    await pilot.pause()


def _dialog_text(dialog) -> str:
    return " ".join(str(w.render()) for w in dialog.query("Static, Label"))


async def test_a_message_that_does_not_fit_goes_back_into_the_input(tiny_model):
    Settings(default_model=str(tiny_model), context=256, measure_bandwidth=False).save()
    app = HybridMoeApp(Services())
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await _loaded_chat(app, pilot)
        await _send(pilot, chat, LONG)
        dialog = await until_screen(pilot, app, ErrorDialog)
        said = _dialog_text(dialog)
        assert "the context holds 256" in said and "back in the input" in said
        assert "Ctrl+N" in said and "F4" in said
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is chat, what="the chat again")
        assert list(chat.query(ChatMessage)) == []  # not kept as sent
        assert chat.query_one(PromptInput).text == LONG  # to shorten, or to keep
        stored = History(data_dir() / "history.sqlite3")
        assert all(stored.messages(c.id) == [] for c in stored.conversations())

        await _send(pilot, chat, "hi")  # and the chat goes on
        assert [m.role for m in chat.query(ChatMessage)] == ["user", "assistant"]
        assert chat.query(ChatMessage).first().text == "hi" and chat.query(ChatMessage).last().finish_reason != "error"


async def test_a_full_conversation_leaves_out_its_oldest_turns(tiny_model):
    Settings(default_model=str(tiny_model), context=256, measure_bandwidth=False).save()
    app = HybridMoeApp(Services())
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await _loaded_chat(app, pilot)
        chat.system_prompt = "Be brief."
        for n in range(5):
            await _send(pilot, chat, paragraph(n))
            assert not isinstance(app.screen, ErrorDialog), _dialog_text(app.screen)
        roles = [m.role for m in chat.query(ChatMessage)]
        assert roles == ["user", "assistant"] * 5  # every message answered, all still on screen
        assert all(m.finish_reason in ("stop", "length") for m in chat.query(ChatMessage) if m.role == "assistant")
        notices = [n.message for n in app._notifications]
        assert any("oldest" in n and "left out" in n for n in notices), notices


async def test_without_leaving_turns_out_a_full_conversation_says_which_key_helps(tiny_model):
    Settings(default_model=str(tiny_model), context=256, measure_bandwidth=False).save()
    app = HybridMoeApp(Services())
    async with app.run_test(size=(100, 30)) as pilot:
        chat = await _loaded_chat(app, pilot, drop_oldest_turns=False)
        for n in range(5):
            await _send(pilot, chat, paragraph(n))
            if isinstance(app.screen, ErrorDialog):
                break
        dialog = await until_screen(pilot, app, ErrorDialog)
        assert "Ctrl+S" in _dialog_text(dialog)
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is chat, what="the chat again")
        assert chat.query_one(PromptInput).text == paragraph(n)
        assert chat.query(ChatMessage).last().role == "assistant"  # the last message answered stays


def test_leaving_out_the_oldest_turn_keeps_the_system_prompt_and_starts_at_a_user_turn():
    s, u1, a1, u2, a2, u3 = (Message("system", "s"), Message("user", "1"), Message("assistant", "a1"),
                             Message("user", "2"), Message("assistant", "a2"), Message("user", "3"))
    assert without_oldest_turn([s, u1, a1, u2, a2, u3]) == [s, u2, a2, u3]
    assert without_oldest_turn([u1, a1, u3]) == [u3]
    assert without_oldest_turn([s, u3]) is None and without_oldest_turn([u3]) is None
