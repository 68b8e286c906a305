"""The one way into llama.cpp (hybridmoe.backend.llamacpp.model.load_model), the AMX workaround it applies,
the message a llama.cpp crash leaves, and how `run` names the backend it uses.

The build machines may lack AMX, so the AMX CPU is a stand-in (the detected CPU features), and
the crash is a stand-in that faults the same way: llama_decode replaced by a read of address 0.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hybridmoe.app import cli
from hybridmoe.backend.llamacpp import model as llamacpp_model

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("app", "backend", "tests", "benchmarks", "scripts")
THE_ONE_LOADER = ROOT / "backend" / "llamacpp" / "model.py"
# Calls that open llama.cpp weights: the high-level classes and llama.h's loaders.
LOADERS = {"Llama", "LlamaModel", "llama_model_load_from_file", "llama_load_model_from_file",
           "llama_model_load_from_splits"}
AMX_CPU = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
AVX512_CPU = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")


def llama_cpp_loads(path: Path) -> list[str]:
    """Calls in ``path`` that open llama.cpp weights, as "path:line name"."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in LOADERS:
                found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{node.lineno} {name}")
    return found


def test_every_llama_cpp_load_goes_through_the_one_loader():
    offenders = [
        hit
        for top in SCANNED
        for path in sorted((ROOT / top).rglob("*.py"))
        if path != THE_ONE_LOADER
        for hit in llama_cpp_loads(path)
    ]
    assert not offenders, ("llama.cpp weights must be loaded through hybridmoe.backend.llamacpp.model.load_model "
                           "(or its RawModel), which keeps them off the AMX buffer type where it crashes:\n"
                           + "\n".join(offenders))


def test_the_scan_catches_each_way_in(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent("""
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp import llama_cpp as b
        llama_cpp.Llama(model_path="m.gguf")
        Llama("m.gguf", vocab_only=True)
        b.llama_model_load_from_file(b"m.gguf", b.llama_model_default_params())
        b.llama_load_model_from_file(b"m.gguf", None)
        llama_cpp._internals.LlamaModel(path_model="m.gguf", params=None)
        print("Llama(")  # a string is not a call
    """))
    assert [hit.rsplit(" ", 1)[1] for hit in llama_cpp_loads(bad)] == [
        "Llama", "Llama", "llama_model_load_from_file", "llama_load_model_from_file", "LlamaModel"]


# -- the AMX workaround ------------------------------------------------------------------------

def test_the_params_keep_the_weights_off_amx_on_an_amx_cpu():
    bindings = llamacpp_model.llama()
    params = llamacpp_model.safe_params(bindings.llama_model_default_params(), AMX_CPU)
    assert params.use_extra_bufts is False


def test_the_params_are_left_as_they_are_without_amx():
    bindings = llamacpp_model.llama()
    default = bindings.llama_model_default_params()
    assert default.use_extra_bufts is True  # llama.cpp's default: CPU_REPACK (and AMX where built)
    assert llamacpp_model.safe_params(bindings.llama_model_default_params(), AVX512_CPU).use_extra_bufts is True


def test_loading_on_an_amx_cpu_really_passes_the_workaround(ggufs, monkeypatch):
    """load_model applies it to whatever params it is given, the app session's included."""
    bindings = llamacpp_model.llama()
    seen = []
    real = bindings.llama_model_load_from_file
    monkeypatch.setattr(bindings, "llama_model_load_from_file",
                        lambda path, params: seen.append(params.use_extra_bufts) or real(path, params))
    monkeypatch.setattr(llamacpp_model, "_cpu_features", lambda: AMX_CPU)
    with llamacpp_model.RawModel(ggufs("qwen3_moe"), n_ctx=32) as llm:
        assert llm.eval([1, 2, 3]).shape == (1, llm.n_vocab())
    monkeypatch.setattr(llamacpp_model, "_cpu_features", lambda: AVX512_CPU)
    with llamacpp_model.RawModel(ggufs("qwen3_moe"), vocab_only=True):
        pass
    assert seen == [False, True]


def test_an_old_llama_cpp_python_on_an_amx_cpu_is_refused_with_the_reason():
    import ctypes

    class OldModelParams(ctypes.Structure):  # llama_model_params before use_extra_bufts
        _fields_ = [("n_gpu_layers", ctypes.c_int32), ("vocab_only", ctypes.c_bool)]

    assert llamacpp_model.crash_risk(AVX512_CPU, OldModelParams) is None
    risk = llamacpp_model.crash_risk(AMX_CPU, OldModelParams)
    assert "AMX" in risk and "20824" in risk
    with pytest.raises(llamacpp_model.LlamaCppUnsafe) as refused:
        llamacpp_model.safe_params(OldModelParams(), AMX_CPU)
    assert "--backend engine" in refused.value.hint
    assert llamacpp_model.crash_risk(AMX_CPU, type(llamacpp_model.llama().llama_model_default_params())) is None


# -- `run`: which backend, and why ---------------------------------------------------------------

@pytest.fixture
def own_dirs(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


@pytest.fixture
def llamacpp_plan(ggufs, tmp_path, own_dirs, capsys):
    """A plan saved with `--backend llamacpp` for a GGUF the engine serves."""
    path = tmp_path / "plan.toml"
    assert cli.main(["plan", str(ggufs("qwen3_moe")), "--backend", "llamacpp", "--context", "256",
                     "--save", str(path)]) == 0
    capsys.readouterr()
    return path


def run_json(capsys, *args) -> tuple[int, dict | None, str]:
    code = cli.main(["run", "-p", "Hello there", "--max-tokens", "3", "--json", *map(str, args)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_run_names_the_backend_a_saved_plan_chose(ggufs, llamacpp_plan, capsys):
    code, result, err = run_json(capsys, "-m", ggufs("qwen3_moe"), "--plan", llamacpp_plan)
    assert code == 0, err
    assert result["backend"] == "llamacpp"
    assert result["backend_reason"] == f"the plan was made for llama.cpp ({llamacpp_plan})"
    assert f"hybridmoe: backend: llama.cpp, because the plan was made for llama.cpp ({llamacpp_plan})" in err


def test_run_json_says_why_without_a_plan(ggufs, own_dirs, capsys):
    code, result, err = run_json(capsys, "-m", ggufs("qwen3_moe"), "--context", "256")
    assert code == 0, err
    assert (result["backend"], result["backend_reason"]) == ("engine", "auto: the embedded engine serves this model")
    code, result, err = run_json(capsys, "-m", ggufs("qwen3_moe"), "--context", "256", "--backend", "engine")
    assert result["backend_reason"] == "asked for with --backend engine"


def test_auto_serves_with_the_engine_where_llama_cpp_is_known_to_crash(ggufs, llamacpp_plan, monkeypatch, capsys):
    import hybridmoe.backend.backends

    # Stand-in: an AMX CPU with a llama-cpp-python too old to keep its weights off AMX.
    risk = llamacpp_model.crash_risk(AMX_CPU, type("Old", (), {"_fields_": []}))
    monkeypatch.setattr(hybridmoe.backend.backends, "_llamacpp_crash_risk", lambda: risk)
    code, result, err = run_json(capsys, "-m", ggufs("qwen3_moe"), "--plan", llamacpp_plan)
    assert code == 0, err
    assert result["backend"] == "engine"
    assert "hybridmoe: backend: the embedded engine, because the plan was made for llama.cpp, but llama.cpp's AMX" in err


def test_a_plan_only_llama_cpp_fits_is_refused_where_it_is_known_to_crash(ggufs, llamacpp_plan, monkeypatch, capsys):
    """`--backend auto` planned llama.cpp because the engine's layout does not fit (plan.make):
    the engine must not be handed that plan instead."""
    import dataclasses

    import hybridmoe.backend.backends
    from hybridmoe.backend.plan import Plan

    misfit = "the GPUs hold 4.1 GB of the 5.2 GB the layout needs"
    dataclasses.replace(Plan.load(llamacpp_plan), engine_misfit=misfit).save(llamacpp_plan)
    assert Plan.load(llamacpp_plan).engine_misfit == misfit
    risk = llamacpp_model.crash_risk(AMX_CPU, type("Old", (), {"_fields_": []}))
    monkeypatch.setattr(hybridmoe.backend.backends, "_llamacpp_crash_risk", lambda: risk)
    code, result, err = run_json(capsys, "-m", ggufs("qwen3_moe"), "--plan", llamacpp_plan)
    assert code != 0 and set(result) == {"error"}  # no answer: the error, as JSON
    assert f"the embedded engine's does not: {misfit}), and llama.cpp's AMX matmul crashes" in err
    assert "hybridmoe plan --backend engine" in err and "Traceback" not in err


def test_llama_cpps_own_layout_is_not_handed_to_the_engine_where_llama_cpp_is_known_to_crash(
        ggufs, llamacpp_plan, monkeypatch, capsys):
    """A plan for llama.cpp holds whole layers of experts on the GPUs as stored (plan.make): the
    engine does not hold experts so, so it must not be handed that plan instead."""
    import dataclasses

    import hybridmoe.backend.backends
    from hybridmoe.backend.plan import Plan

    plan = Plan.load(llamacpp_plan)
    last = plan.moe_layers[-1]
    whole_layer = {**plan.gpu_experts, last: tuple(range(plan.n_routed_experts))}
    dataclasses.replace(plan, gpu_expert_format="stored", gpu_experts=whole_layer).save(llamacpp_plan)
    risk = llamacpp_model.crash_risk(AMX_CPU, type("Old", (), {"_fields_": []}))
    monkeypatch.setattr(hybridmoe.backend.backends, "_llamacpp_crash_risk", lambda: risk)
    code, result, err = run_json(capsys, "-m", ggufs("qwen3_moe"), "--plan", llamacpp_plan)
    assert code != 0 and set(result) == {"error"}
    assert "llama.cpp's layout (whole layers of experts on the GPUs, as stored)" in err and "Traceback" not in err


def test_auto_does_not_fall_back_to_llama_cpp_where_it_is_known_to_crash(ggufs, tmp_path, own_dirs, monkeypatch, capsys):
    import hybridmoe.backend.backends
    from tests.llamacpp.conftest import copy_gguf

    engine_cannot = copy_gguf(ggufs("qwen3_moe"), tmp_path / "bloom.gguf", values={"tokenizer.ggml.pre": "bloom"})
    risk = llamacpp_model.crash_risk(AMX_CPU, type("Old", (), {"_fields_": []}))
    monkeypatch.setattr(hybridmoe.backend.backends, "_llamacpp_crash_risk", lambda: risk)
    code, result, err = run_json(capsys, "-m", engine_cannot, "--context", "256")
    assert code != 0 and set(result) == {"error"}  # no answer: the error, as JSON
    assert "pre-tokenizer 'bloom'" in err and "The llama.cpp fallback is not used: llama.cpp's AMX matmul" in err
    assert "using llama.cpp instead" not in err and "Traceback" not in err


# -- a crash inside llama.cpp ------------------------------------------------------------------

CRASHING_RUN = """
import ctypes, sys
import llama_cpp.llama_cpp as bindings

def crash(ctx, batch):  # the stand-in: a fault in native code, as ggml_backend_amx_mul_mat's
    ctypes.string_at(0)

bindings.llama_decode = crash
from hybridmoe.app.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_crash_in_llama_cpp_is_named_with_what_to_do(ggufs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env.update({k: str(tmp_path / k.lower()) for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")})
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_RUN, "run", "-m", str(ggufs("qwen3_moe")), "--backend", "llamacpp",
         "--context", "256", "-p", "Hello there"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == -signal.SIGSEGV  # dies of the signal: exit 139 in a shell
    assert "hybridmoe: error: llama.cpp crashed (SIGSEGV" in proc.stderr
    assert "--backend engine" in proc.stderr
    assert "Traceback" not in proc.stderr and "Fatal Python error" not in proc.stderr


def test_a_crash_in_llama_cpp_while_serving_is_named_too(ggufs, tmp_path):
    """The server decodes on a worker thread; the message comes all the same."""
    import re
    import time
    import urllib.request

    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    env.update({k: str(tmp_path / k.lower()) for k in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")})
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        [sys.executable, "-c", CRASHING_RUN, "serve", "-m", str(ggufs("qwen3_moe")), "--backend", "llamacpp",
         "--port", "0", "--context", "256"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line, deadline = "", time.monotonic() + 120
        while "Serving" not in line:
            assert time.monotonic() < deadline and process.poll() is None, line
            line = process.stderr.readline()
        url = re.search(r"at (http://\S+)/v1 ", line).group(1)
        request = urllib.request.Request(f"{url}/v1/chat/completions", method="POST",
                                         data=json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(OSError):  # the connection dies with the process
            urllib.request.urlopen(request, timeout=60)
        assert process.wait(timeout=60) == -signal.SIGSEGV
        err = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
    assert "hybridmoe: error: llama.cpp crashed (SIGSEGV" in err and "--backend engine" in err


def test_serve_names_the_backend_a_saved_plan_chose(ggufs, llamacpp_plan, monkeypatch, capsys):
    import signal

    import hybridmoe.app.server.runner

    class StopsAtOnce(hybridmoe.app.server.runner.ApiServer):
        def start(self):  # the server would run until Ctrl-C: press it at once
            super().start()
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(hybridmoe.app.server.runner, "ApiServer", StopsAtOnce)
    code = cli.main(["serve", "-m", str(ggufs("qwen3_moe")), "--plan", str(llamacpp_plan), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"hybridmoe: backend: llama.cpp, because the plan was made for llama.cpp ({llamacpp_plan})" in err


def test_the_chat_is_told_the_backend_a_saved_plan_chose(ggufs, llamacpp_plan):
    from hybridmoe.app.services import Services
    from hybridmoe.backend.plan.plan import Plan

    notices = []
    session = Services().load_session(ggufs("qwen3_moe"), Plan.load(llamacpp_plan), None, None, notices.append)
    try:
        assert notices == ["Backend: llama.cpp, because the plan was made for llama.cpp."]
    finally:
        session.close()
