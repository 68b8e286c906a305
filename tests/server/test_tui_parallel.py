"""The TUI with a model that serves two conversations at once (issue 17): the chat says so,
the API server dialog says so, a chat message runs beside an API request instead of after
it, and another conversation of the history is answered by the same loaded model. The model
boundary is the TUI tests' fake backend (tests/tui/fakes.py: as many at once as the plan
holds conversations); the server, the queue and the openai client are real."""

from __future__ import annotations

import asyncio

from textual.widgets import Static

from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.server import ServerScreen
from hybridmoe.app.tui.widgets.chat_message import ChatMessage
from hybridmoe.app.tui.widgets.prompt import PromptInput
from hybridmoe.app.tui.widgets.status_line import StatusLine
from hybridmoe.backend.settings import Settings
from tests.server.conftest import client_for
from tests.tui.conftest import home, services  # noqa: F401 - the TUI tests' isolated home and fake services
from tests.tui.fakes import ANSWER, local_model
from tests.tui.helpers import text_of, until, until_screen


def test_a_chat_message_runs_beside_an_api_request_on_a_model_for_two(services, tmp_path):  # noqa: F811
    model = local_model(tmp_path / "models")
    services.local.append(model)
    Settings(default_model=str(model.path), measure_bandwidth=False, users=2).save()

    async def scenario():
        app = HybridMoeApp(services)
        async with app.run_test(size=(120, 36)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                        what="the model to load")
            chat = app.screen
            plain = chat.session
            assert plain.max_parallel == 2 and chat.plan.workload.users == 2
            context = chat.plan.workload.context
            assert f"up to 2 conversations at once, {context:,} tokens each" in text_of(chat.query_one(StatusLine))

            await pilot.press("f7")
            dialog = await until_screen(pilot, app, ServerScreen)
            dialog.query_one("#server-port").value = "0"
            await pilot.click("#server-toggle")
            await until(pilot, lambda: app.api_server.running, what="the server to start")
            await until(pilot, lambda: "up to 2 requests at once" in text_of(dialog.query_one("#server-status", Static)),
                        what="the limit in the dialog")
            shared = chat.session
            assert shared.parallel == 2

            # A slow request, then a chat message: both run at once, neither waits.
            plain.delay = 0.3
            request = asyncio.create_task(asyncio.to_thread(
                lambda: client_for(app.api_server.server).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "Hi from a script"}])))
            await until(pilot, lambda: shared.counts().running == 1, what="the request to run")
            await pilot.press("escape")
            chat.query_one(PromptInput).text = "Hi from the chat"
            await pilot.press("enter")
            await until(pilot, lambda: shared.counts().running == 2, what="the chat to run beside the request")
            assert shared.counts().waiting == 0
            await pilot.press("f7")
            dialog = await until_screen(pilot, app, ServerScreen)
            await until(pilot, lambda: "2 of 2 answering" in text_of(dialog.query_one("#server-counts", Static)),
                        what="the counts")
            await pilot.press("escape")
            plain.delay = 0.005
            answer = await request
            assert answer.choices[0].message.content == "".join(ANSWER)
            await until(pilot, lambda: not chat.generating, what="the chat's answer")
            assert chat.query(ChatMessage).last().text == "".join(ANSWER)

            # Another conversation from the history: answered by the same model, no reload.
            first = chat.conversation.id
            await pilot.press("ctrl+n")
            chat.query_one(PromptInput).text = "A second conversation"
            await pilot.press("enter")
            await until(pilot, lambda: not chat.generating and chat.conversation is not None
                        and chat.conversation.id != first, what="the second conversation's answer")
            await chat.open_conversation(first)
            chat.query_one(PromptInput).text = "Back to the first"
            await pilot.press("enter")
            await until(pilot, lambda: not chat.generating and len(plain.calls) == 4, what="the follow-up's answer")
            assert [m.content for m in plain.calls[-1] if m.role == "user"] == ["Hi from the chat", "Back to the first"]
            assert len(services.backend.loads) == 1 and chat.session is shared
            app.api_server.stop()

    asyncio.run(scenario())
