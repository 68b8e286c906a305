"""`hybridmoe convert`: the file and its path on stdout; Ctrl-C exits 130 leaving nothing."""

from __future__ import annotations

import os
import signal

from app import cli


def test_convert_command(checkpoints, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    rc = cli.main(["convert", str(checkpoints("qwen3_moe").path), "--to", "gguf", "--quant", "q4_0", "--out", str(out)])
    assert rc == 0 and out.is_file()
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "Q4_0" in captured.err


def test_ctrl_c_cancels_cleanly(checkpoints, tmp_path, capsys, monkeypatch):
    from app.convert_render import ConvertProgress

    shown = ConvertProgress.__call__

    def interrupt_once_started(self, p):
        shown(self, p)
        if p.done > 0 and not getattr(self, "interrupted", False):
            self.interrupted = True
            os.kill(os.getpid(), signal.SIGINT)  # what the terminal sends on Ctrl-C

    monkeypatch.setattr(ConvertProgress, "__call__", interrupt_once_started)
    rc = cli.main(["convert", str(checkpoints("qwen3_moe").path), "--quant", "q8_0", "--out", str(tmp_path / "m.gguf")])
    assert rc == 130
    assert list(tmp_path.iterdir()) == []
    assert "cancelled" in capsys.readouterr().err


def test_convert_usage_errors(capsys):
    try:
        cli.main(["convert", "somewhere", "--quant", "q3_k"])
    except SystemExit as e:
        assert e.code == 2
    assert "invalid choice" in capsys.readouterr().err
