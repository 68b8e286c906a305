"""What the screens say about a plan, and the palette's order (#48 item 12): no GPU named where
there is none, no false precision and no "reads 0.00 GB" for a model whose experts are all on
the GPU, a glyph of its own for each kind of cell, and the app's actions first in Ctrl+P."""

from __future__ import annotations

import pytest
from textual.command import CommandList

from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.widgets.plan_view import layer_picture, memory_picture, speed_text, tokens_per_s, verdict_text
from hybridmoe.backend.hardware.presets import preset
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from tests.models.conftest import write_qwen3moe_gguf
from tests.tui.helpers import until


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_qwen3moe_gguf(path)
    return inspect_model(path)


def plan_on(model, machine: str):
    return make(model.spec, model.inventory, preset(machine), Workload(context=1024))


def test_a_plan_without_a_gpu_does_not_say_gpu_memory(tiny_gguf):
    plan = plan_on(tiny_gguf, "cpu-only")
    assert plan.fits and plan.main_device == "cpu"
    assert "GPU" not in verdict_text(plan).plain and "fits in host RAM" in verdict_text(plan).plain


def test_a_model_with_every_expert_on_the_gpu_reads_nothing_from_the_host(tiny_gguf):
    plan = plan_on(tiny_gguf, "4x H200 NVL")
    assert plan.gpu_expert_count == plan.n_routed_experts * len(plan.moe_layers)
    said = speed_text(plan).plain
    assert "0.00 GB" not in said and "the CPU computes none" in said
    bound = plan.decode_tokens_per_s_upper_bound
    assert f"at most {tokens_per_s(bound)} tokens/s" in said


@pytest.mark.parametrize("rate, words", [(39_449.4, "39,400"), (123.4, "123"), (7.25, "7.2"), (99.94, "99.9")])
def test_speeds_carry_three_significant_figures(rate, words):
    assert tokens_per_s(rate) == words


def test_each_kind_of_cell_has_its_own_glyph(tiny_gguf):
    plan = plan_on(tiny_gguf, "cpu-only")
    legend = layer_picture(plan).plain.splitlines()[0]
    gpu, cpu = legend.split()[0], legend.split("   ")[1].split()[0]
    assert gpu != cpu
    memory_legend = memory_picture(plan).plain.splitlines()[2]
    glyphs = [memory_legend.split()[i] for i in (0, 3, 6, 9)]  # "█ weights 1 KiB  ▓ KV cache ..."
    assert len(set(glyphs)) == 4, memory_legend


async def test_the_palette_lists_the_apps_actions_before_textuals(configured):
    app = HybridMoeApp(configured)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen), what="the chat")
        await pilot.press("ctrl+p")
        await until(pilot, lambda: app.screen.query(CommandList) and app.screen.query_one(CommandList).option_count > 5,
                    what="the palette")
        await pilot.pause(0.3)
        listed = app.screen.query_one(CommandList)
        names = [str(listed.get_option_at_index(i).prompt).split("\n")[0] for i in range(listed.option_count)]
        assert names[0] in {b.tooltip for b in ChatScreen.BINDINGS}, names  # the screen's own first
        textuals = [names.index(n) for n in ("Focus Next", "Theme", "Screenshot") if n in names]
        ours = [names.index(n) for n in ("Go to the chat", "Hardware: what this machine has", "Benchmark the model")]
        assert textuals and max(ours) < min(textuals), names


# ---- waits that say what they are doing (#48 item 11) ------------------------------------------


def test_a_plan_without_a_bandwidth_says_how_to_get_one(tiny_gguf):
    from dataclasses import replace

    hardware = preset("cpu-only")
    unmeasured = replace(hardware, memory=replace(hardware.memory, bandwidth_measured_bytes_per_s=None,
                                                  bandwidth_theoretical_bytes_per_s=None))
    plan = make(tiny_gguf.spec, tiny_gguf.inventory, unmeasured, Workload(context=1024))
    said = speed_text(plan).plain
    assert "unknown: host memory bandwidth not known" not in said
    assert "not known until the host memory bandwidth is measured" in said and "Ctrl+D" in said


async def test_the_models_screen_says_which_part_of_its_listing_runs(configured):
    import threading

    from textual.widgets import Static

    from hybridmoe.app.tui.screens.models import ModelsScreen
    from tests.tui.helpers import text_of

    detecting, release = threading.Event(), threading.Event()
    hardware = configured.hardware

    def slow_detect(measure_bandwidth, **_):
        detecting.set()
        release.wait(30)
        return hardware

    configured.detect_hardware = slow_detect
    app = HybridMoeApp(configured)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen), what="the chat")
        app.hardware = None  # not detected yet: the listing detects it
        await pilot.press("f3")
        await until(pilot, lambda: isinstance(app.screen, ModelsScreen) and detecting.is_set(), what="F3")
        detail = app.screen.query_one("#models-detail", Static)
        await until(pilot, lambda: "Detecting this machine" in text_of(detail), what="the words")
        release.set()
        await until(pilot, lambda: "Detecting" not in text_of(detail), what="the list")
