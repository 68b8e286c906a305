"""`hybridmoe convert`: the file and its path on stdout, the types its tensors took; Ctrl-C
exits 130 leaving nothing."""

from __future__ import annotations

import os
import signal

from hybridmoe.app import cli
from tests.convert.conftest import build_checkpoint, needs_llama_cpp


def test_convert_command(checkpoints, tmp_path, capsys):
    out = tmp_path / "model.gguf"
    rc = cli.main(["convert", str(checkpoints("qwen3_moe").path), "--to", "gguf", "--quant", "q4_0", "--out", str(out)])
    assert rc == 0 and out.is_file()
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    # Every matrix row of the tiny model is whole 32-weight blocks: all of them took Q4_0
    # (the head Q8_0, as llama.cpp stores it), vectors and routers F32.
    assert f"Wrote {out} (" in captured.err and ", Q4_0; tensors: " in captured.err
    assert "Q8_0 1" in captured.err and "F32 " in captured.err and "did not take" not in captured.err


def test_the_summary_names_the_tensors_that_kept_another_type(tmp_path, capsys):
    # Expert rows of 40 weights are not whole Q8_0 blocks (32): those tensors stay F16.
    ck = build_checkpoint(tmp_path / "odd", "qwen3_moe", overrides={"moe_intermediate_size": 40}).path
    out = tmp_path / "odd.gguf"
    assert cli.main(["convert", str(ck), "--quant", "q8_0", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert ", Q8_0;" not in err  # the file is not simply "Q8_0"
    assert "2 weight tensors did not take Q8_0: their rows (40 weights) are not whole blocks of 32" in err
    assert "    F16 (2): blk.0-1.ffn_down_exps.weight" in err
    assert "F16 2" in err and "Q8_0 " in err


@needs_llama_cpp
def test_q4_k_m_on_rows_shorter_than_its_blocks_says_what_was_stored(checkpoints, tmp_path, capsys):
    # The tiny model's rows (32 to 96 weights) are all shorter than a K-quant block (256):
    # llama.cpp stores them Q5_0 / Q8_0 instead, and the summary must say so.
    out = tmp_path / "m.gguf"
    assert cli.main(["convert", str(checkpoints("qwen3_moe").path), "--quant", "q4_k_m", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "Q4_K_M;" not in err and "Q4_K " not in err
    assert "did not take Q4_K_M: their rows (" in err and "are not whole blocks of 256" in err
    assert "    Q5_0 (" in err and "blk.0-1.ffn_gate_exps.weight" in err


def test_ctrl_c_cancels_cleanly(checkpoints, tmp_path, capsys, monkeypatch):
    from hybridmoe.app.convert_render import ConvertProgress

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
