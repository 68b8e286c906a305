"""Failures of backend work end in a dialog that says what to do; the app keeps running."""

from __future__ import annotations

from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.dialogs import ErrorDialog
from hybridmoe.app.tui.screens.setup import SetupScreen
from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.settings import Settings, state_dir
from tests.tui.helpers import text_of, until, until_screen


async def test_a_backend_error_is_a_dialog_with_the_hint(services):
    services.detect_error = HybridMoeError("cannot read /sys/devices", "Run it outside the sandbox.")
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        await until_screen(pilot, app, ErrorDialog)
        dialog = app.screen
        assert text_of(dialog.query_one("#error-message")) == "cannot read /sys/devices"
        assert text_of(dialog.query_one("#error-hint")) == "Run it outside the sandbox."
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, SetupScreen))
        assert app.is_running
        # and the work can be tried again once the cause is gone
        services.detect_error = None
        app.screen._detect(False, app.settings)
        await until(pilot, lambda: not app.screen.query_one("#hardware-next").disabled)


async def test_a_bug_is_reported_briefly_and_logged(services):
    services.detect_error = RuntimeError("index out of range somewhere")
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        await until_screen(pilot, app, ErrorDialog)
        assert "RuntimeError: index out of range somewhere" in text_of(app.screen.query_one("#error-message"))
        assert "errors.log" in text_of(app.screen.query_one("#error-hint"))
    log = (state_dir() / "errors.log").read_text()
    assert "Traceback" in log and "index out of range somewhere" in log


async def test_a_model_that_does_not_fit_says_so_when_loading(configured):
    from hybridmoe.backend.hardware.overrides import apply_overrides
    from hybridmoe.backend.hardware.presets import preset
    from tests.tui.fakes import this_machine
    from hybridmoe.backend.units import GiB

    configured.hardware = this_machine(apply_overrides(preset("cpu-only"), ram=4 * GiB))  # Qwen3-30B needs ~60 GB
    app = HybridMoeApp(configured)
    async with app.run_test(size=(100, 30)) as pilot:
        await until_screen(pilot, app, ErrorDialog)
        assert "does not fit this machine" in text_of(app.screen.query_one("#error-message"))
        assert "Plan screen" in text_of(app.screen.query_one("#error-hint"))
        await pilot.press("escape")
        chat = app.screen
        assert isinstance(chat, ChatScreen) and chat.session is None and chat.loading_target is None


async def test_a_broken_settings_file_is_reported_and_defaults_are_used(services):
    from hybridmoe.backend.settings import settings_path

    settings_path().parent.mkdir(parents=True, exist_ok=True)
    settings_path().write_text("context = 'lots'\n")
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        await until_screen(pilot, app, ErrorDialog)
        message = text_of(app.screen.query_one("#error-message"))
        assert f"{settings_path()}: context must be a number of tokens" in message
        assert "using the default 32768" in message
        assert app.settings == Settings()



async def test_a_failed_detection_or_listing_is_not_left_saying_it_is_under_way(services):
    from hybridmoe.app.tui.screens.hardware import HardwareScreen
    from hybridmoe.app.tui.screens.models import ModelsScreen

    services.detect_error = HybridMoeError("cannot read /sys/devices", "Run it outside the sandbox.")
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        await until_screen(pilot, app, ErrorDialog)  # the setup's detection
        await pilot.press("enter")
        for key, screen_class, placeholder_id, said in (
            ("f5", HardwareScreen, "#hardware-summary", "could not be detected (see the message); Ctrl+D tries again"),
            ("f3", ModelsScreen, "#models-detail", "could not be listed (see the message); r looks again"),
        ):
            await until(pilot, lambda: not isinstance(app.screen, ErrorDialog))
            await pilot.press(key)
            await until_screen(pilot, app, ErrorDialog)  # the screen's own attempt, which needs the hardware
            await pilot.press("enter")
            screen = await until_screen(pilot, app, screen_class)
            assert said in text_of(screen.query_one(placeholder_id))
