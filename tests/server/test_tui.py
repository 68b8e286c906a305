"""The TUI's API server dialog (F7): the chat's model served to OpenAI clients while the chat
goes on using it, each waiting its turn. The model boundary is the TUI tests' fake backend
(tests/tui/fakes.py); the server, the queue and the openai client are real."""

from __future__ import annotations

import asyncio

from textual.widgets import Button, Input, Static

from hybridmoe.app.server.shared_session import SharedSession
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.dialogs import ErrorDialog
from hybridmoe.app.tui.screens.server import ServerScreen
from hybridmoe.app.tui.widgets.chat_message import ChatMessage
from hybridmoe.app.tui.widgets.prompt import PromptInput
from tests.server.conftest import client_for
# The TUI tests' fixtures: an isolated home, fake services, a configured model.
from tests.tui.conftest import configured, home, services  # noqa: F401, F811
from tests.tui.fakes import ANSWER
from tests.tui.helpers import text_of, until, until_screen


def test_the_server_dialog_serves_the_chats_model_beside_the_chat(configured):  # noqa: F811
    async def scenario():
        app = HybridMoeApp(configured)
        async with app.run_test(size=(120, 36)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                        what="the model to load")
            chat = app.screen
            plain = chat.session
            await pilot.press("f7")
            dialog = await until_screen(pilot, app, ServerScreen)
            assert "Stopped" in text_of(dialog.query_one("#server-status", Static))

            # A public address without a key is refused, saying what to do.
            dialog.query_one("#server-host", Input).value = "0.0.0.0"
            dialog.query_one("#server-port", Input).value = "0"
            await pilot.click("#server-toggle")
            error = await until_screen(pilot, app, ErrorDialog)
            assert "Enter an API key" in text_of(error.query_one("#error-hint", Static))
            await pilot.press("escape")
            dialog.query_one("#server-host", Input).value = "127.0.0.1"
            await pilot.click("#server-toggle")
            await until(pilot, lambda: app.api_server.running, what="the server to start")
            assert isinstance(chat.session, SharedSession) and chat.session.session is plain
            url = app.api_server.url
            await until(pilot, lambda: url in text_of(dialog.query_one("#server-status", Static)), what="the address")
            assert str(dialog.query_one("#server-toggle", Button).label) == "Stop"

            # A request and a chat message at once: the chat's waits its turn. The request's
            # answer is slow (3 s) until the chat is seen waiting, then quick.
            plain.delay = 0.3
            messages = [{"role": "user", "content": "Hi from a script"}]
            request = asyncio.create_task(asyncio.to_thread(
                lambda: client_for(app.api_server.server).chat.completions.create(model="m", messages=messages)))
            await until(pilot, lambda: chat.session.counts().running == 1, what="the request to run")
            await pilot.press("escape")  # the dialog closes; the server goes on
            chat.query_one(PromptInput).text = "Hi from the chat"
            await pilot.press("enter")
            await until(pilot, lambda: chat.session.counts().waiting == 1, what="the chat to wait its turn")
            plain.delay = 0.005
            answer = await request
            assert answer.choices[0].message.content == "".join(ANSWER)
            await until(pilot, lambda: not chat.generating, what="the chat's answer")
            assert chat.query(ChatMessage).last().text == "".join(ANSWER)
            assert [call[-1].content for call in plain.calls] == ["Hi from a script", "Hi from the chat"]

            await pilot.press("f7")
            dialog = await until_screen(pilot, app, ServerScreen)
            await until(pilot, lambda: "2 answered" in text_of(dialog.query_one("#server-counts", Static)),
                        what="the counts")
            assert "/v1/chat/completions 200 stop" in text_of(dialog.query_one("#server-recent", Static))
            await pilot.click("#server-toggle")
            assert not app.api_server.running and chat.session is plain

            # Serving again, then the chat loads the model anew: the server stops with it.
            await pilot.click("#server-toggle")
            await until(pilot, lambda: app.api_server.running, what="the server to start again")
            await pilot.press("escape")
            await pilot.press("ctrl+l")
            await until(pilot, lambda: not app.api_server.running, timeout=10, what="the server to stop")
            await until(pilot, lambda: chat.session is not None and chat.session is not plain, what="the reload")
            assert plain.closed

    asyncio.run(scenario())
