"""The chat's status line (#47): the measured decode speed beside the plan's expected figure,
the same figure the Plan screen shows, in one line that an 80-column terminal does not wrap."""

from __future__ import annotations

from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.app.tui.widgets.plan_view import speed_text, tokens_per_s
from hybridmoe.app.tui.widgets.status_line import PADDING, SEPARATOR, StatusLine, one_line
from hybridmoe.backend.settings import Settings
from tests.tui.fakes import local_model
from tests.tui.helpers import first_answer, text_of, until


def test_one_line_never_passes_the_width_and_keeps_the_first_part():
    name = "unsloth/DeepSeek-V3-0324-GGUF UD-Q2_K_XL"
    parts = ["42.0 tok/s (expected 38.1)", "context 1,234/32,768", "first token 0.52 s", "62% of experts on GPU",
             "peak RAM 3.0 GiB, cuda:0 80.0 GiB"]
    for width in range(1, 200):
        line = one_line(name, parts, width)
        assert len(line) <= width, width
        if width >= len(parts[0]):
            assert parts[0] in line, width
    # Room enough: all of it, with the wide separators.
    assert one_line(name, parts, 500) == SEPARATOR.join([name, *parts])
    # The model name is cut before any part goes; then the last parts go first.
    rest = " · ".join(parts[:2])
    assert one_line(name, parts[:2], 70) == name[:70 - len(rest) - 3 - 1] + "… · " + rest
    line = one_line(name, parts, 78)
    assert parts[0] in line and parts[1] in line and parts[-1] not in line
    # A message alone is cut, never dropped.
    assert one_line("", ["the model did not load; Ctrl+L tries again"], 20) == "the model did not l…"


async def _answered_chat(app, pilot) -> ChatScreen:
    await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                what="the model to load")
    chat = app.screen
    await first_answer(pilot, chat, "hello")
    await pilot.pause()
    return chat


async def test_the_status_line_shows_the_plans_expected_figure_in_one_line_at_80_columns(services, tmp_path):
    # A long model name, as a Hugging Face repository id with a quantization often is.
    model = local_model(tmp_path / "models", name="unsloth/Qwen3-30B-A3B-Instruct-2507-GGUF-with-a-long-name")
    services.local.append(model)
    Settings(default_model=str(model.path), measure_bandwidth=False).save()
    app = HybridMoeApp(services)
    async with app.run_test(size=(80, 24)) as pilot:
        chat = await _answered_chat(app, pilot)
        status = chat.query_one(StatusLine)
        line = text_of(status)
        expected = chat.plan.decode_tokens_per_s_expected
        assert expected, "the fake plan has an expected figure to show"
        # The measured speed beside the plan's expected figure, as the Plan screen words it.
        assert f"42.0 tok/s (expected {tokens_per_s(expected)})" in line
        assert f"{tokens_per_s(expected)} tokens/s" in speed_text(chat.plan).plain
        # One line, within the widget: nothing wraps, and what was cut is on hover.
        assert "\n" not in line and len(line) <= status.size.width == 80 - PADDING
        assert status.size.height == 1
        assert len(status.model_name) > 20 and status.tooltip and status.model_name in str(status.tooltip)
        # A wider terminal shows it all, with no tooltip.
        await pilot.resize_terminal(200, 24)
        await pilot.pause()
        assert text_of(status).startswith(status.model_name)
        assert status.tooltip is None
