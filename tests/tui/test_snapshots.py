"""The layout of the main screens, as SVG snapshots (pytest-textual-snapshot).

`pytest tests/tui/test_snapshots.py --snapshot-update` accepts new ones after a deliberate
change; look at them first (they open in a browser). Everything on these screens is made
deterministic by the fakes: the hardware, the scripted answer and its statistics.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_textual_snapshot")

from hybridmoe.app.tui.app import HybridMoeApp  # noqa: E402
from hybridmoe.app.tui.screens.chat import ChatScreen  # noqa: E402
from hybridmoe.app.tui.screens.models import ModelsScreen  # noqa: E402
from hybridmoe.app.tui.screens.plan import PlanScreen  # noqa: E402
from hybridmoe.app.tui.screens.setup import SetupScreen  # noqa: E402
from hybridmoe.app.tui.widgets.plan_editor import PlanEditor  # noqa: E402
from hybridmoe.app.tui.widgets.prompt import PromptInput  # noqa: E402
from tests.tui.helpers import first_answer, until  # noqa: E402


def test_setup_hardware_step(snap_compare, services):
    async def ready(pilot):
        app = pilot.app
        await until(pilot, lambda: isinstance(app.screen, SetupScreen) and app.screen.catalogue is not None)
        await pilot.pause()

    assert snap_compare(HybridMoeApp(services), terminal_size=(80, 24), run_before=ready)


def test_chat_with_an_answer(snap_compare, configured):
    async def answered(pilot):
        app = pilot.app
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None)
        chat = app.screen
        prompt = chat.query_one(PromptInput)
        prompt.cursor_blink = False  # a blinking cursor makes two screenshots differ
        await first_answer(pilot, chat, "Show me some code")
        await pilot.pause()

    assert snap_compare(HybridMoeApp(configured), terminal_size=(80, 24), run_before=answered)


def test_plan_screen(snap_compare, configured):
    async def planned(pilot):
        app = pilot.app
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None)
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None)
        await pilot.pause()

    assert snap_compare(HybridMoeApp(configured), terminal_size=(120, 40), run_before=planned)


def test_models_screen(snap_compare, configured):
    async def listed(pilot):
        app = pilot.app
        await until(pilot, lambda: isinstance(app.screen, ChatScreen))
        await pilot.press("f3")
        await until(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.catalogue is not None)
        await pilot.pause()

    assert snap_compare(HybridMoeApp(configured), terminal_size=(80, 24), run_before=listed)


def test_plan_screen_at_80_columns(snap_compare, configured):
    async def planned(pilot):
        app = pilot.app
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None)
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None)
        await pilot.pause()

    assert snap_compare(HybridMoeApp(configured), terminal_size=(80, 24), run_before=planned)


def test_hardware_screen(snap_compare, configured, monkeypatch):
    from rich.text import Text

    from hybridmoe.app.tui.screens import hardware

    # The live memory figures are this machine's and change every second: fixed ones here.
    monkeypatch.setattr(hardware, "memory_text", lambda: Text("RAM   (live figures)"))

    async def shown(pilot):
        app = pilot.app
        await until(pilot, lambda: isinstance(app.screen, ChatScreen))
        await pilot.press("f5")
        await until(pilot, lambda: isinstance(app.screen, hardware.HardwareScreen)
                    and "GPUs" in str(app.screen.query_one("#hardware-summary").content))
        await pilot.pause()

    assert snap_compare(HybridMoeApp(configured), terminal_size=(80, 24), run_before=shown)


def test_replan_from_usage_dialog(snap_compare, configured):
    from hybridmoe.app.tui.screens.replan import ReplanDialog
    from tests.tui.test_screens import _skewed_usage, _small_gpu

    configured.hardware = _small_gpu()

    async def compared(pilot):
        app = pilot.app
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None)
        _skewed_usage(app.model, configured.expert_stats_path(app.model))
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None)
        await pilot.press("ctrl+r")
        await until(pilot, lambda: isinstance(app.screen, ReplanDialog))
        await pilot.pause()

    assert snap_compare(HybridMoeApp(configured), terminal_size=(80, 24), run_before=compared)
