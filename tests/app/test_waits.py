"""Every wait of a second or more says what it is doing (#48 item 11): `run` (reading the model,
loading PyTorch, planning, reading the prompt) and `doctor` (the bandwidth probe, llama.cpp)
on a terminal; nothing extra when stderr is a pipe or a log."""

from __future__ import annotations

import os
import pty
import subprocess

from tests.app.test_cli import home  # noqa: F401 - a fixture


def run_with_a_terminal(args: list[str], env: dict) -> tuple[int, str, str]:
    """(exit code, what the terminal on stderr showed, stdout)."""
    terminal, stderr = pty.openpty()
    proc = subprocess.Popen(["hybridmoe", *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr,
                            env=env)
    os.close(stderr)
    shown = b""
    while True:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        shown += chunk
    os.close(terminal)
    stdout = proc.stdout.read().decode()
    return proc.wait(timeout=300), shown.decode(errors="replace"), stdout


def test_run_says_what_it_waits_for(home, tiny_chat_model):
    args = ["run", "-m", str(tiny_chat_model), "-p", "hi", "--max-tokens", "2", "--context", "256",
            "--temperature", "0"]
    code, shown, _ = run_with_a_terminal(args, home)
    assert code == 0, shown
    for doing in ("reading the model's files …", "loading PyTorch …", "planning the layout …", "reading the prompt …"):
        assert f"hybridmoe: {doing}" in shown, shown
    piped = subprocess.run(["hybridmoe", *args], capture_output=True, text=True, env=home, timeout=300)
    assert "loading PyTorch" not in piped.stderr  # a log gets no progress lines


def test_doctor_says_it_measures_the_bandwidth(home):
    code, shown, stdout = run_with_a_terminal(["doctor"], home)
    assert code == 0 and "CPU" in stdout
    assert "hybridmoe: detecting the hardware and measuring the memory bandwidth" in shown, shown
    assert "hybridmoe: asking llama.cpp" in shown
    assert shown.endswith("\r\x1b[K")  # cleared before the report
