"""`hybridmoe pull` and `hybridmoe models` as a user runs them (against the fake Hub)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hybridmoe.app.cli import main
from tests.hub.conftest import gguf_repo_files


@pytest.fixture(autouse=True)
def no_bandwidth_probe(home, tmp_path):
    """`models --catalogue` plans for this machine; the settings skip the bandwidth probe."""
    settings = tmp_path / "config" / "settings.toml"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text("measure_bandwidth = false\n")


def test_pull_prints_the_files_then_the_path(hub, checkpoint_files, capsys):
    hub.add_repo("org/tiny", checkpoint_files)
    assert main(["pull", "org/tiny"]) == 0
    out, err = capsys.readouterr()
    path = out.strip()
    assert path.endswith("/snapshots/" + hub.repos["org/tiny"].commit)  # stdout: only the path
    assert "org/tiny @ main" in err and "model-00001-of-00002.safetensors" in err and "KiB" in err
    assert "\r" not in err  # not a terminal: no progress line

    assert main(["models", "--json"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)
    assert entry["name"] == "org/tiny" and entry["path"] == path and entry["family"] == "mixtral"


def test_pull_errors_exit_with_their_codes(hub, gguf_bytes, capsys):
    hub.add_repo("org/tiny-GGUF", gguf_repo_files(gguf_bytes))
    assert main(["pull", "org/tiny-GGUF"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridmoe: error: org/tiny-GGUF holds GGUF files in 3 quantizations")
    assert main(["pull", "org/missing"]) == 1
    assert "org/missing was not found" in capsys.readouterr().err
    assert main(["pull", "org/tiny-GGUF", "--quant", "Q4_K_M"]) == 0


def test_models_add_and_remove(home, tmp_path, gguf_bytes, capsys):
    d = tmp_path / "my models"
    d.mkdir()
    (d / "tiny-Q8_0.gguf").write_bytes(gguf_bytes["single"])
    assert main(["models", "--add", str(d)]) == 0
    out, err = capsys.readouterr()
    assert "Registered" in err and "tiny-Q8_0.gguf" in out and "qwen3_moe" in out
    assert main(["models"]) == 0
    assert "tiny-Q8_0.gguf" in capsys.readouterr().out
    assert main(["models", "--remove", str(d)]) == 0
    capsys.readouterr()
    assert main(["models"]) == 0
    assert "No models found" in capsys.readouterr().out
    assert main(["models", "--remove", str(d)]) == 2


def test_models_catalogue(home, capsys):
    assert main(["models", "--catalogue"]) == 0
    out = capsys.readouterr().out
    assert "kimi-k2.6" in out and "moonshotai/Kimi-K2.6" in out and "262,144" in out and "On this machine" in out
    assert main(["models", "--catalogue", "--json"]) == 0
    ids = [e["id"] for e in json.loads(capsys.readouterr().out)]
    assert "deepseek-v3" in ids and "gpt-oss-120b" in ids


def test_plan_and_inspect_take_catalogue_names(home, capsys):
    assert main(["plan", "kimi-k2.6", "--hardware", "4x H200 NVL", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["family"] == "deepseek" and plan["fits"]
    assert main(["inspect", "qwen3-30b-a3b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spec"]["family"] == "qwen3_moe"
    assert main(["plan", "no-such-model"]) == 2  # before any hardware probe


def test_ctrl_c_cancels_with_130_and_keeps_the_partial_file(hub, checkpoint_files, tmp_path):
    big = b"x" * 2_000_000
    hub.add_repo("org/slow", {**checkpoint_files, "model-00003-of-00003.safetensors": big})
    hub.file("org/slow", "model-00003-of-00003.safetensors").rate = 200_000  # 10 s if not cancelled
    env = dict(os.environ, HF_ENDPOINT=hub.endpoint)
    exe = shutil.which("hybridmoe")
    cmd = [exe] if exe else [sys.executable, "-m", "hybridmoe.app.cli"]
    proc = subprocess.Popen([*cmd, "pull", "org/slow"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    partial = tmp_path / "hf" / "hub" / "models--org--slow" / "blobs" / f"{hashlib.sha256(big).hexdigest()}.incomplete"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (partial.exists() and partial.stat().st_size > 0):
        time.sleep(0.05)  # until bytes of the big file arrive
    assert partial.exists(), "the download never started"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "cancelled" in err and "resume" in err and "Traceback" not in err
    assert 0 < partial.stat().st_size < len(big) and out == ""
