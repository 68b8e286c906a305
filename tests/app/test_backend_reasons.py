"""Why a run is served by the backend it is: `run` says it on stderr and in --json
(backend_reason, engine_slow_path) and the TUI's services in a notice, when the engine would
compute routed experts on a slow path (here: the native kernels turned off, so every CPU expert
is dequantized by PyTorch on each call) and when it cannot read a tensor's GGUF type at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.convert.conftest import build_checkpoint


@pytest.fixture(autouse=True)
def own_dirs(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from hybridmoe.backend.convert import to_gguf

    root = tmp_path_factory.mktemp("reasons")
    build_checkpoint(root / "hf", "qwen3_moe")
    return to_gguf(root / "hf", root / "tiny-qwen3moe-Q8_0.gguf", "q8_0")


def run_json(capsys, *args) -> tuple[int, dict, str]:
    from hybridmoe.app.cli import main

    code = main(["run", "-p", "Hello", "--max-tokens", "2", "--context", "128", "--json", *map(str, args)])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_auto_takes_llama_cpp_over_the_slow_path_and_says_why(tiny_gguf, monkeypatch, capsys):
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    code, result, err = run_json(capsys, "-m", tiny_gguf)
    assert code == 0, err
    assert result["backend"] == "llamacpp"
    slow = result["engine_slow_path"]
    # Two MoE layers of three merged expert tensors (gate, up, down) each.
    assert slow.startswith("6 routed-expert tensors in Q8_0 (e.g. blk.0.ffn_down_exps.weight) would be computed on a "
                           "slow path on the CPU: ")
    assert "the native CPU kernels are not in use (turned off by HYBRIDMOE_NATIVE=0)" in slow
    assert result["backend_reason"] == f"on the embedded engine {slow}"
    assert f"hybridmoe: backend: llama.cpp, because on the embedded engine {slow}; choose another with --backend" in err


def test_the_engine_asked_for_warns_of_the_slow_path(tiny_gguf, monkeypatch, capsys):
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    code, result, err = run_json(capsys, "-m", tiny_gguf, "--backend", "engine")
    assert code == 0, err
    assert result["backend"] == "engine" and result["engine_slow_path"]
    assert f"hybridmoe: warning: {result['engine_slow_path']}; --backend llamacpp reads them in place" in err


def test_with_the_kernels_in_use_nothing_is_slow(tiny_gguf, capsys):
    code, result, err = run_json(capsys, "-m", tiny_gguf)
    assert code == 0, err
    assert result["backend"] == "engine" and result["engine_slow_path"] is None
    assert "slow path" not in err


def test_auto_keeps_the_engine_where_llama_cpp_is_missing_and_says_both(tiny_gguf, monkeypatch, capsys):
    from hybridmoe.backend.llamacpp import LlamaCppUnavailable, library

    def missing():
        raise LlamaCppUnavailable("the llama.cpp backend is not available: No module named 'llama_cpp'", "pip install")

    monkeypatch.setattr(library, "llama", missing)
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    code, result, err = run_json(capsys, "-m", tiny_gguf)
    assert code == 0, err
    assert result["backend"] == "engine"
    assert result["backend_reason"] == ("the llama.cpp backend is not available: No module named 'llama_cpp', "
                                        f"although on the embedded engine {result['engine_slow_path']}")
    assert f"backend: the embedded engine, because {result['backend_reason']}" in err
    assert "hybridmoe: warning:" not in err  # said once, in the reason


def test_the_tui_is_told_of_the_slow_path(tiny_gguf, monkeypatch):
    """The TUI's services hand every notice to the chat's status: the engine serving a plan
    made for it, with its slow path named."""
    import importlib.util
    from dataclasses import replace

    from hybridmoe.app.services import Services
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    model = inspect_model(tiny_gguf)
    plan = make(model.spec, model.inventory, detect(measure_bandwidth=False), Workload(context=128, backend="engine"))
    assert plan.engine_slow_path
    notices: list[str] = []
    session = Services().load_session(model, plan, None, None, on_notice=notices.append)
    session.close()
    assert notices == ["Backend: the embedded engine, because the plan was made for the embedded engine.",
                       f"Slow path: {plan.engine_slow_path}. The llama.cpp backend reads them in place."]
    auto = replace(plan, workload=replace(plan.workload, backend="auto"))
    notices.clear()
    if importlib.util.find_spec("llama_cpp"):
        Services().load_session(model, auto, None, None, on_notice=notices.append).close()
        assert notices == [f"Backend: llama.cpp, because on the embedded engine {plan.engine_slow_path}."]


@pytest.fixture(scope="module")
def ternary_gguf(tmp_path_factory) -> tuple[Path, str]:
    """A model whose routed experts are in a ternary type the engine does not read (rows of 256
    weights: whole super-blocks), written by gguf-py's quantizer; llama.cpp reads it."""
    from gguf import GGMLQuantizationType as T

    from hybridmoe.backend.convert import to_gguf
    from hybridmoe.backend.formats.quant import GGUF_SUPPORTED_TYPES
    from tests.models.test_type_breakdown import requantized

    unread = [t for t in (T.TQ2_0, T.TQ1_0) if t not in GGUF_SUPPORTED_TYPES]
    if not unread:
        pytest.skip("the engine reads every GGUF type gguf-py can write")
    root = tmp_path_factory.mktemp("ternary")
    build_checkpoint(root / "hf", "qwen3_moe", overrides={"hidden_size": 256, "moe_intermediate_size": 256})
    source = to_gguf(root / "hf", root / "wide.gguf", "bf16")
    experts = {f"blk.{b}.ffn_{p}_exps.weight": unread[0] for b in range(3) for p in ("gate", "up", "down")}
    return requantized(source, root / "wide-ternary.gguf", experts), unread[0].name


def test_an_unread_type_falls_back_to_llama_cpp_naming_the_tensor_and_type(ternary_gguf, capsys):
    pytest.importorskip("llama_cpp")
    path, qtype = ternary_gguf
    code, result, err = run_json(capsys, "-m", path)
    assert code == 0, err
    assert result["backend"] == "llamacpp"
    reason = result["backend_reason"]
    assert reason.startswith("the embedded engine cannot serve this model: ")
    assert f"({qtype}: " in reason and "e.g. 'blk.0.ffn_down_exps.weight'" in reason
    assert "the embedded engine cannot serve this model, using llama.cpp instead" in err and qtype in err


def test_an_unread_type_on_the_engine_is_one_error_with_what_to_do(ternary_gguf, capsys):
    from hybridmoe.app.cli import main

    path, qtype = ternary_gguf
    code = main(["run", "-m", str(path), "-p", "Hello", "--max-tokens", "2", "--context", "128", "--json",
                 "--backend", "engine"])
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err
    error = json.loads(out)["error"]
    assert f"tensor(s) use GGUF type(s) the embedded engine cannot read ({qtype}: " in error["message"]
    assert error["hint"].startswith("Run this model on llama.cpp (--backend llamacpp; --backend auto does so by itself)")
    readable = error["hint"].split("types the engine reads: ", 1)[1].rstrip(".").split(", ")
    assert "Q8_0" in readable and qtype not in readable


def test_serve_warns_of_the_slow_path_before_it_serves(tiny_gguf, monkeypatch, tmp_path):
    from tests.server.conftest import serve_process, until_serving

    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    process, lines = serve_process(tiny_gguf, tmp_path, "--context", "128", "--backend", "engine")
    try:
        seen = "".join(until_serving(process, lines))
    finally:
        process.kill()
        process.wait(timeout=30)
    warning = next(line for line in seen.splitlines() if line.startswith("hybridmoe: warning: "))
    assert "would be computed on a slow path on the CPU" in warning
    assert warning.endswith("; --backend llamacpp reads them in place")
