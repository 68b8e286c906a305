"""A split GGUF of a DeepSeek-V3-shaped model in the shape of the community's UD-Q2_K_XL
mixes (routed experts IQ2_XXS and IQ3_XXS, attention Q4_K and Q6_K, shared experts Q6_K, head
Q8_0; backend/bench/retype.py), in three parts: `run`, from any part, and the chat serve it on
the embedded engine, every type read in place by the native kernels (no slow path)."""

from __future__ import annotations

import json

import pytest

from hybridmoe.app.services import Services
from hybridmoe.app.tui.app import HybridMoeApp
from hybridmoe.app.tui.screens.chat import ChatScreen
from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.settings import Settings
from tests.tui.helpers import first_answer, until

pytestmark = pytest.mark.skipif(not native_kernels.enabled(), reason="the native kernels are not built")


@pytest.fixture(scope="module")
def ud_parts(tmp_path_factory):
    from hybridmoe.backend.bench.retype import retype
    from hybridmoe.backend.convert import to_gguf
    from tests.convert.conftest import build_checkpoint

    tmp = tmp_path_factory.mktemp("ud")
    # Rows of whole 256-value super-blocks, as the i-quants need; a MoE layer between the first
    # and the last, whose gate and up the mix makes IQ2_XXS.
    sizes = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=4)
    checkpoint = build_checkpoint(tmp / "ckpt", "deepseek_v3", overrides=sizes)
    source = to_gguf(checkpoint.path, tmp / "m-q8_0.gguf", "q8_0")
    return retype(source, tmp / "m-UD-Q2_K_XL.gguf", mix="ud-q2_k_xl", parts=3)


def test_the_parts_hold_the_mix(ud_parts, capsys):
    from hybridmoe.app.cli import main

    assert [p.name for p in ud_parts] == [f"m-UD-Q2_K_XL-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert main(["inspect", str(ud_parts[2]), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    by_class = inspected["inventory"]["types_by_class"]
    # The file records one type (its source's q8_0); the plan sizes and times the experts by theirs.
    assert inspected["spec"]["expert_format"] in {"iq2_xxs", "iq3_xxs"}
    assert set(by_class["routed_experts"]) == {"iq2_xxs", "iq3_xxs"}
    assert "q4_k" in by_class["attention"] and set(by_class["lm_head"]) == {"q8_0"}
    # The text names the experts' stored types, not the one type the file's metadata records.
    assert main(["inspect", str(ud_parts[0])]) == 0
    formats = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("formats"))
    assert set(formats.split("experts ")[1].split(" ")[0].split("+")) == {"iq2_xxs", "iq3_xxs"}, formats


def test_run_serves_it_on_the_engine_from_any_part(ud_parts, capsys):
    from hybridmoe.app.cli import main

    code = main(["run", "-m", str(ud_parts[1]), "-p", "Hello", "--max-tokens", "4", "--context", "128", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["backend"] == "engine" and result["engine_slow_path"] is None
    assert 1 <= len(result["token_ids"]) <= 4 and "slow path" not in err


async def test_the_chat_answers_from_it(ud_parts):
    Settings(default_model=str(ud_parts[0]), context=256, measure_bandwidth=False).save()
    app = HybridMoeApp(Services())
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen.session is not None,
                    timeout=90, what="the engine to load the model")
        chat = app.screen
        assert chat.plan.engine_slow_path is None
        answer = await first_answer(pilot, chat, "Hello!", timeout=60)
        assert answer.role == "assistant"
        assert chat.session.__class__.__module__.startswith("hybridmoe.backend.engine")
