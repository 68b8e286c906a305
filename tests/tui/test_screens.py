"""The Plan, Models and Hardware screens."""

from __future__ import annotations

import io

from textual.widgets import DataTable, Input, Select

from hybridmoe.app.state import load_state
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.screens.dialogs import ChoiceDialog, ConfirmDialog, TextScreen
from hybridmoe.app.tui.screens.hardware import HardwareScreen
from hybridmoe.app.tui.screens.models import ModelsScreen
from hybridmoe.app.tui.screens.plan import PlanScreen
from hybridmoe.app.tui.widgets.plan_editor import PlanEditor
from hybridmoe.app.tui.widgets.plan_view import tokens_per_s
from hybridmoe.backend import settings as settings_module
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.plan import Plan
from tests.tui.helpers import text_of, until, until_screen


async def _chat_loaded(pilot, app):
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None)


async def test_plan_editing_updates_the_numbers_and_saves(configured):
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        await _chat_loaded(pilot, app)
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None, what="the plan")
        screen = app.screen
        editor = screen.query_one(PlanEditor)
        one_user = editor.plan
        assert "Fits" in text_of(editor.query_one("#plan-verdict"))
        assert "tokens/s" in text_of(editor.query_one("#plan-speed"))
        assert text_of(editor.query_one("#plan-layers")).count("layer ") == len(one_user.moe_layers)

        editor.query_one("#plan-users", Input).value = "4"
        await pilot.pause()
        assert editor.plan.workload.users == 4
        assert editor.plan.kv_bytes_per_conversation == one_user.kv_bytes_per_conversation
        gpu = editor.plan.devices[0]
        assert gpu.bytes_by_class["kv_cache"] > one_user.devices[0].bytes_by_class["kv_cache"]
        assert "4 conversations together" in text_of(editor.query_one("#plan-speed"))

        editor.query_one("#plan-strategy", Select).value = "cpu-only"
        await pilot.pause()
        assert editor.plan.gpu_expert_count == 0
        assert "   0/128" in text_of(editor.query_one("#plan-layers"))

        context = editor.query_one("#plan-context", Input)
        context.value = "10000000"  # longer than the model's: refused, the last good plan stays
        await pilot.pause()
        assert "longer than" in text_of(editor.query_one("#plan-error"))
        assert editor.plan.workload.context != 10000000
        context.value = "16384"
        await pilot.pause()
        assert not editor.error and editor.plan.workload.context == 16384

        await pilot.press("ctrl+s")
        saved = Plan.load(configured.plan_path(app.model))
        assert saved == editor.plan
        assert settings_module.load().users == 4

        # sizing a machine to buy: the same model on a preset; saving exports it to a file
        editor.query_one("#plan-hardware", Select).value = "8x H200 NVL"
        await pilot.pause()
        assert editor.plan.hardware == "8x H200 NVL" and editor.plan.described_hardware
        assert "8x H200 NVL" in text_of(editor.query_one("#plan-verdict"))
        await pilot.press("ctrl+s")
        exported = list((settings_module.data_dir() / "plans" / "exported").glob("*.toml"))
        assert len(exported) == 1 and Plan.load(exported[0]).hardware == "8x H200 NVL"
        assert Plan.load(configured.plan_path(app.model)) == saved  # the chat's plan is unchanged

        await pilot.press("f2")  # the chat reloads the model with the saved plan
        await until(pilot, lambda: len(configured.backend.loads) == 2, what="the reload")
        assert configured.backend.loads[-1][1] == saved


async def test_models_lists_pulls_converts_uses_and_deletes(configured, tmp_path):
    ollama = LocalModel(name="qwen3:30b", path=tmp_path / "blob", kind="gguf", size_bytes=1, source="ollama",
                        files=(tmp_path / "blob",))
    configured.local.append(ollama)
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        await _chat_loaded(pilot, app)
        await pilot.press("f3")
        await until(pilot, lambda: isinstance(app.screen, ModelsScreen) and app.screen.catalogue is not None)
        screen = app.screen
        local = screen.query_one("#local-models", DataTable)
        catalogue = screen.query_one("#catalogue-models", DataTable)
        assert local.row_count == 2 and catalogue.row_count == 3
        rows = {catalogue.get_row(key)[0]: catalogue.get_row(key) for key in ("qwen3-30b-a3b", "kimi-k2.6")}
        # The column says "tok/s, ≤max": the plan's expected figure, then its bound.
        expected, bound = rows["Qwen3 30B-A3B"][3].replace(",", "").split(" ≤")
        ranked = screen.ranked["qwen3-30b-a3b"].plan
        assert (expected, bound) == (tokens_per_s(ranked.decode_tokens_per_s_expected).replace(",", ""),
                                     tokens_per_s(ranked.decode_tokens_per_s_upper_bound).replace(",", ""))
        assert rows["Kimi K2.6"][1] == "does not fit"
        assert "default" in local.get_row_at(0)[5]

        # inspect and plan a catalogue model before downloading it
        catalogue.focus()
        catalogue.move_cursor(row=catalogue.get_row_index("kimi-k2.6"))
        await pilot.press("i")
        inspection = await until_screen(pilot, app, TextScreen)
        assert "Tensor inventory" in text_of(inspection.query_one("#text-body Static"))
        await pilot.press("escape")
        await pilot.press("v")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None, what="Kimi's plan")
        assert app.screen.query_one(PlanEditor).plan.model == "moonshotai/Kimi-K2.6"
        assert not app.screen.query_one(PlanEditor).plan.fits
        await pilot.press("f3")
        await until(pilot, lambda: app.screen is screen)

        # pull: choose a variant, watch it download, it is remembered as ours
        catalogue.focus()
        catalogue.move_cursor(row=catalogue.get_row_index("qwen3-30b-a3b"))
        await pilot.press("p")
        await until_screen(pilot, app, ChoiceDialog)
        assert "recommended" in str(app.screen.query_one("#choices").get_option_at_index(0).prompt)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ModelsScreen) and local.row_count == 3, what="the pull")
        pulled = configured.local[-1]
        assert str(pulled.path) in load_state(settings_module.data_dir()).obtained

        # convert: a checkpoint to a GGUF quantization
        local.focus()
        local.move_cursor(row=2)
        await pilot.press("c")
        await until_screen(pilot, app, ChoiceDialog)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ModelsScreen) and local.row_count == 3
                    and len(load_state(settings_module.data_dir()).obtained) == 2, what="the conversion")

        # delete: refused for another program's store, confirmed (and worded) for ours and others
        local.move_cursor(row=1)
        assert screen._selected_local().source == "ollama"
        await pilot.press("d")
        assert isinstance(app.screen, ModelsScreen) and not configured.deleted
        local.move_cursor(row=2)
        await pilot.press("d")
        await until_screen(pilot, app, ConfirmDialog)
        assert "downloaded by hybridmoe" in text_of(app.screen.query_one("#confirm-message"))
        await pilot.press("escape")  # no
        local.move_cursor(row=0)
        await pilot.press("d")
        await until_screen(pilot, app, ConfirmDialog)
        assert "did not download" in text_of(app.screen.query_one("#confirm-message"))
        await pilot.click("#yes")
        await until(pilot, lambda: configured.deleted, what="the delete")
        assert app.model == "" and settings_module.load().default_model == ""  # it was the default

        # use: Enter on a local model makes it the default and opens the chat
        await until(pilot, lambda: local.row_count == 2)
        local.focus()
        local.move_cursor(row=1)
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ChatScreen))
        assert settings_module.load().default_model == str(pulled.path)


async def test_hardware_shows_plain_words_and_live_memory(configured):
    app = HybridMoeApp(configured)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("f5")
        await until(pilot, lambda: isinstance(app.screen, HardwareScreen)
                    and "RTX PRO 6000" in text_of(app.screen.query_one("#hardware-summary")))
        screen = app.screen
        assert "CPU" in text_of(screen.query_one("#hardware-details"))
        first = text_of(screen.query_one("#hardware-memory"))
        assert "RAM" in first and "resident" in first
        widget = screen.query_one("#hardware-memory")
        before = widget.content
        await until(pilot, lambda: widget.content is not before, timeout=5, what="a memory update")



def test_hardware_warnings_in_plain_words():
    from dataclasses import replace

    from hybridmoe.app.tui.hardware_words import summary_lines, warnings
    from hybridmoe.backend.hardware.presets import preset
    from tests.tui.fakes import this_machine, workstation

    assert warnings(workstation()) == []
    old_cpu = this_machine(preset("cpu-only"))
    old_cpu = replace(old_cpu, cpu=replace(old_cpu.cpu, arch="x86_64", features=("sse4_2",)),
                      memory=replace(old_cpu.memory, total_bytes=512 * 2**30, cgroup_limit_bytes=64 * 2**30))
    said = " ".join(warnings(old_cpu, smallest_model_bytes=100 * 2**30))
    assert "No GPU" in said and "no AVX2" in said and "Container memory limit" in said
    assert "smaller than any model" in said
    assert any(line.startswith("GPUs: none") for line in summary_lines(old_cpu))


# ---- the footer at 80 columns ---------------------------------------------------------------


def _footer_problems(app, width: int) -> list[str]:
    """Keys the footer cuts off, or hides under the command palette's key (docked right)."""
    from textual.widgets import Footer
    from textual.widgets._footer import FooterKey

    keys = list(app.screen.query_one(Footer).query(FooterKey))
    palette = [k for k in keys if k.action == "app.command_palette" or k.has_class("-command-palette")]
    limit = min([k.region.x for k in palette] + [width])
    return [f"{k.key_display} {k.description} at {k.region.x}..{k.region.right}" for k in keys
            if k not in palette and (k.region.right > limit or not k.region.width)]


async def test_every_main_screen_shows_its_keys_at_80_columns(configured):
    from hybridmoe.app.tui.widgets.prompt import PromptInput

    configured.backend.delay = 0.2  # an answer long enough to look at the footer while it streams
    app = HybridMoeApp(configured)
    async with app.run_test(size=(80, 24)) as pilot:
        await _chat_loaded(pilot, app)
        chat = app.screen
        chat.query_one(PromptInput).text = "Hi"
        await pilot.press("enter")
        await until(pilot, lambda: chat.generating and chat.answer is not None and chat.answer.text, what="streaming")
        await pilot.pause()
        seen = {"chat, answering": (_footer_problems(app, 80), chat.query_one("Footer").query("FooterKey"))}
        assert "Stop" in [k.description for k in seen["chat, answering"][1]]
        await until(pilot, lambda: not chat.generating, timeout=10, what="the answer")
        await pilot.pause()
        keys = [k.description for k in chat.query_one("Footer").query("FooterKey")]
        assert {"Retry", "New", "History", "Settings", "Copy"} <= set(keys), keys
        problems = {"chat, answered": _footer_problems(app, 80), "chat, answering": seen["chat, answering"][0]}
        for key, screen_class in (("f3", ModelsScreen), ("f4", PlanScreen), ("f5", HardwareScreen)):
            await pilot.press(key)
            await until(pilot, lambda wanted=screen_class: isinstance(app.screen, wanted))
            if screen_class is PlanScreen:  # its keys must stay when a workload field has the focus
                await until(pilot, lambda: app.screen.query(PlanEditor) and app.screen.query_one(PlanEditor).plan)
                app.screen.query_one("#plan-context", Input).focus()
            await pilot.pause()
            problems[screen_class.__name__] = _footer_problems(app, 80)
            shown = {k.description for k in app.screen.query_one("Footer").query("FooterKey")}
            essential = {ModelsScreen: {"Pull", "Convert", "Delete", "Plan", "Inspect"},
                         PlanScreen: {"Save", "Export", "Measure", "Re-plan"},
                         HardwareScreen: {"Measure", "Benchmark"}}[screen_class]
            assert essential <= shown, (screen_class.__name__, shown)
        assert not any(problems.values()), problems


# ---- re-planning from the recorded usage (fake model boundary; tests/tui/test_usage.py runs
# the real engine) --------------------------------------------------------------------------------


def _plain(renderable) -> str:
    from rich.console import Console

    console = Console(width=100, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _small_gpu():
    """One 24 GiB GPU: some of a 30B MoE's experts fit on it, not all."""
    from hybridmoe.backend.hardware.overrides import apply_overrides
    from hybridmoe.backend.hardware.presets import preset
    from hybridmoe.backend.units import GiB
    from tests.tui.fakes import this_machine

    return this_machine(apply_overrides(preset("4x RTX PRO 6000"), gpus=1, gpu_memory=24 * GiB, ram=128 * GiB))


def _skewed_usage(model_path: str, path):
    """Counts that favour the eight highest-numbered experts of every layer."""
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import ExpertStats

    spec = inspect_model(model_path).spec
    n = spec.n_routed_experts
    stats = ExpertStats(model=spec.name, n_experts=n, tokens=5000,
                        layers={layer: [1000 if e >= n - 8 else 1 for e in range(n)] for layer in spec.moe_layers})
    stats.save(path)
    return stats


async def test_replan_from_usage_compares_and_saves(configured):
    from hybridmoe.app.tui.screens.replan import ReplanDialog, gpu_share

    configured.hardware = _small_gpu()
    app = HybridMoeApp(configured)
    async with app.run_test(size=(100, 40)) as pilot:
        await _chat_loaded(pilot, app)
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None, what="the plan")
        plan_screen = app.screen
        current = plan_screen.query_one(PlanEditor).plan
        stats = _skewed_usage(app.model, configured.expert_stats_path(app.model))

        await pilot.press("ctrl+r")
        dialog = await until_screen(pilot, app, ReplanDialog)
        proposed = dialog.proposed
        assert proposed.workload.strategy == "frequency"
        assert proposed.workload.stats_file == str(configured.expert_stats_path(app.model))
        # The experts used most go to the GPU: it serves far more of the recorded choices.
        assert gpu_share(current, stats) < 0.1 and gpu_share(proposed, stats) > 0.9
        shown = _plain(dialog.query_one("#replan-table").content)
        assert "Your expert choices on the GPU" in shown
        assert f"{gpu_share(current, stats):.0%}" in shown and f"{gpu_share(proposed, stats):.0%}" in shown
        assert "5,000 tokens" in text_of(dialog.query_one("#replan-recorded"))
        await pilot.click("#replan-use")
        await until(pilot, lambda: app.screen is plan_screen, what="the dialog to close")

        saved = Plan.load(configured.plan_path(app.model))
        assert saved.workload.strategy == "frequency" and saved.gpu_experts == proposed.gpu_experts
        assert app.plan == saved
        editor = plan_screen.query_one(PlanEditor)
        assert editor.plan == saved and editor.query_one("#plan-strategy", Select).value == "frequency"

        await pilot.press("f2")  # the chat loads the model with the new plan
        await until(pilot, lambda: len(configured.backend.loads) == 2, what="the reload")
        assert configured.backend.loads[-1][1] == saved


async def test_replan_without_recorded_usage_says_how_to_record_it(configured):
    from hybridmoe.app.tui.screens.dialogs import ErrorDialog

    app = HybridMoeApp(configured)
    async with app.run_test(size=(100, 40)) as pilot:
        await _chat_loaded(pilot, app)
        await pilot.press("f4")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen) and app.screen.query(PlanEditor)
                    and app.screen.query_one(PlanEditor).plan is not None, what="the plan")
        await pilot.press("ctrl+r")
        dialog = await until_screen(pilot, app, ErrorDialog)
        assert "no expert usage" in text_of(dialog.query_one("#error-message"))
        assert "Record which experts" in text_of(dialog.query_one("#error-hint"))
    assert not configured.plan_path(app.model).exists()


async def test_the_benchmark_is_offered_from_every_screen(configured):
    from hybridmoe.app.tui.screens.benchmark import BenchmarkScreen

    app = HybridMoeApp(configured)
    async with app.run_test(size=(80, 24)) as pilot:
        await _chat_loaded(pilot, app)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"benchmark the model")
        await pilot.pause(0.3)
        await pilot.press("enter")
        bench = await until_screen(pilot, app, BenchmarkScreen)
        await until(pilot, lambda: not bench.query_one("#bench-start").disabled, what="the model to be looked at")
        about = text_of(bench.query_one("#bench-about"))
        assert "the embedded engine" in about and "unloaded" in about and "512-token prompt" in about
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, ChatScreen), what="the dialog to close")
        assert app.screen.session is not None  # not started: the chat kept its model
