"""`hybridmoe run --backend auto|engine|llamacpp` and the llama.cpp line of `hybridmoe doctor`."""

from __future__ import annotations

import json

import pytest

from hybridmoe.app import cli
from tests.llamacpp.conftest import copy_gguf


@pytest.fixture(autouse=True)
def own_dirs(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


@pytest.fixture(scope="module")
def engine_cannot(ggufs, tmp_path_factory):
    """A GGUF llama.cpp serves and the engine refuses: a pre-tokenizer ("bloom") the engine's
    GGUF tokenizer does not rebuild."""
    return copy_gguf(ggufs("qwen3_moe"), tmp_path_factory.mktemp("bloom") / "bloom.gguf",
                     values={"tokenizer.ggml.pre": "bloom"})


def run_json(capsys, *args) -> tuple[int, dict | None, str]:
    code = cli.main(["run", "-p", "Hello there", "--max-tokens", "6", "--context", "256", "--json", *map(str, args)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_run_with_the_llama_cpp_backend(ggufs, capsys):
    code, result, err = run_json(capsys, "-m", ggufs("deepseek_v3"), "--backend", "llamacpp")
    assert code == 0, err
    assert result["backend"] == result["stats"]["backend"] == "llamacpp"
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"


def test_auto_falls_back_to_llama_cpp_and_says_why(engine_cannot, capsys):
    code, result, err = run_json(capsys, "-m", engine_cannot)
    assert code == 0, err
    assert result["backend"] == "llamacpp"
    assert "the embedded engine cannot serve this model, using llama.cpp instead" in err
    assert "pre-tokenizer 'bloom'" in err


def test_auto_prefers_the_engine(ggufs, capsys):
    code, result, err = run_json(capsys, "-m", ggufs("mixtral"))
    assert code == 0, err
    assert result["backend"] == "engine" and "llama.cpp" not in err


def test_engine_only_does_not_fall_back(engine_cannot, capsys):
    code, result, err = run_json(capsys, "-m", engine_cannot, "--backend", "engine")
    assert code == 1 and "pre-tokenizer 'bloom'" in result["error"]["message"]  # no answer: the error, as JSON
    assert err.startswith("hybridmoe: error:") and "pre-tokenizer 'bloom'" in err and "Traceback" not in err


def test_record_stats_needs_the_engine(ggufs, tmp_path, capsys):
    code, _, err = run_json(capsys, "-m", ggufs("qwen3_moe"), "--backend", "llamacpp",
                            "--record-stats", tmp_path / "stats.json")
    assert code == 2 and "--record-stats needs the embedded engine" in err


def test_doctor_names_the_llama_cpp_build(capsys):
    from hybridmoe.backend.llamacpp import system_info

    info = system_info()
    assert info["available"] and "CPU" in info["backends"]
    assert any(d["type"] == "CPU" for d in info["devices"])
    assert cli.main(["doctor", "--no-bandwidth"]) == 0
    out = capsys.readouterr().out
    assert "\nSoftware\n" in out and f"llama-cpp-python {info['version']}, backends " in out
    assert cli.main(["doctor", "--no-bandwidth", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["llama_cpp"]["backends"] == info["backends"]
