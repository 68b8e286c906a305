"""One loaded model for every screen, through the App's model service: the chat, the API
server dialog and the benchmark see the same one; the benchmark unloads it through the
service (not while the chat answers) and the chat loads it again when shown."""

from __future__ import annotations

from textual.widgets import Static

from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.benchmark import BenchmarkScreen, open_benchmark
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.server import ServerScreen
from hybridmoe.app.tui.widgets.prompt import PromptInput
from hybridmoe.app.tui.widgets.status_line import StatusLine
from tests.tui.fakes import FakeBackend, FakeServices
from tests.tui.helpers import text_of, until, until_screen

# An answer that lasts (100 s) until the test stops it: on a loaded machine the steps between
# its start and the benchmark's click took longer than a 4 s answer.
LONG = [f"word{i} " for i in range(2000)]


class MeasuredServices(FakeServices):
    """The benchmark's processes faked too: it records that it ran and what was loaded then."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.benchmarked: list[bool] = []  # per run: was a model still loaded in this app?
        self.models = None

    def benchmark(self, model_path, on_progress, cancel):
        self.benchmarked.append(self.models.loaded is not None)
        return {"results": {}}

    def bench_table(self, summary):
        return "decode tok/s: measured"


async def test_the_screens_share_the_loaded_model_and_the_benchmark_unloads_it(configured):
    services = MeasuredServices(configured.root, local=configured.local,
                                backend=FakeBackend(script=LONG, delay=0.05))
    app = HybridMoeApp(services)
    services.models = app.models
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                    what="the model to load")
        chat = app.screen
        first = services.backend.sessions[0]
        assert chat.session is app.models.session is first and chat.loaded_session is first

        # The server dialog sees the model the chat loaded.
        await pilot.press("f7")
        dialog = await until_screen(pilot, app, ServerScreen)
        assert "once a model is loaded" not in text_of(dialog.query_one("#server-status", Static))
        await pilot.press("escape")

        # While the chat answers, the benchmark does not take the model away.
        chat.query_one(PromptInput).text = "Count"
        await pilot.press("enter")
        await until(pilot, lambda: chat.generating and first.calls, what="the answer to start")
        open_benchmark(app)
        bench = await until_screen(pilot, app, BenchmarkScreen)
        await until(pilot, lambda: not bench.query_one("#bench-start").disabled, what="the model to be looked at")
        await pilot.click("#bench-start")
        await pilot.pause()
        assert not bench.running and services.benchmarked == [] and app.models.loaded is not None
        assert any("Not started: the chat is answering" in n.message for n in app._notifications)
        chat.cancel.cancel()
        await until(pilot, lambda: not chat.generating, what="the answer to stop")

        # Now it does: through the service, before the benchmark runs; the chat is told.
        await pilot.click("#bench-start")
        await until(pilot, lambda: bench.summary is not None, what="the benchmark")
        assert services.benchmarked == [False] and first.closed and app.models.session is None
        assert chat.session is None
        assert "unloaded for the benchmark" in text_of(chat.query_one(StatusLine))
        await pilot.press("escape")  # closes the dialog: the chat, shown again, loads the model again
        await until(pilot, lambda: chat.session is not None, what="the model again")
        assert len(services.backend.sessions) == 2 and chat.session is app.models.session
        assert chat.session is services.backend.sessions[1]
