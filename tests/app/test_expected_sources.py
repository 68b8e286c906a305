"""One expected figure with its bound and its source wherever the app shows it (#47): the
catalogue says beneath its table where its expected figures came from, `run --json` gives the
plan's figures beside the measured ones, and the source is the plan's own words."""

from __future__ import annotations

import json

import pytest

from hybridmoe.app.hub_render import catalogue_text
from hybridmoe.app.render import expected_sources, plan_text
from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.hardware import preset
from hybridmoe.backend.hub import catalogue


@pytest.fixture(autouse=True)
def own_dirs(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_catalogue_says_where_its_expected_figures_came_from():
    entries = catalogue.load()
    ranked = catalogue.rank_for(preset("RTX 4090"), catalogue=entries)
    text = catalogue_text(entries, ranked)
    sources = expected_sources([r.plan for r in ranked])
    assert sources and all(f"Expected from {s}." in text for s in sources)
    # Each source is the plan's own, and names the rates it used: a described machine's
    # theoretical bandwidth at the engine's share, the cards' bandwidth at their share.
    first = ranked[0].plan
    assert first.decode_expected_source in sources
    assert "theoretical bandwidth × 0.8 × the engine's usual share, 0.65" in " ".join(sources)
    # The same figure, bound and how in the plan's text.
    plan = plan_text(first)
    assert f"{first.decode_tokens_per_s_expected:,.1f} tokens/s" in plan and first.decode_expected_how in plan


def test_expected_sources_are_each_said_once_in_order():
    class P:
        def __init__(self, source):
            self.decode_expected_source = source

    assert expected_sources([P("a"), None, P(""), P("b"), P("a")]) == ["a", "b"]


@pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")
def test_run_json_gives_the_plans_figures_beside_the_measured(tmp_path, capsys):
    from hybridmoe.app.cli import main
    from tests.convert.conftest import build_checkpoint

    checkpoint = build_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    code = main(["run", "-m", str(checkpoint.path), "-p", "Hello", "--max-tokens", "3", "--context", "128", "--json",
                 "--backend", "engine"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    said = result["plan_expected"]
    assert set(said) == {"decode_tokens_per_s", "decode_source", "decode_tokens_per_s_upper_bound",
                         "prefill_tokens_per_s"}
    assert result["stats"]["decode_tokens_per_s"] and said["prefill_tokens_per_s"]
    # `run` takes no bandwidth reading: the bound is unknown, and so is the expected decode
    # until the engine has run here (then its own rate: tests/plan/test_expected.py).
    assert said["decode_tokens_per_s_upper_bound"] is None
    assert (said["decode_tokens_per_s"] is None) == (said["decode_source"] == "")
