"""Step 2 of the wizard as a new user meets it (#48 item 9): what is typed goes to the box, a
download starts only once confirmed (with its size and whether it fits), a catalogue name
means the variant the list shows as fitting, and a failed download stops looking busy."""

from __future__ import annotations

from textual.widgets import Button, Input, ProgressBar

from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.dialogs import ConfirmDialog, ErrorDialog
from hybridmoe.app.tui.screens.setup import SetupScreen
from hybridmoe.app.tui.widgets.transfer import TransferPanel
from hybridmoe.backend.hardware.overrides import apply_overrides
from hybridmoe.backend.hardware.presets import preset
from hybridmoe.backend.units import GiB
from tests.tui.fakes import FakeServices
from tests.tui.helpers import until, until_screen


def a_32_gib_pc():
    """No GPU, 32 GiB: Qwen3-30B-A3B fits as Q4_K_M (17 GiB), not as its 57 GiB checkpoint."""
    return apply_overrides(preset("cpu-only"), ram=32 * GiB, gpus=0)


async def _model_step(app, pilot) -> SetupScreen:
    await until(pilot, lambda: isinstance(app.screen, SetupScreen) and app.screen.catalogue is not None,
                what="the choices")
    await pilot.click("#hardware-next")
    setup = app.screen
    await until(pilot, lambda: setup.step == "model", what="step 2")
    await pilot.pause()
    return setup


async def test_typing_goes_to_the_box_also_after_back(tmp_path):
    app = HybridMoeApp(FakeServices(tmp_path / "store"))
    async with app.run_test(size=(80, 24)) as pilot:
        setup = await _model_step(app, pilot)
        typed = setup.query_one("#setup-typed", Input)
        await pilot.press(*"abc")
        assert typed.value == "abc"
        await pilot.press("ctrl+b")  # Back
        await until(pilot, lambda: setup.step == "hardware")
        await pilot.click("#hardware-next")
        await until(pilot, lambda: setup.step == "model")
        await pilot.pause()
        assert app.focused is typed


async def test_a_catalogue_name_means_the_variant_that_fits(tmp_path):
    services = FakeServices(tmp_path / "store", hardware=a_32_gib_pc())
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        setup = await _model_step(app, pilot)
        await pilot.press(*"qwen3-30b-a3b", "enter")
        confirm = await until_screen(pilot, app, ConfirmDialog)
        said = str(confirm.query_one("#confirm-message").render())
        assert "Q4_K_M" in said and "fits this machine" in said, said
        assert services.downloader.pulls == []  # nothing before the yes
        await pilot.press("enter")  # Download
        await until(pilot, lambda: services.downloader.pulls, what="the download")
        repo, quant, _ = services.downloader.pulls[0]
        assert quant == "Q4_K_M" and repo.endswith("GGUF"), (repo, quant)


async def test_a_model_that_fits_nowhere_is_asked_about_with_cancel_first(tmp_path):
    services = FakeServices(tmp_path / "store", hardware=a_32_gib_pc())
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        await _model_step(app, pilot)
        await pilot.press(*"kimi-k2.6", "enter")
        confirm = await until_screen(pilot, app, ConfirmDialog)
        assert "No variant of this model fits this machine" in str(confirm.query_one("#confirm-message").render())
        await pilot.press("enter")  # the focused button is Cancel
        await until(pilot, lambda: not isinstance(app.screen, ConfirmDialog))
        assert services.downloader.pulls == []


async def test_a_failed_download_stops_looking_busy(tmp_path):
    services = FakeServices(tmp_path / "store")
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        setup = await _model_step(app, pilot)
        await pilot.press(*"org/not-on-the-hub", "enter")  # the fake Hub fails it
        await until_screen(pilot, app, ConfirmDialog)
        await pilot.press("enter")
        await until_screen(pilot, app, ErrorDialog)
        await pilot.press("escape")
        panel = setup.query_one(TransferPanel)
        await until(pilot, lambda: not panel.running, what="the failure")
        assert not panel.query_one("#transfer-cancel", Button).display
        bar = panel.query_one("#transfer-bar", ProgressBar)
        assert bar.total is not None or not bar.display  # a bar without a size pulses: hidden
        assert str(panel.query_one("#transfer-start", Button).label) == "Retry"
