"""`hybridmoe bench serve`'s plumbing on a tiny GGUF: both backends, 1 and 2 streams, a few
tokens, short conversations taking turns. The figures of a tiny model say nothing about speed;
what is checked is that every figure the report promises is there, positive, and that each
stream generated exactly the tokens asked for (end-of-turn tokens do not stop a benchmark)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridmoe.app import cli
from hybridmoe.backend.bench import serve
from hybridmoe.backend.bench.generate import worker_error
from hybridmoe.backend.text.generation import Prefilled, max_new_tokens, stream
from hybridmoe.backend.text.sampling import SamplingParams
from tests.convert.conftest import build_checkpoint, needs_llama_cpp


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from hybridmoe.backend.convert import to_gguf

    work = tmp_path_factory.mktemp("bench-serve")
    checkpoint = build_checkpoint(work / "checkpoint", "qwen3_moe")
    return to_gguf(checkpoint.path, work / "tiny-q8_0.gguf", "q8_0")


@pytest.fixture
def own_dirs(tmp_path, monkeypatch):
    """Settings and data directories of the test's own: the user's are never read."""
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


@needs_llama_cpp
@pytest.mark.slow
def test_the_report_has_every_figure_for_both_backends(tiny_gguf, own_dirs, capsys):
    code = cli.main(["bench", "serve", str(tiny_gguf), "--streams", "2,1", "--prompt", "8", "--tokens", "4",
                     "--threads", "1", "--turns", "40", "--repeats", "2", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out)

    assert summary["streams"] == [1, 2] and summary["repeats"] == 2
    assert set(summary["predicted"]) == {"1", "2"}
    for predicted in summary["predicted"].values():
        assert predicted["aggregate_tokens_per_s"] > 0 and predicted["per_user_tokens_per_s"] > 0
    for backend in ("engine", "llamacpp"):
        result = summary["results"][backend]
        assert "error" not in result, result
        assert result["load_s"] > 0 and result["rss_peak"] >= result["rss_after_load"] > 0
        assert [run["streams"] for run in result["runs"]] == [1, 2]
        for run in result["runs"]:
            assert run["generated_tokens"] == [4] * run["streams"], backend
            assert run["repeats"] == 2
            for figure in ("aggregate_tokens_per_s", "per_stream_tokens_per_s", "time_to_first_token_s", "wall_s"):
                assert run[figure] > 0, (backend, run["streams"], figure)
        turns = result["turns"]
        assert turns["conversation_tokens"] > 40
        assert set(turns["next_turn_time_to_first_token_s"]) == {"A", "B"}
        assert all(t > 0 for t in turns["next_turn_time_to_first_token_s"].values())
        assert turns["scratch_time_to_first_token_s"] > 0 and turns["scratch_over_next_turn"] > 0
    assert set(summary["ratios"]["engine_over_llamacpp"]) == {"1", "2"}
    assert set(summary["ratios"]["over_one_stream"]["engine"]) == {"2"}

    text = serve.table(summary)
    assert "engine / llama.cpp, together tok/s: 1 stream" in text
    assert text.count("next turn A") == 2


def exit_code(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exit:  # argparse's usage errors
        return exit.code


@pytest.mark.parametrize("args, message", [
    (["/no/such/model.gguf"], "/no/such/model.gguf is not a file"),
    (["model.gguf", "--streams", "1,0"], "'0' must be 1 or more"),
    (["model.gguf", "--backends", "engine,vllm"], "'vllm' is not one of engine, llamacpp"),
])
def test_bad_input_gets_one_clear_message(args, message, own_dirs, capsys):
    assert exit_code(["bench", "serve", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_ignore_eos_generates_through_end_tokens(tiny_gguf):
    """The token loop both backends share: with ``ignore_eos`` an end-of-turn token is a token
    like any other, and the generation runs to max_tokens."""
    from hybridmoe.backend.text.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_gguf)
    end = tokenizer.eos_id
    peaked_at_end = torch.full((tokenizer.vocab_size,), -10.0)
    peaked_at_end[end] = 10.0

    def generate(sampling: SamplingParams):
        events = stream(Prefilled([1, 2], peaked_at_end, 2, 0.0, 0.0), sampling,
                        detokenizer=tokenizer.detokenizer(), stop_strings=(), is_stop=tokenizer.stop_ids.__contains__,
                        forward=lambda token: peaked_at_end, max_new=max_new_tokens(2, 100, sampling), cancel=None, backend="test",
                        expert_share=lambda: None, peak_memory=lambda: {})
        return list(events)[-1]

    stopped = generate(SamplingParams(temperature=0, max_tokens=5))
    assert stopped.reason == "stop" and stopped.token_ids == ()
    through = generate(SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert through.reason == "length" and through.token_ids == (end,) * 5


def test_a_failed_worker_is_reported_by_its_exception():
    """(Both benchmarks' workers.) Native code may print after Python's traceback (nanobind's leak report did): the report
    names the exception, not that last line."""
    stderr = ("Traceback (most recent call last):\n  File \"serve.py\", line 1, in <module>\n    run()\n"
              "ModelError: llama.cpp could not load m.gguf\nnanobind: leaked 2 instances!\n"
              "See https://nanobind.readthedocs.io/en/latest/refleaks.html\n")
    assert worker_error(stderr) == "ModelError: llama.cpp could not load m.gguf"
    assert worker_error("Killed\n") == "Killed"


def test_the_plans_expected_figures_are_printed_beside_the_measured(tiny_gguf):
    """bench serve's (expected) columns are the plan's expected figures for N conversations, its
    (at most) columns the plan's bounds: each printed figure is the plan's arithmetic."""
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    predicted = serve.predictions(str(tiny_gguf), [1, 4], 64)
    inspected = inspect_model(tiny_gguf)
    hardware = detect(measure_bandwidth=True)  # the process's one reading, as predictions took it
    for n in (1, 4):
        plan = make(inspected.spec, inspected.inventory, hardware, Workload(context=64, users=n, strategy="cpu-only"))
        assert predicted[n]["expected_per_user_tokens_per_s"] == plan.decode_tokens_per_s_per_user_expected
        assert predicted[n]["expected_aggregate_tokens_per_s"] == plan.decode_tokens_per_s_aggregate_expected
        assert predicted[n]["aggregate_tokens_per_s"] == plan.decode_tokens_per_s_aggregate
    runs = [{"streams": n, "aggregate_tokens_per_s": 10.0 * n, "per_stream_tokens_per_s": 10.0,
             "time_to_first_token_s": 0.1} for n in (1, 4)]
    summary = {"model": "tiny", "streams": [1, 4], "prompt_tokens": 8, "gen_tokens": 4, "threads": 1, "turns": 0,
               "predicted": predicted, "results": {"engine": {"runs": runs, "rss_peak": 1 << 30, "parallel": 4}},
               "ratios": {"engine_over_llamacpp": {}, "over_one_stream": {}}}
    rows = [line.split() for line in serve.table(summary).splitlines() if line.startswith("engine ")]
    for row, n in zip(rows, (1, 4)):
        p = predicted[n]
        # backend N together (expected) (at most) per-stream (expected) (at most) TTFT RSS
        assert row[3:5] == [f"{p['expected_aggregate_tokens_per_s']:.1f}", f"{p['aggregate_tokens_per_s']:.1f}"]
        assert row[6:8] == [f"{p['expected_per_user_tokens_per_s']:.1f}", f"{p['per_user_tokens_per_s']:.1f}"]
