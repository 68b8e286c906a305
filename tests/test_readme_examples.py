"""Every example in README.md runs as written, or says here why it cannot run in a test.

The examples are read from the README itself: the fenced ``sh``, ``toml`` and ``python``
blocks and the inline `` `hybridmoe ...` `` commands. Each one must be listed below, either
with what it is run as or with why it is skipped, so a new example cannot go untested
unnoticed. The runnable ones run in a scratch folder laid out as the examples assume: the
tiny chat model at ``~/models/Qwen3-30B-A3B`` (``HOME`` is the scratch folder), its GGUF
as ``model.gguf``, its ``config.json``, the Kimi K2.6 config the catalogue ships at
``path/to/Kimi-K2.6/config.json``, ``notes.txt``, and the README's hardware description as
``my-box.toml``. Nothing needs a GPU or the network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

# ---- the examples, as the README writes them -----------------------------------------------


def fenced_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, re.MULTILINE | re.DOTALL)


def shell_commands() -> list[str]:
    """Each command line of the ``sh`` blocks, backslash continuations joined."""
    commands = []
    for block in fenced_blocks("sh"):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip():
                commands.append(re.sub(r"\s+", " ", command.strip()))
    return commands


def inline_commands() -> set[str]:
    return set(re.findall(r"`(hybridmoe(?: [^`]*)?)`", README))


# ---- what each example is run as ------------------------------------------------------------

INSTALLS = "installs packages from the network (minutes, and not on a test machine)"
OPENS_THE_UI = "opens the terminal UI, which needs a terminal; tests/tui drives the UI itself"
BENCHMARK = "a benchmark (minutes of timed CPU work), not a test"

# Shell lines skipped, and why.
SKIPPED_SHELL = {
    "pip install --extra-index-url https://download.pytorch.org/whl/cpu . && hybridmoe # no NVIDIA GPU":
        INSTALLS + "; " + OPENS_THE_UI,
    "pip install . && hybridmoe # an NVIDIA GPU and its driver": INSTALLS + "; " + OPENS_THE_UI,
    "uv venv && uv pip install --torch-backend auto . && .venv/bin/hybridmoe # either: uv picks the build":
        INSTALLS + "; " + OPENS_THE_UI,
    'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q': "it installs and runs this very suite",
    "uv tool install . # or: pipx install .": INSTALLS + "; packaging/check_wheel.sh checks the installed command",
    'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python # NVIDIA': INSTALLS,
    'CMAKE_ARGS="-DGGML_HIP=on" pip install --force-reinstall --no-cache-dir llama-cpp-python # AMD ROCm': INSTALLS,
    'CMAKE_ARGS="-DGGML_VULKAN=on" pip install --force-reinstall --no-cache-dir llama-cpp-python # Vulkan': INSTALLS,
}
# The serve example and the two clients of it run together (test_serve_and_its_clients).
SERVE = "hybridmoe serve -m ~/models/Qwen3-30B-A3B # http://127.0.0.1:8000/v1 until Ctrl-C"
CURL = ("curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": "
        "\"Qwen3-30B-A3B\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 100}'")


def _json_answer(out: str) -> bool:
    answer = json.loads(out)  # one object: the text, the token ids, the statistics
    return answer["finish_reason"] in ("stop", "length") and bool(answer["token_ids"]) and "stats" in answer


def _a_plan(out: str) -> bool:
    return "Fits:" in out and "llama-server" in out


# Shell lines run as written, each with a check of its output beyond exit code 0.
RUN_SHELL = {
    "hybridmoe --version": lambda out: out.startswith("hybridmoe "),
    'hybridmoe plan path/to/Kimi-K2.6/config.json --hardware "4x RTX PRO 6000" --context 65536': _a_plan,
    "hybridmoe plan model.gguf --users 4 --backend llamacpp --kv-dtype fp8 --save plan.toml": _a_plan,
    "hybridmoe plan config.json --hardware this --ram 1.5TB --host-bandwidth 1229GB/s": _a_plan,
    'hybridmoe plan config.json --hardware "2x RTX 3090" --ram 128GiB': _a_plan,
    'hybridmoe plan model.gguf --hardware "RTX 4090" --backend llamacpp --n-cpu-moe 1':
        lambda out: _a_plan(out) and "--n-cpu-moe 1" in out and "expected" in out,
    'hybridmoe run -m ~/models/Qwen3-30B-A3B -p "Explain MoE offload in two sentences"': lambda out: out.strip(),
    'echo "Summarise this" | hybridmoe run -m model.gguf --json': _json_answer,
    "cat notes.txt | hybridmoe run -m model.gguf - # '-' (or -p -): the prompt from standard input":
        lambda out: out.strip(),
}

# Inline commands: the runnable ones as written, synopses and fragments filled in (the
# options they name are also checked against the parser), the others skipped with a reason.
RUN_INLINE = {
    "hybridmoe doctor": "hybridmoe doctor",
    "hybridmoe doctor [--json] [--no-bandwidth]": "hybridmoe doctor --json --no-bandwidth",
    "hybridmoe inspect MODEL [--json] [--format F] [--check]": "hybridmoe inspect config.json --json --format q4_k_m"
        " && hybridmoe inspect model.gguf --check",
    "hybridmoe models --catalogue": "hybridmoe models --catalogue",
    "hybridmoe plan MODEL [options]": "hybridmoe plan model.gguf --hardware my-box.toml",
    "hybridmoe plan --json": "hybridmoe plan model.gguf --json",
    "hybridmoe models [--json] [--add DIR] [--remove DIR] [--catalogue]":
        "hybridmoe models --add ~/models && hybridmoe models --json && hybridmoe models --remove ~/models"
        " && hybridmoe models --catalogue --json",
    "hybridmoe run -m MODEL -p PROMPT": "hybridmoe run -m model.gguf -p 'Hello' --max-tokens 8",
}
SKIPPED_INLINE = {
    "hybridmoe": OPENS_THE_UI,
    "hybridmoe pull REPO [--quant Q4_K_M] [--revision R]": "downloads from the Hugging Face Hub; tests/hub fakes it",
    "hybridmoe pull qwen3-30b-a3b": "downloads from the Hugging Face Hub; tests/hub/test_catalogue.py checks the choice",
    "hybridmoe serve -m MODEL": "run as the serve example (test_serve_and_its_clients)",
    "hybridmoe convert MODEL --to gguf --quant {bf16,q8_0,q4_0,q4_k_m} [--out PATH] [--force]":
        "run by the scratch folder's set-up, which makes model.gguf with `hybridmoe convert`",
    "hybridmoe plan --strategy frequency --stats FILE":
        "needs expert statistics recorded by a chat; tests/plan and tests/engine cover the strategy",
    "hybridmoe bench kernels": BENCHMARK,
    "hybridmoe bench generate": BENCHMARK,
    "hybridmoe bench generate FILE.gguf": BENCHMARK,
    "hybridmoe bench generate FILE --plan PLAN": BENCHMARK + "; tests/bench/test_gpu_side_by_side.py runs it tiny",
    "hybridmoe bench serve FILE.gguf": BENCHMARK,
}


def test_every_example_is_run_or_skipped_with_a_reason():
    shell = set(shell_commands())
    known_shell = set(SKIPPED_SHELL) | set(RUN_SHELL) | {SERVE, CURL}
    assert shell - known_shell == set(), "a README example this test does not know: run it here"
    assert known_shell - shell == set(), "an example listed here is no longer in the README"
    inline = inline_commands()
    known_inline = set(RUN_INLINE) | set(SKIPPED_INLINE)
    assert inline - known_inline == set(), "a README command this test does not know: run it here"
    assert known_inline - inline == set(), "a command listed here is no longer in the README"
    assert len(fenced_blocks("toml")) == 1 and len(fenced_blocks("python")) == 1


def _subcommand_options(words: list[str]) -> set[str]:
    """The options the parser of `hybridmoe WORDS...` knows (argparse keeps no public list)."""
    import argparse

    from hybridmoe.app.cli import build_parser

    parser = build_parser()
    for word in words:
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = subcommands.choices[word]
    return set(parser._option_string_actions)


@pytest.mark.parametrize("synopsis", sorted(inline_commands() - {"hybridmoe"}))
def test_inline_commands_name_options_that_exist(synopsis):
    words = synopsis.split()[1:]
    command = words[:2] if words[0] == "bench" else words[:1]
    options = set(re.findall(r"(--[a-z][a-z-]*|-[a-z])\b", synopsis))
    assert options <= _subcommand_options(command), synopsis


# ---- the scratch folder the examples run in ------------------------------------------------


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """The tiny chat model of tests/conftest.py with experts in every layer, as the real
    Qwen3-30B-A3B has them (a dense first layer has no place in a qwen3moe GGUF)."""
    from hybridmoe.backend.text import tokenizer as tokenizer_module
    from tests.engine.conftest import make_checkpoint
    from tests.text.conftest import QWEN_TEMPLATE, train_byte_level_bpe, write_hf_dir

    out = tmp_path_factory.mktemp("Qwen3-30B-A3B")
    tokenizer = train_byte_level_bpe(tokenizer_module._QWEN2)
    make_checkpoint("qwen3_moe", out, vocab_size=tokenizer.get_vocab_size(), mlp_only_layers=[])
    write_hf_dir(out, tokenizer, {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
                                  "chat_template": QWEN_TEMPLATE})
    return out


@pytest.fixture(scope="module")
def world(chat_checkpoint, tmp_path_factory):
    """(folder, environment) laid out as the examples assume."""
    from hybridmoe.backend.hub.catalogue import load

    home = tmp_path_factory.mktemp("readme-home")
    (home / "models").mkdir()
    (home / "models" / "Qwen3-30B-A3B").symlink_to(chat_checkpoint, target_is_directory=True)
    shutil.copy(chat_checkpoint / "config.json", home / "config.json")
    kimi = home / "path" / "to" / "Kimi-K2.6"
    kimi.mkdir(parents=True)
    shutil.copy(load().find("kimi-k2.6").config_path, kimi / "config.json")
    (home / "notes.txt").write_text("Mixture-of-Experts models route each token to a few experts.\n")
    (home / "my-box.toml").write_text(fenced_blocks("toml")[0])

    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "HF_", "HYBRIDMOE_"))}
    env.update(HOME=str(home), HF_HOME=str(home / "hf"), HF_HUB_OFFLINE="1",
               XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_STATE_HOME=str(home / ".local/state"), XDG_CACHE_HOME=str(home / ".cache"),
               PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    # `hybridmoe` as the console script runs it (hybridmoe.app.cli:main), whatever the PATH held before.
    bin_dir = home / "bin"
    bin_dir.mkdir()
    (bin_dir / "hybridmoe").write_text('#!/bin/sh\nexec "$PYTHON" -m hybridmoe.app.cli "$@"\n')
    (bin_dir / "hybridmoe").chmod(0o755)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    converted = _sh(f"hybridmoe convert {chat_checkpoint} --to gguf --quant q8_0 --out model.gguf", home, env)
    assert converted.returncode == 0, converted.stderr
    return home, env


def _sh(command: str, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.mark.parametrize("command", list(RUN_SHELL))
def test_shell_examples_run(world, command):
    home, env = world
    done = _sh(command, home, env)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    assert RUN_SHELL[command](done.stdout), (command, done.stdout[-2000:])


@pytest.mark.parametrize("example", list(RUN_INLINE))
def test_inline_examples_run(world, example):
    home, env = world
    done = _sh(RUN_INLINE[example], home, env)
    assert done.returncode == 0, (RUN_INLINE[example], done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr


def test_the_hardware_description_example_plans(world):
    """The README's TOML machine, with `--hardware my-box.toml` as it says."""
    home, env = world
    done = _sh("hybridmoe plan config.json --hardware my-box.toml --json", home, env)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["hardware"] == "2x RTX PRO 6000 workstation"
    assert plan["devices"][0]["name"] == "cuda:0 NVIDIA RTX PRO 6000 Blackwell"
    assert plan["host_ram_usable_bytes"] == 768 << 30
    assert plan["host_bandwidth_bytes_per_s"] == 12 * 5600e6 * 8  # channels × mts × 8 B, as the comment says
    assert plan["decode_tokens_per_s_expected"] < plan["decode_tokens_per_s_upper_bound"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


COUNT_PRINTS = """
import builtins, runpy, sys
printed = 0
_print = builtins.print
def counting(*args, **kwargs):
    global printed
    printed += 1
    _print(*args, **kwargs)
builtins.print = counting
runpy.run_path({script!r}, run_name="__main__")
sys.stderr.write(f"chunks printed: {{printed}}")
"""


def test_serve_and_its_clients(world):
    """The serve example and its curl and Python clients. The one change: the port, 8000 in
    the README, is a free one here, since other tests may run beside this one."""
    home, env = world
    port = _free_port()
    at = lambda text: text.replace("127.0.0.1:8000", f"127.0.0.1:{port}")  # noqa: E731
    server = subprocess.Popen(["bash", "-c", "exec " + SERVE.split(" #")[0] + f" --port {port}"],
                              cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.communicate()[1][-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as health:
                    if json.load(health)["status"] == "ok":
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)

        if shutil.which("curl"):
            done = _sh(at(CURL), home, env, timeout=120)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout)["choices"][0]["message"]["role"] == "assistant"
        pytest.importorskip("openai")
        client = home / "client.py"
        client.write_text(at(fenced_blocks("python")[0]))
        # The example prints each streamed chunk's text; a random tiny model may sample its
        # end of turn first (an empty answer: once in CI), so the chunks are counted instead.
        counted = home / "counted.py"
        counted.write_text(COUNT_PRINTS.format(script=str(client)))
        done = subprocess.run([sys.executable, str(counted)], cwd=home, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert int(done.stderr.split("chunks printed: ")[-1]) >= 2, done.stderr  # at least the role and the end
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C, as the example says
        try:
            out, err = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            out, err = server.communicate()
    assert server.returncode == 0, err[-3000:]
