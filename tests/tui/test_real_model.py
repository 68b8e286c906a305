"""The app as a user runs it, through the real services and the embedded engine, on a tiny
real checkpoint: nothing faked but the size of the model."""

from __future__ import annotations

from app.history import History
from app.services import Services
from app.tui.app import HybridMoeApp
from app.tui.screens.chat import ChatScreen
from app.tui.widgets.chat_message import ChatMessage
from app.tui.widgets.prompt import PromptInput
from app.tui.widgets.status_line import StatusLine
from backend.settings import Settings, data_dir
from tests.tui.helpers import text_of, until


async def test_chat_with_a_tiny_real_model(tiny_model):
    Settings(default_model=str(tiny_model), context=256, measure_bandwidth=False).save()
    app = HybridMoeApp(Services())
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                    timeout=90, what="the engine to load the model")
        chat = app.screen
        assert chat.plan.workload.context == 256 and chat.plan.fits
        prompt = chat.query_one(PromptInput)
        prompt.text = "Hello!"
        await pilot.press("enter")
        await until(pilot, lambda: len(chat.query(ChatMessage)) == 2 and not chat.generating, timeout=60,
                    what="the answer")
        answer = chat.query(ChatMessage).last()
        assert answer.role == "assistant"
        stored = History(data_dir() / "history.sqlite3")
        messages = stored.messages(stored.conversations()[0].id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].content == answer.text and messages[1].finish_reason in ("stop", "length")
        assert messages[1].stats["backend"] == "engine" and messages[1].stats["generated_tokens"] >= 1
        status = text_of(chat.query_one(StatusLine))
        assert "first token" in status and "context" in status and "CPU only" in status
