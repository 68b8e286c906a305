"""Failures a user meets at the command line that are not the model's fault: a --json command
that fails, a benchmark of a file that is not there, a plan saved under a name that lies about
its format, outputs that cannot be written (a read-only folder, a full disk, a closed stdout).
Each gets one clear message and a non-zero exit code, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.app.test_cli import KIMI, _without_root_privileges, assert_clean_error, home, run  # noqa: F401

CMD = ["hybridmoe"]


@pytest.mark.parametrize(
    "args, code, needle",
    [
        (["inspect", "/nonexistent/model.gguf", "--json"], 1, "/nonexistent/model.gguf"),
        (["plan", KIMI, "--hardware", "cpu-only", "--context", "99999999", "--json"], 1, "longer than"),
        (["plan", KIMI, "--users", "0", "--json"], 2, "must be 1 or more"),
        (["bench", "generate", "/nonexistent/model.gguf", "--json"], 2, "is not a file"),
        (["run", "-m", "/nonexistent/model.gguf", "-p", "hi", "--json"], 1, "/nonexistent/model.gguf"),
    ],
)
def test_a_failed_json_command_prints_the_error_as_json_on_stdout(home, args, code, needle):
    r = run(*args, env=home)
    assert_clean_error(r, code)
    error = json.loads(r.stdout)["error"]
    assert needle in error["message"] and error["exit_code"] == code
    assert needle in r.stderr  # and the usual message for the person watching


def test_bench_generate_of_a_missing_file_fails(home):
    r = run("bench", "generate", "nosuch.gguf", env=home)
    assert_clean_error(r, 2)
    assert "nosuch.gguf is not a file" in r.stderr


def test_bench_generate_exits_non_zero_when_a_backend_could_not_be_measured(home, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    r = run("bench", "generate", broken, "--rounds", "1", "--pairs", "0", "--backends", "engine", env=home,
            timeout=300)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "error" in r.stdout and "Traceback" not in r.stderr  # the table names what failed


@pytest.mark.parametrize("name", ["p.yaml", "p", "p.TOML.txt"])
def test_a_plan_is_saved_only_as_toml_or_json(home, tmp_path, name):
    r = run("plan", KIMI, "--hardware", "cpu-only", "--save", tmp_path / name, env=home)
    assert_clean_error(r, 2)
    assert ".toml or .json" in r.stderr
    assert list(tmp_path.iterdir()) == []


def _read_only_folder(tmp_path: Path) -> tuple[Path, list[str]]:
    prefix = _without_root_privileges()
    if prefix is None:
        pytest.skip("running as root without setpriv: a folder cannot be made read-only here")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder, prefix


def test_saving_a_plan_into_a_read_only_folder_says_so(home, tmp_path):
    folder, prefix = _read_only_folder(tmp_path)
    r = subprocess.run([*prefix, *CMD, "plan", str(KIMI), "--hardware", "cpu-only", "--save",
                        str(folder / "p.toml")], capture_output=True, text=True, env=home, timeout=120)
    assert_clean_error(r, 1)
    assert f"cannot write {folder / 'p.toml'}: permission denied" in r.stderr
    assert "internal error" not in r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_an_output_to_a_full_disk_says_so(home):
    with open("/dev/full", "w") as full:
        for args in (["doctor", "--no-bandwidth"], ["plan", str(KIMI), "--hardware", "cpu-only"]):
            r = subprocess.run([*CMD, *args], stdout=full, stderr=subprocess.PIPE, text=True, env=home, timeout=120)
            assert_clean_error(r, 1)
            assert "could not write the output: the disk is full" in r.stderr
            assert "Exception ignored" not in r.stderr and "internal error" not in r.stderr


def test_a_closed_stdout_is_named(home):
    r = subprocess.run([*CMD, "doctor", "--no-bandwidth"], stderr=subprocess.PIPE, text=True, env=home,
                       timeout=120, preexec_fn=lambda: os.close(1))
    assert_clean_error(r, 1)
    assert "the standard output is closed" in r.stderr


def set_gguf_number(path: Path, key: str, value) -> None:
    """Overwrite one numeric metadata value of a GGUF in place, as a damaged file has it."""
    import gguf

    field = gguf.GGUFReader(path, "r+").fields[key]
    field.parts[field.data[0]][0] = value


def test_a_gguf_with_zero_attention_heads_is_called_damaged(home, tmp_path):
    """head_count = 0 divided the hidden size by zero in inspect, run, plan, models and the TUI."""
    from tests.models.conftest import write_qwen3moe_gguf

    folder = tmp_path / "models"
    folder.mkdir()
    path = folder / "zero-heads.gguf"
    write_qwen3moe_gguf(path)
    set_gguf_number(path, "qwen3moe.attention.head_count", 0)
    for args in (["inspect", path], ["plan", path, "--hardware", "cpu-only"], ["run", "-m", path, "-p", "hi"]):
        r = run(*args, env=home)
        assert_clean_error(r, 1)
        assert f"'qwen3moe.attention.head_count' in {path} is 0; it must be 1 or more" in r.stderr
        assert "damaged" in r.stderr
    r = run("models", "--add", folder, env=home)  # listed with what is wrong, not a crash
    assert r.returncode == 0 and "internal error" not in r.stderr, r.stderr


def test_models_lists_the_default_model_the_terminal_ui_uses(home, tmp_path):
    """A model typed as a path in the wizard is the default; `models` said "No models found"
    while the UI listed it: both list what discover.list_local_models finds, it included."""
    from tests.models.conftest import write_qwen3moe_gguf

    path = tmp_path / "elsewhere" / "mine.gguf"
    path.parent.mkdir()
    write_qwen3moe_gguf(path)
    config = Path(home["XDG_CONFIG_HOME"]) / "hybridmoe"
    config.mkdir(parents=True)
    (config / "settings.toml").write_text(f'default_model = "{path}"\n')
    r = run("models", env=home)
    assert r.returncode == 0 and "mine.gguf" in r.stdout and "No models found" not in r.stdout, (r.stdout, r.stderr)
    listed = json.loads(run("models", "--json", env=home).stdout)
    assert (str(path), "path") in [(m["path"], m["source"]) for m in listed]
