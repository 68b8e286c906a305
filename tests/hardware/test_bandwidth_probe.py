"""The host read-bandwidth probe: the native one where the extension is built, the portable
one where it is not, and never anything process-wide that a model running on another thread
depends on (the app once crashed with a segmentation fault while the probe ran beside a
loaded model)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

import hybridmoe
from hybridmoe.backend.hardware import bandwidth
from hybridmoe.backend.hardware.bandwidth import measure_host_read_bandwidth

MIB = 1 << 20


@pytest.fixture
def no_extension(monkeypatch):
    """As in a source tree where the extension was never built: importing it fails."""
    monkeypatch.delattr(hybridmoe, "_native", raising=False)
    monkeypatch.setitem(sys.modules, "hybridmoe._native", None)


def test_the_native_probe_is_used_when_the_extension_is_built(monkeypatch):
    asked = []

    def measure_read_bandwidth(nbytes, passes):
        asked.append((nbytes, passes))
        return 42e9

    fake = types.SimpleNamespace(measure_read_bandwidth=measure_read_bandwidth)
    monkeypatch.setattr(hybridmoe, "_native", fake, raising=False)
    monkeypatch.setitem(sys.modules, "hybridmoe._native", fake)
    assert measure_host_read_bandwidth(buffer_bytes=64 * MIB, threads=3, passes=2) == 42e9
    assert asked == [(64 * MIB, 2)]


def test_the_portable_probe_measures_with_the_threads_asked_for(no_extension, monkeypatch):
    started = []
    real_thread = bandwidth.threading.Thread

    def counting_thread(*args, **kwargs):
        started.append(kwargs.get("name"))
        return real_thread(*args, **kwargs)

    monkeypatch.setattr(bandwidth.threading, "Thread", counting_thread)
    measured = measure_host_read_bandwidth(buffer_bytes=8 * MIB, threads=3, passes=2)
    assert 1e8 < measured < 1e13
    assert len(started) == 3
    started.clear()
    assert measure_host_read_bandwidth(buffer_bytes=1 * MIB, threads=1, passes=1) > 0
    assert started == []  # one thread: the caller's own


def test_the_real_extension_measures_something():
    pytest.importorskip("hybridmoe._native")
    assert 1e8 < measure_host_read_bandwidth(buffer_bytes=16 * MIB, passes=2) < 1e13


@pytest.mark.parametrize("extension", ["native", "portable"])
def test_the_probe_leaves_torch_alone(extension, request, monkeypatch):
    """Not imported, and, when the app has imported it, its thread settings untouched."""
    hide = "" if extension == "native" else "sys.modules['hybridmoe._native'] = None"
    code = textwrap.dedent(f"""
        import sys
        {hide}
        from hybridmoe.backend.hardware.bandwidth import measure_host_read_bandwidth
        measure_host_read_bandwidth(buffer_bytes=8 << 20, threads=2, passes=1)
        print('torch' in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

    torch = pytest.importorskip("torch")
    if extension == "portable":
        request.getfixturevalue("no_extension")

    def refuse(*_):
        raise AssertionError("the probe changed torch's process-wide thread count")

    before = torch.get_num_threads()
    monkeypatch.setattr(torch, "set_num_threads", refuse)
    monkeypatch.setattr(torch, "set_num_interop_threads", refuse)
    assert measure_host_read_bandwidth(buffer_bytes=8 * MIB, threads=2, passes=1) > 0
    assert torch.get_num_threads() == before


# A model generating on one thread while the probe runs again and again on another: the
# process must survive (a crash is a non-zero exit code here, not a dead test run) and the
# greedy answers must be the ones the model gives alone. Should it ever abort, every thread's
# native stack is printed (torch's fatal-signal handler; CI once saw an abort at exit here, with
# nothing but libstdc++'s "terminate called" to go on).
BESIDE_A_MODEL = """
import json, sys, threading
import torch
getattr(torch._C, '_set_print_stack_traces_on_fatal_signal', lambda _: None)(True)  # private: may go
if sys.argv[2] == "portable":
    sys.modules["hybridmoe._native"] = None
from hybridmoe.backend.text.sampling import SamplingParams
from hybridmoe.backend.engine.session import EngineBackend
from hybridmoe.backend.hardware import detect
from hybridmoe.backend.hardware.bandwidth import measure_host_read_bandwidth
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from hybridmoe.backend.session import Message

model = inspect_model(sys.argv[1])
plan = make(model.spec, model.inventory, detect(measure_bandwidth=False), Workload(context=512))
session = EngineBackend().load(sys.argv[1], plan)
greedy = SamplingParams(temperature=0.0, max_tokens=48)

def answer(text):
    return [e for e in session.generate([Message("user", text)], greedy)][-1].text

prompts = [f"question {i}: tell me about experts" for i in range(4)]
alone = [answer(p) for p in prompts]
done = threading.Event()
probes = [0]

def probe():
    while not done.is_set():
        measure_host_read_bandwidth(buffer_bytes=32 << 20, threads=2 + probes[0] % 2, passes=1)
        probes[0] += 1

prober = threading.Thread(target=probe)
prober.start()
try:
    beside = [answer(p) for p in prompts]
finally:
    done.set()
    prober.join()
print(json.dumps({"same": beside == alone, "probes": probes[0]}))
"""


@pytest.mark.parametrize("extension", ["native", "portable"])
def test_probing_beside_a_generating_model(tiny_chat_model, extension):
    if extension == "native":
        pytest.importorskip("hybridmoe._native")
    command = [sys.executable, "-X", "faulthandler", "-c", BESIDE_A_MODEL, str(tiny_chat_model), extension]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit code {out.returncode}: {out.stderr[-8000:]}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["probes"] >= 1
    assert result["same"]


def test_several_probes_keep_the_best_one(monkeypatch):
    """One probe taken while other work ran read 20 GB/s on a machine that delivers 45: the
    best of several probes, a pause apart, is the figure."""
    readings = iter([20e9, 45e9, 31e9, 44e9, 38e9])
    asked = []

    def measure_read_bandwidth(nbytes, passes):
        asked.append((nbytes, passes))
        return next(readings)

    fake = types.SimpleNamespace(measure_read_bandwidth=measure_read_bandwidth)
    monkeypatch.setattr(hybridmoe, "_native", fake, raising=False)
    monkeypatch.setitem(sys.modules, "hybridmoe._native", fake)
    assert measure_host_read_bandwidth(buffer_bytes=64 * MIB, passes=2, probes=5, pause_s=0) == 45e9
    assert asked == [(64 * MIB, 2)] * 5


def test_the_real_probes_spread_and_the_best_is_kept():
    pytest.importorskip("hybridmoe._native")
    best = measure_host_read_bandwidth(buffer_bytes=16 * MIB, passes=1, probes=3, pause_s=0.01)
    assert 1e8 < best < 1e13
