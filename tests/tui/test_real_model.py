"""The app as a user runs it, through the real services and the embedded engine, on a tiny
real checkpoint: nothing faked but the size of the model."""

from __future__ import annotations

from hybridmoe.app.history import History
from hybridmoe.app.services import Services
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.widgets.status_line import StatusLine
from hybridmoe.backend.settings import Settings, data_dir
from tests.tui.helpers import first_answer, text_of, until


async def test_chat_with_a_tiny_real_model(tiny_model):
    Settings(default_model=str(tiny_model), context=256, measure_bandwidth=False).save()
    app = HybridMoeApp(Services())
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                    timeout=90, what="the engine to load the model")
        chat = app.screen
        assert chat.plan.workload.context == 256 and chat.plan.fits
        answer = await first_answer(pilot, chat, "Hello!", timeout=60)
        assert answer.role == "assistant"
        stored = History(data_dir() / "history.sqlite3")
        messages = stored.messages(stored.conversations()[0].id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].content == answer.text and messages[1].finish_reason in ("stop", "length")
        assert messages[1].stats["backend"] == "engine" and messages[1].stats["generated_tokens"] >= 1
        status = text_of(chat.query_one(StatusLine))
        assert "first token" in status and "context" in status and "CPU only" in status


async def test_a_new_user_goes_from_the_wizard_to_an_answer(tiny_model):
    """No settings at all: the wizard opens; a model on disk, typed as a path, is planned,
    saved, loaded by the embedded engine, and answers."""
    from textual.widgets import Button, Input

    from hybridmoe.app.tui.screens.setup import SetupScreen
    from hybridmoe.app.tui.widgets.plan_editor import PlanEditor
    from hybridmoe.backend import settings as settings_module
    from hybridmoe.backend.plan import Plan

    services = Services()
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, SetupScreen), what="the wizard")
        setup = app.screen
        next_button = setup.query_one("#hardware-next", Button)
        # The real detection, bandwidth probe included (a new user's settings measure it).
        await until(pilot, lambda: not next_button.disabled, timeout=60, what="the hardware")
        # The choices follow (the catalogue ranked for this machine); their warnings may move the button.
        await until(pilot, lambda: setup.catalogue is not None, timeout=60, what="the choices")
        await pilot.pause()
        await pilot.click("#hardware-next")
        await until(pilot, lambda: setup.step == "model", timeout=30, what="step 2")
        typed = setup.query_one("#setup-typed", Input)
        typed.value = str(tiny_model)
        typed.focus()
        await pilot.press("enter")
        await until(pilot, lambda: setup.step == "layout" and setup.query(PlanEditor)
                    and setup.query_one(PlanEditor).plan is not None, timeout=30, what="the layout")
        editor = setup.query_one(PlanEditor)
        assert editor.plan.fits and editor.plan.main_device == "cpu"
        editor.query_one("#plan-context", Input).value = "512"
        await pilot.pause()
        assert editor.plan.workload.context == 512
        await pilot.press("ctrl+s")  # Save and load

        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                    timeout=120, what="the engine to load the model")
        chat = app.screen
        answer = await first_answer(pilot, chat, "Hello!", timeout=120)
        assert answer.role == "assistant"
        assert "context" in text_of(chat.query_one(StatusLine))
        stored = app.history.messages(app.history.conversations()[0].id)
        assert [m.role for m in stored] == ["user", "assistant"] and stored[1].content == answer.text
        assert stored[1].stats["backend"] == "engine" and stored[1].stats["generated_tokens"] >= 1

    saved = settings_module.load()
    assert saved.default_model == str(tiny_model) and saved.context == 512
    assert Plan.load(services.plan_path(tiny_model)).workload.context == 512
