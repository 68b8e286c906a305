"""The app's tools around the chat, through the real services and the embedded engine on the
tiny real checkpoint: recording expert usage and re-planning from it, measuring the memory
bandwidth while an answer streams, and the benchmark."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import psutil

import hybridmoe.backend.hardware
from hybridmoe.app.services import Services
from hybridmoe.app.state import AppState, save_state
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.benchmark import BenchmarkScreen
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.hardware import HardwareScreen
from hybridmoe.app.tui.screens.plan import PlanScreen
from hybridmoe.app.tui.screens.replan import ReplanDialog
from hybridmoe.app.tui.widgets.chat_message import ChatMessage
from hybridmoe.app.tui.widgets.plan_editor import PlanEditor
from hybridmoe.app.tui.widgets.prompt import PromptInput
from hybridmoe.backend.plan import ExpertStats, Plan
from hybridmoe.backend.settings import Settings, data_dir
from tests.tui.helpers import text_of, until, until_screen

GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


def _configure(tiny_model, *, max_tokens: int | None, **settings) -> None:
    Settings(default_model=str(tiny_model), **{"context": 256, "measure_bandwidth": False, **settings}).save()
    sampling = {**GREEDY, **({"max_tokens": max_tokens} if max_tokens else {})}
    save_state(data_dir(), AppState(sampling=sampling))


async def _loaded(pilot, app) -> ChatScreen:
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                timeout=120, what="the engine to load the model")
    return app.screen


async def _ask(pilot, chat: ChatScreen, text: str, *, wait: bool = True) -> None:
    before = len(chat.query(ChatMessage))
    chat.query_one(PromptInput).text = text
    await pilot.press("enter")
    await until(pilot, lambda: len(chat.query(ChatMessage)) == before + 2, what="the answer to start")
    if wait:
        await until(pilot, lambda: not chat.generating, timeout=120, what="the answer")


async def test_usage_is_recorded_added_up_and_planned_from(tiny_model):
    _configure(tiny_model, max_tokens=8, record_stats=True)
    services = Services()
    usage = services.expert_stats_path(tiny_model)
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 40)) as pilot:
        chat = await _loaded(pilot, app)
        await _ask(pilot, chat, "Hello!")
        first = ExpertStats.load(usage)
        assert first.n_experts == 8 and first.tokens > 0 and first.activations > 0

        # Off: the answer is counted by the engine but not added to the file ...
        app.set_settings(replace(app.settings, record_stats=False))
        await _ask(pilot, chat, "And again?")
        assert ExpertStats.load(usage) == first
        before = services.expert_counts(chat.loaded_session)
        # ... and on again: only what came after is added, not the answer given while off.
        app.set_settings(replace(app.settings, record_stats=True))
        await _ask(pilot, chat, "Once more.")
        after = services.expert_counts(chat.loaded_session)
        second = ExpertStats.load(usage)
        assert second == first.merged(after.since(before))
        assert second.activations > first.activations

        # Re-plan from it: the frequency strategy with this file, compared, accepted, saved.
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None, what="the plan")
        await pilot.press("ctrl+r")
        dialog = await until_screen(pilot, app, ReplanDialog)
        assert f"{second.tokens:,} tokens" in text_of(dialog.query_one("#replan-recorded"))
        assert "CPU" in text_of(dialog.query_one("#replan-note"))  # no GPU here: it says what it changes
        await pilot.click("#replan-use")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen), what="the dialog to close")
        saved = Plan.load(services.plan_path(tiny_model))
        assert saved.workload.strategy == "frequency" and saved.workload.stats_file == str(usage)

        await pilot.press("f2")  # the chat loads the model again, with the new plan
        await until(pilot, lambda: chat.plan == saved and chat.session is not None, timeout=120,
                    what="the reload with the new plan")

    # Another run of the app: its counts are added to what the earlier ones recorded.
    app = HybridMoeApp(Services())
    async with app.run_test(size=(100, 40)) as pilot:
        chat = await _loaded(pilot, app)
        await _ask(pilot, chat, "Hello from a new session")
        counted = Services().expert_counts(chat.loaded_session)
    third = ExpertStats.load(usage)
    assert third == second.merged(counted)


async def test_measuring_the_bandwidth_waits_for_the_answer(tiny_model, monkeypatch):
    # Greedy decoding of the random tiny model runs to the context limit (paced below).
    _configure(tiny_model, max_tokens=None, context=1024, measure_bandwidth=True)
    probes: list[bool] = []  # for each probe: was the model generating meanwhile?
    generating = threading.Event()
    real_probe = hybridmoe.backend.hardware.measure_host_read_bandwidth

    def watched_probe(**kwargs):
        during = generating.is_set()
        result = real_probe(**kwargs)
        probes.append(during or generating.is_set())
        return result

    monkeypatch.setattr(hybridmoe.backend.hardware, "measure_host_read_bandwidth", watched_probe)
    app = HybridMoeApp(Services())
    async with app.run_test(size=(100, 40)) as pilot:
        chat = await _loaded(pilot, app)
        session_generate = chat.session.generate

        def watched_generate(*args, **kwargs):
            generating.set()
            try:
                for piece in session_generate(*args, **kwargs):
                    # Paced: the answer must outlast the steps below however fast the
                    # engine decodes (the native CPU decode step runs the tiny model at
                    # hundreds of tokens a second).
                    time.sleep(0.01)
                    yield piece
            finally:
                generating.clear()

        chat.session.generate = watched_generate
        await _ask(pilot, chat, "Tell me a long story", wait=False)
        await until(pilot, lambda: chat.answer is not None and chat.answer.text, what="streaming")

        # On the way past (the Plan screen needs the machine), the probe is skipped ...
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None, what="the plan")
        assert chat.generating, "the answer ended before the test could look: make it longer"
        await pilot.press("f5")
        hardware = await until_screen(pilot, app, HardwareScreen)
        assert "not measured: the model was busy (an answer)" in text_of(hardware.query_one("#hardware-summary"))
        # ... and asked for, it waits for the answer to end.
        await pilot.press("ctrl+d")
        await until(pilot, lambda: "when an answer has ended" in text_of(hardware.query_one("#hardware-summary")),
                    what="the measurement to wait")
        assert probes == [] and chat.generating
        await until(pilot, lambda: app.hardware.memory.bandwidth_measured_bytes_per_s, timeout=120,
                    what="the measurement after the answer")
        assert probes == [False]
        answer = app.history.messages(app.history.conversations()[0].id)[-1]
        assert answer.finish_reason == "length" and answer.stats["generated_tokens"] > 100


def _bench_processes() -> list[psutil.Process]:
    """This process's benchmark workers that are still running."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "hybridmoe.backend.bench.generate" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # it ended meanwhile
            pass
    return found


async def test_benchmark_from_the_hardware_screen(tiny_model):
    _configure(tiny_model, max_tokens=8)
    services = Services()
    services.bench_sizes = {"prompt_tokens": 16, "gen_tokens": 8, "repeats": 1, "rounds": 1}
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 40)) as pilot:
        chat = await _loaded(pilot, app)
        await pilot.press("f5")
        await until_screen(pilot, app, HardwareScreen)
        await pilot.press("b")
        bench = await until_screen(pilot, app, BenchmarkScreen)
        start = bench.query_one("#bench-start")
        await until(pilot, lambda: not start.disabled, what="the model to be looked at")
        assert "embedded engine" in text_of(bench.query_one("#bench-about"))
        await pilot.click("#bench-start")
        await until(pilot, lambda: bench.running, what="the start")
        assert chat.session is None  # unloaded: the benchmark loads the model in processes of its own
        await until(pilot, lambda: bench.summary is not None, timeout=180, what="the benchmark")
        engine = bench.summary["results"]["engine"]
        assert engine["decode_median"] > 0 and engine["prefill_median"] > 0, engine
        table = text_of(bench.query_one("#bench-table"))
        assert "decode tok/s" in table and "engine" in table

        # Run again and cancel: the worker process is killed, the dialog is usable again.
        await pilot.pause()  # the button is now "Run again": laid out anew before it is clicked
        await pilot.click("#bench-start")
        await until(pilot, lambda: bench.running, what="the second start")
        await until(pilot, lambda: _bench_processes(), timeout=30,
                    what=f"the benchmark process ({text_of(bench.query_one('#bench-status'))})")
        await pilot.press("escape")
        await until(pilot, lambda: not bench.running, timeout=30, what="the cancel")
        assert text_of(bench.query_one("#bench-status")) == "Stopped."
        assert not _bench_processes()
        await pilot.press("escape")  # closes it
        await until(pilot, lambda: isinstance(app.screen, HardwareScreen), what="the dialog to close")

        await pilot.press("f2")  # the chat loads its model again
        await until(pilot, lambda: chat.session is not None, timeout=120, what="the chat's model again")
