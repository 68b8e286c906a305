"""The first-run setup wizard, end to end: hardware, model, download, layout, load, chat."""

from __future__ import annotations

from textual.widgets import ContentSwitcher, DataTable, Input

from hybridmoe.app.state import load_state
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.dialogs import ConfirmDialog
from hybridmoe.app.tui.screens.setup import SetupScreen
from hybridmoe.app.tui.widgets.chat_message import ChatMessage
from hybridmoe.app.tui.widgets.plan_editor import PlanEditor
from hybridmoe.app.tui.widgets.transfer import TransferPanel
from hybridmoe.backend import settings as settings_module
from hybridmoe.backend.plan import Plan
from hybridmoe.backend.units import GiB
from tests.tui.fakes import ANSWER, FakeServices, local_model
from tests.tui.helpers import text_of, until, until_screen


def _setup(app) -> SetupScreen:
    assert isinstance(app.screen, SetupScreen), app.screen
    return app.screen


async def test_wizard_from_hardware_to_a_chat_answer(services, tmp_path):
    services.local.append(local_model(tmp_path / "disk", "olmoe-1b-7b", name="my-olmoe"))
    app = HybridMoeApp(services)
    async with app.run_test(size=(120, 40)) as pilot:
        # 1 Hardware: shown in plain words, then Next
        await until(pilot, lambda: not app.screen.query_one("#hardware-next").disabled, what="hardware")
        setup = _setup(app)
        summary = text_of(setup.query_one("#setup-hardware"))
        assert "GPUs: 1 ×" in summary and "RTX PRO 6000" in summary
        await pilot.click("#hardware-next")

        # 2 Model: the catalogue ranked for this machine, with the planner's speed
        table = setup.query_one("#setup-choices", DataTable)
        await until(pilot, lambda: table.row_count >= 2, what="the ranked catalogue")
        assert setup.step == "model"
        keys = [row.key.value for row in table.ordered_rows]
        assert "catalogue:qwen3-30b-a3b" in keys and "catalogue:kimi-k2.6" not in keys  # Kimi does not fit
        speed = table.get_row("catalogue:qwen3-30b-a3b")[3]
        # The column says "tok/s, ≤max": the plan's expected figure, then its bound.
        assert all(part.replace(",", "").replace(".", "").isdigit() for part in speed.split(" ≤"))
        on_disk = table.get_row("local:0")  # models on disk are offered too, with the same estimate
        assert on_disk[0] == "my-olmoe" and on_disk[4] == "on disk"
        assert all(part.replace(",", "").replace(".", "").isdigit() for part in on_disk[3].split(" ≤"))
        assert app.focused is setup.query_one("#setup-typed", Input)  # what is typed goes to the box
        table.move_cursor(row=table.get_row_index("catalogue:qwen3-30b-a3b"))
        table.focus()
        await pilot.press("enter")
        confirm = await until_screen(pilot, app, ConfirmDialog)  # tens of gigabytes: asked first
        said = str(confirm.query_one("#confirm-message").render())
        assert "Qwen/Qwen3-30B-A3B" in said and "GiB" in said and "fits this machine" in said
        assert services.downloader.pulls == []
        await pilot.press("enter")  # Download

        # 3 Get it: the download with progress, then on to the layout
        await until(pilot, lambda: setup.step == "layout", what="the download")
        assert services.downloader.pulls[0][0] == "Qwen/Qwen3-30B-A3B"
        assert load_state(settings_module.data_dir()).setup.step == "layout"

        # 4 Layout: the plan picture; editing the context re-plans at once
        await until(pilot, lambda: setup.query_one(PlanEditor).plan is not None, what="the plan")
        editor = setup.query_one(PlanEditor)
        first = editor.plan
        assert first.fits and first.main_device == "cuda"
        context = editor.query_one("#plan-context", Input)
        context.value = "8192"
        await pilot.pause()
        assert editor.plan.workload.context == 8192
        assert editor.plan.kv_bytes_per_conversation < first.kv_bytes_per_conversation
        await pilot.press("ctrl+s")  # Save and load (the button is below the picture)

        # 5 Load, then the chat answers
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                    what="the model to load")
        chat = app.screen
        await pilot.press(*"Hi")
        await pilot.press("enter")
        await until(pilot, lambda: not chat.generating and chat.query(ChatMessage).last().role == "assistant"
                    and chat.query(ChatMessage).last().text, what="the answer")
        answer = chat.query(ChatMessage).last()
        await until(pilot, lambda: not chat.generating, what="the end of the answer")
        assert answer.text == "".join(ANSWER)

        # F6 again: the wizard from step 1, not its bare last page
        await pilot.press("f6")
        await until(pilot, lambda: app.screen is setup, what="the wizard")
        await pilot.pause()
        assert setup.step == "hardware" and setup.query_one(ContentSwitcher).current == "step-hardware"

    saved = settings_module.load()
    assert saved.default_model.endswith("config.json") and saved.context == 8192
    plan = Plan.load(services.plan_path(saved.default_model))
    assert plan.workload.context == 8192
    assert load_state(settings_module.data_dir()).setup.step == ""  # done: next start opens the chat
    assert services.backend.loads[0][1] == plan


async def test_an_interrupted_download_resumes_after_a_restart(tmp_path):
    services = FakeServices(tmp_path / "store")
    services.downloader.hold_at = 3 * services.downloader.chunk  # a download that stalls until cancelled
    app = HybridMoeApp(services)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, SetupScreen) and app.screen.catalogue is not None)
        setup = app.screen
        setup._go("model")
        typed = setup.query_one("#setup-typed", Input)
        typed.value = "Qwen/Qwen3-30B-A3B"
        typed.focus()
        await pilot.press("enter")
        await until_screen(pilot, app, ConfirmDialog)
        await pilot.press("enter")  # Download
        await until(pilot, lambda: setup.step == "get")
        panel = setup.query_one(TransferPanel)
        await until(pilot, lambda: "Downloading" in text_of(panel.query_one("#transfer-detail")), what="progress")
        await pilot.click("#transfer-cancel")
        await until(pilot, lambda: not panel.running, what="the cancel")
        assert "Stopped" in text_of(panel.query_one("#transfer-detail"))
        done_before = (services.downloader.root / "Qwen--Qwen3-30B-A3B" / "weights.partial").stat().st_size
        assert done_before == services.downloader.hold_at
        # Resume, and quit while it is still running: the app stops the download and exits
        await pilot.click("#transfer-start")
        await until(pilot, lambda: len(services.downloader.pulls) == 2 and panel.running, what="the resume")

    # A new app on the same state and store: step 3 again, with Resume
    services2 = FakeServices(tmp_path / "store")
    app2 = HybridMoeApp(services2)
    async with app2.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: isinstance(app2.screen, SetupScreen) and app2.screen.step == "get")
        panel = app2.screen.query_one(TransferPanel)
        resume = panel.query_one("#transfer-start")
        assert str(resume.label) == "Resume"
        await until(pilot, lambda: resume.region.height > 0, what="the Resume button on screen")
        await pilot.click(resume)
        await until(pilot, lambda: app2.screen.step == "layout", what="the resumed download")
    assert [p[2] for p in services.downloader.pulls] == [0, done_before]
    repo, quant, resumed_from = services2.downloader.pulls[0]
    assert repo == "Qwen/Qwen3-30B-A3B" and resumed_from == done_before


async def test_warnings_that_matter(tmp_path):
    from hybridmoe.backend.hardware.overrides import apply_overrides
    from hybridmoe.backend.hardware.presets import preset
    from tests.tui.fakes import this_machine

    hardware = this_machine(apply_overrides(preset("cpu-only"), ram=2 * GiB))
    services = FakeServices(tmp_path / "store", hardware=hardware)
    app = HybridMoeApp(services)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, SetupScreen) and app.screen.catalogue is not None)
        warnings = text_of(app.screen.query_one("#setup-warnings"))
        assert "No GPU" in warnings
        assert "smaller than any model in the catalogue" in warnings
