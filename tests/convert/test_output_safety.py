"""Nothing the user has is lost by `hybridmoe convert`: an existing file is replaced only with
--force, a file of the checkpoint never; a conversion stopped by a signal leaves no partial
file, and the partial files of one killed outright are removed by the next conversion."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridmoe.app import cli
from hybridmoe.backend.convert import to_gguf
from hybridmoe.backend.errors import HybridMoeError, UsageError
from hybridmoe.backend.files import partial_path, sweep_stale_partials

REPO = Path(__file__).resolve().parents[2]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ---- item 1: existing files ------------------------------------------------------------------


def test_an_existing_output_is_replaced_only_with_force(checkpoints, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    out.write_text("the user's own file")
    args = ["convert", str(checkpoints("qwen3_moe").path), "--quant", "q8_0", "--out", str(out)]

    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"{out} already exists" in err and "--force" in err and "Traceback" not in err
    assert out.read_text() == "the user's own file"
    assert _listing(tmp_path) == ["model.gguf"]

    assert cli.main(args + ["--force"]) == 0
    assert out.read_bytes()[:4] == b"GGUF"
    assert _listing(tmp_path) == ["model.gguf"]


def test_the_default_output_is_not_replaced_either(checkpoints, tmp_path, capsys):
    ck = shutil.copytree(checkpoints("qwen3_moe").path, tmp_path / "tiny")
    existing = tmp_path / "tiny-Q8_0.gguf"  # what `convert tiny` writes by default
    existing.write_text("an earlier conversion")
    assert cli.main(["convert", str(ck), "--quant", "q8_0"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert existing.read_text() == "an earlier conversion"


def _cache_layout(src: Path, root: Path) -> Path:
    """A Hugging Face cache snapshot: every file a symlink into blobs/."""
    blobs, snapshot = root / "blobs", root / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = blobs / f"{i:040x}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.mark.parametrize("how", ["same path", "relative path", "symlink", "hard link", "cache blob"])
def test_never_writes_onto_a_file_of_the_checkpoint_even_with_force(how, checkpoints, tmp_path, monkeypatch, capsys):
    src = checkpoints("qwen3_moe").path
    if how == "cache blob":
        ck = _cache_layout(src, tmp_path / "models--org--tiny")
        victim = (ck / "model.safetensors").resolve()
        out = victim
    else:
        ck = shutil.copytree(src, tmp_path / "t2")
        victim = ck / {"same path": "model.safetensors", "relative path": "config.json",
                       "symlink": "tokenizer.json", "hard link": "tokenizer_config.json"}[how]
        out = victim
        if how == "relative path":
            monkeypatch.chdir(ck)
            out = Path("config.json")
        elif how == "symlink":
            out = tmp_path / "link.gguf"
            out.symlink_to(victim)
        elif how == "hard link":
            out = tmp_path / "hard.gguf"
            os.link(victim, out)
    before = {p: _digest(p) for p in ck.rglob("*") if p.is_file()}

    for force in ([], ["--force"]):
        rc = cli.main(["convert", str(ck), "--quant", "q8_0", "--out", str(out), *force])

        assert rc == 2
        err = capsys.readouterr().err
        assert "is a file of the checkpoint being converted" in err and "Traceback" not in err
        assert {p: _digest(p) for p in ck.rglob("*") if p.is_file()} == before
    assert not any(p.name.endswith(".partial") for p in tmp_path.rglob("*"))


def test_an_output_that_is_a_folder_is_refused(checkpoints, tmp_path):
    with pytest.raises(UsageError, match="is a folder"):
        to_gguf(checkpoints("qwen3_moe").path, tmp_path, "q8_0", overwrite=True)


def test_the_wizard_reuses_a_finished_conversion_and_keeps_an_older_file(checkpoints, tmp_path, monkeypatch):
    """The TUI converts into its own models folder under a fixed name: a finished conversion
    there is used again (Resume after it ended costs nothing), an older file is never replaced."""
    from hybridmoe.app.services import Services
    from hybridmoe.backend.hub.local import LocalModel

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("HYBRIDMOE_CONFIG", raising=False)
    ck = shutil.copytree(checkpoints("qwen3_moe").path, tmp_path / "tiny")
    model = LocalModel(name="org/tiny", path=ck, kind="safetensors", size_bytes=0, source="directory")
    services = Services()

    first = services.convert(model, "q8_0", None, None)
    written = first.stat().st_mtime_ns
    assert services.convert(model, "q8_0", None, None) == first
    assert first.stat().st_mtime_ns == written  # used as it is, not written again

    (ck / "config.json").touch()  # the checkpoint changed after the conversion (a newer download)
    os.utime(first, ns=(written - 10**9, written - 10**9))
    with pytest.raises(HybridMoeError, match="already exists, and is older than the checkpoint") as info:
        services.convert(model, "q8_0", None, None)
    assert "Delete it in Models" in str(info.value)
    assert first.stat().st_mtime_ns == written - 10**9


# ---- item 2: signals and the partial files they leave ----------------------------------------

# The CLI in a child process, each progress event after the first bytes slowed down, so that a
# signal sent once the marker exists arrives mid-conversion.
SLOW_CONVERT = """
import sys, time
from pathlib import Path
from hybridmoe.app import cli
from hybridmoe.app.convert_render import ConvertProgress

shown = ConvertProgress.__call__

def slowly(self, p):
    shown(self, p)
    if p.done > 0:
        Path(sys.argv[1]).touch()
        time.sleep(0.2)

ConvertProgress.__call__ = slowly
sys.exit(cli.main(sys.argv[2:]))
"""


def _start_slow_conversion(checkpoint: Path, out: Path, marker: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CONVERT, str(marker), "convert", str(checkpoint), "--quant", "q8_0",
         "--out", str(out)],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the conversion did not start writing:\n{proc.communicate()[1]}")
        time.sleep(0.05)
    assert (out.parent / f".{out.name}.{proc.pid}.partial").exists()
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_cancel_like_ctrl_c(signum, checkpoints, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "m.gguf"
    proc = _start_slow_conversion(checkpoints("qwen3_moe").path, out, tmp_path / "writing")

    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)

    assert proc.returncode == 128 + signum, stderr
    assert "hybridmoe: error: The conversion was cancelled" in stderr and "Traceback" not in stderr
    assert stdout == ""
    assert _listing(out_dir) == []


def test_the_next_conversion_removes_what_a_killed_one_left(checkpoints, tmp_path, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "m.gguf"
    proc = _start_slow_conversion(checkpoints("qwen3_moe").path, out, tmp_path / "writing")

    proc.kill()  # SIGKILL: nothing can clean up
    proc.communicate(timeout=60)
    left = f".m.gguf.{proc.pid}.partial"
    assert _listing(out_dir) == [left]

    assert cli.main(["convert", str(checkpoints("qwen3_moe").path), "--quant", "q8_0", "--out", str(out)]) == 0
    assert _listing(out_dir) == ["m.gguf"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_sweep_keeps_the_partial_files_of_live_writers(tmp_path):
    target = tmp_path / "m.gguf"
    ours = partial_path(target)  # this process, writing now
    ours.write_bytes(b"GGUF")
    intermediate = partial_path(tmp_path / "m.gguf.bf16")  # a Q4_K_M intermediate, and its own partial
    intermediate_partial = partial_path(intermediate)
    dead = _dead_pid()
    stale = [tmp_path / f".m.gguf.{dead}.partial", tmp_path / f".m.gguf.bf16.{dead}.partial",
             tmp_path / f"..m.gguf.bf16.{dead}.partial.{dead}.partial"]
    for p in [intermediate, intermediate_partial, *stale]:
        p.write_bytes(b"GGUF")
    # A file with the id of a live process that started after it was last written: its writer
    # was another process with the same id (ids are reused), long gone.
    reused = tmp_path / f".m.gguf.{os.getppid()}.partial"
    reused.write_bytes(b"GGUF")
    long_ago = time.time() - 10 * 365 * 86400
    os.utime(reused, (long_ago, long_ago))
    others = [tmp_path / f".other.gguf.{dead}.partial", tmp_path / f".m.gguf.{dead}.tmp", tmp_path / "m.gguf"]
    for p in others:
        p.write_bytes(b"keep")

    removed = sweep_stale_partials(target)

    assert sorted(removed) == sorted([*stale, reused])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in [ours, intermediate, intermediate_partial, *others])
