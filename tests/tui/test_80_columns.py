"""Every screen and dialog at 80x24, the size the README promises (#48 item 10): a dialog's
buttons are on screen without scrolling, a table's columns all show, nothing is wider than
the terminal; and snapshots of the ones the main snapshots leave out."""

from __future__ import annotations

import pytest
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable

from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.chat_settings import ChatSettingsScreen
from hybridmoe.app.tui.screens.conversations import ConversationsScreen
from hybridmoe.app.tui.screens.dialogs import ConfirmDialog, ErrorDialog, TextScreen
from hybridmoe.app.tui.screens.models import ModelsScreen
from hybridmoe.app.tui.screens.plan import PlanScreen
from hybridmoe.app.tui.screens.server import ServerScreen
from hybridmoe.app.tui.screens.setup import SetupScreen
from hybridmoe.app.tui.widgets.plan_editor import PlanEditor
from hybridmoe.backend.errors import HybridMoeError
from tests.tui.helpers import until, until_screen

SIZE = (80, 24)


async def _chat(pilot):
    app = pilot.app
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                what="the chat")


async def to_chat_settings(pilot):
    await _chat(pilot)
    await pilot.press("ctrl+s")
    await until_screen(pilot, pilot.app, ChatSettingsScreen)


async def to_conversations(pilot):
    await _chat(pilot)
    await pilot.press("ctrl+o")
    await until_screen(pilot, pilot.app, ConversationsScreen)


async def to_server(pilot):
    await _chat(pilot)
    await pilot.press("f7")
    await until_screen(pilot, pilot.app, ServerScreen)


async def to_models(pilot):
    await _chat(pilot)
    await pilot.press("f3")
    await until(pilot, lambda: isinstance(pilot.app.screen, ModelsScreen) and pilot.app.screen.catalogue is not None)
    await pilot.pause()


async def to_plan(pilot):
    await _chat(pilot)
    await pilot.press("f4")
    await until(pilot, lambda: isinstance(pilot.app.screen, PlanScreen) and pilot.app.screen.query(PlanEditor)
                and pilot.app.screen.query_one(PlanEditor).plan is not None)
    await pilot.pause()


async def to_setup_model_step(pilot):
    await _chat(pilot)
    await pilot.press("f6")
    await until(pilot, lambda: isinstance(pilot.app.screen, SetupScreen) and pilot.app.screen.catalogue is not None)
    await pilot.click("#hardware-next")
    await until(pilot, lambda: pilot.app.screen.step == "model")
    await pilot.pause()


async def to_download_question(pilot):
    await to_setup_model_step(pilot)
    await pilot.press(*"qwen3-30b-a3b", "enter")
    await until_screen(pilot, pilot.app, ConfirmDialog)


async def to_error(pilot):
    await _chat(pilot)
    pilot.app.show_error(HybridMoeError("the prompt is 1,248 tokens, the context holds 256",
                                        "Your message is back in the input: shorten it, start a new conversation "
                                        "(Ctrl+N) or plan a longer context (F4, then save)."))
    await until_screen(pilot, pilot.app, ErrorDialog)


async def to_text(pilot):
    await _chat(pilot)
    pilot.app.push_screen(TextScreen("Qwen3 30B-A3B", "\n".join(f"line {i} " * 12 for i in range(60))))
    await until_screen(pilot, pilot.app, TextScreen)


async def to_palette(pilot):
    from textual.command import CommandPalette

    await _chat(pilot)
    await pilot.press("ctrl+p")
    await until_screen(pilot, pilot.app, CommandPalette)
    await pilot.pause(0.3)


async def to_benchmark(pilot):
    from hybridmoe.app.tui.screens.benchmark import BenchmarkScreen, open_benchmark

    await _chat(pilot)
    open_benchmark(pilot.app)
    await until_screen(pilot, pilot.app, BenchmarkScreen)


PLACES = {
    "chat settings": to_chat_settings, "conversations": to_conversations, "API server": to_server,
    "models": to_models, "plan": to_plan, "setup, model step": to_setup_model_step,
    "download question": to_download_question, "error": to_error, "long text": to_text,
    "command palette": to_palette, "benchmark": to_benchmark,
}


def _not_fitting(screen) -> list[str]:
    problems = []
    area = screen.region
    if isinstance(screen, ModalScreen):  # a dialog's way out must be on screen, not below a scroll
        for button in screen.query(Button):
            if button.display and not (button.region.height and area.contains_region(button.region)):
                problems.append(f"button {button.label} at {button.region}")
    for table in screen.query(DataTable):
        if table.display and table.row_count and table.virtual_size.width > table.scrollable_content_region.width:
            problems.append(f"table {table.id}: {table.virtual_size.width} columns wide in "
                            f"{table.scrollable_content_region.width}")
    return problems


@pytest.mark.parametrize("place", PLACES)
async def test_everything_fits_80_by_24(configured, place):
    app = HybridMoeApp(configured)
    async with app.run_test(size=SIZE) as pilot:
        await PLACES[place](pilot)
        await pilot.pause()
        assert _not_fitting(app.screen) == []


async def test_the_models_tables_fit_with_the_whole_catalogue(configured):
    """The full catalogue (55 entries, names up to 30 characters) has a scroll bar: its five
    columns still fit."""
    from hybridmoe.backend.hub import catalogue

    configured.catalogue = lambda: catalogue.load()
    app = HybridMoeApp(configured)
    async with app.run_test(size=SIZE) as pilot:
        await to_models(pilot)
        assert _not_fitting(app.screen) == []


# ---- snapshots of what tests/tui/test_snapshots.py leaves out ---------------------------------

pytest.importorskip("pytest_textual_snapshot")


@pytest.mark.parametrize("place", ["chat settings", "conversations", "API server", "setup, model step",
                                   "download question", "error", "command palette"])
def test_snapshot_at_80_by_24(snap_compare, configured, place):
    async def there(pilot):
        await PLACES[place](pilot)
        for widget in pilot.app.screen.query("Input, TextArea"):
            widget.cursor_blink = False  # a blinking cursor makes two screenshots differ
        await pilot.pause()

    assert snap_compare(HybridMoeApp(configured), terminal_size=SIZE, run_before=there)
