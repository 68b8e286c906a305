"""What the converter does when it cannot or should not finish: nothing half-written is left,
and the message names the problem and the way out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest

from hybridmoe.backend.convert import to_gguf
from hybridmoe.backend.errors import HybridMoeError, ModelError, UnsupportedModelError, UsageError
from hybridmoe.backend.session import Cancelled, CancelToken
from tests.app.test_cli import assert_clean_error, home  # noqa: F401
from tests.app.test_cli_failures import _read_only_folder


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_cancel_midway_leaves_no_file(checkpoints, tmp_path):
    token = CancelToken()
    events = []

    def on_progress(p):
        events.append(p)
        if p.done > 0:  # the first tensor is written: the temporary file exists
            assert any(n.endswith(".partial") for n in _listing(tmp_path))
            token.cancel()

    with pytest.raises(Cancelled):
        to_gguf(checkpoints("qwen3_moe").path, tmp_path / "out.gguf", "q8_0", on_progress=on_progress, cancel=token)
    assert _listing(tmp_path) == []
    assert events and events[-1].stage == "convert" and events[-1].unit == "B"
    assert 0 < events[-1].done < events[-1].total


def test_refuses_when_the_disk_is_too_small(checkpoints, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("hybridmoe.backend.convert.gguf_file.shutil.disk_usage", lambda _: usage(10**9, 10**9 - 5000, 5000))
    with pytest.raises(HybridMoeError) as info:
        to_gguf(checkpoints("qwen3_moe").path, tmp_path / "out.gguf", "bf16")
    message = str(info.value)
    assert "Not enough disk space" in message and "4.9 KiB is free" in message and "needs about" in message
    assert "--out" in message
    assert _listing(tmp_path) == []


def test_refuses_q4_k_m_without_room_for_its_intermediate(checkpoints, converted, tmp_path, monkeypatch):
    bf16_size = converted("mixtral", "bf16").stat().st_size
    usage = namedtuple("usage", "total used free")
    # Room for the bf16 file and its margin, but not for the Q4_K_M file next to it.
    free = bf16_size + 256 * 1024 * 1024 + 1000
    monkeypatch.setattr("hybridmoe.backend.convert.gguf_file.shutil.disk_usage", lambda _: usage(10**12, 0, free))
    with pytest.raises(HybridMoeError, match="BF16 intermediate"):
        to_gguf(checkpoints("mixtral").path, tmp_path / "out.gguf", "q4_k_m")
    assert _listing(tmp_path) == []


def test_unsupported_architecture(tmp_path):
    dense = tmp_path / "llama"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        to_gguf(dense, tmp_path / "out.gguf", "q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama"]


def test_unsupported_family_lists_the_supported_ones():
    from hybridmoe.backend.convert.hparams import gguf_arch

    with pytest.raises(UnsupportedModelError) as info:
        gguf_arch("qwen3_next", "somewhere/config.json")
    message = str(info.value)
    assert "qwen3_next" in message
    for family in ("deepseek", "glm4_moe", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"):
        assert family in message


@pytest.mark.parametrize(("family", "edit", "match"), [
    # llama.cpp's glm4moe graph takes the top-k over all experts.
    ("glm4_moe", {"n_group": 4, "topk_group": 2}, "group-limited routing"),
    # ... and its gpt-oss graph slides on a fixed period of layers.
    ("gpt_oss", {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, "period"),
    ("gpt_oss", {"swiglu_limit": 5.0}, "swiglu"),
])
def test_glm_and_gpt_oss_configs_llama_cpp_cannot_represent(family, edit, match, checkpoints, tmp_path):
    ck = shutil.copytree(checkpoints(family).path, tmp_path / "ck")
    config = json.loads((ck / "config.json").read_text())
    config.update(edit)
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=match):
        to_gguf(ck, tmp_path / "out.gguf", "q8_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_config_llama_cpp_cannot_represent_is_refused(checkpoints, tmp_path):
    ck = shutil.copytree(checkpoints("qwen3_moe").path, tmp_path / "ck")
    config = json.loads((ck / "config.json").read_text())
    config["norm_topk_prob"] = False
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob"):
        to_gguf(ck, tmp_path / "out.gguf", "q8_0")
    assert not (tmp_path / "out.gguf").exists()


def test_corrupt_shard_is_named(checkpoints, tmp_path):
    ck = shutil.copytree(checkpoints("qwen3_moe").path, tmp_path / "ck")
    shard = ck / "model.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with pytest.raises(ModelError, match="model.safetensors") as info:
        to_gguf(ck, tmp_path / "out.gguf", "q8_0")
    assert "truncated" in str(info.value)
    assert not (tmp_path / "out.gguf").exists()


def test_bad_arguments(checkpoints, tmp_path):
    with pytest.raises(UsageError, match="q3_k"):
        to_gguf(checkpoints("qwen3_moe").path, tmp_path / "out.gguf", "q3_k")
    with pytest.raises(UsageError, match="does not exist"):
        to_gguf(checkpoints("qwen3_moe").path, tmp_path / "missing" / "out.gguf", "q8_0")
    with pytest.raises(ModelError, match="does not exist"):
        to_gguf(tmp_path / "nothing", tmp_path / "out.gguf", "q8_0")


# ---- outputs that cannot be written ----------------------------------------------------------


def test_converting_into_a_read_only_folder_says_so(home, tmp_path, checkpoints):
    folder, prefix = _read_only_folder(tmp_path)
    r = subprocess.run([*prefix, "hybridmoe", "convert", str(checkpoints("qwen3_moe").path), "--out", str(folder / "m.gguf")],
                       capture_output=True, text=True, env=home, timeout=300)
    assert_clean_error(r, 1)
    assert f"cannot write {folder / 'm.gguf'}: permission denied" in r.stderr
    assert list(folder.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB file system of its own (tmpfs; needs the right to mount, as root in a container)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small file system here")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_disk_that_fills_during_convert_is_called_full(small_disk, checkpoints, monkeypatch):
    """The space was there when checked and is gone mid-write (another program took it): numpy's
    short write ("262144 requested and 107776 written") becomes "the disk is full" and how much
    the file needs."""
    from hybridmoe.backend.convert import converter, to_gguf
    from hybridmoe.backend.errors import HybridMoeError

    monkeypatch.setattr(converter, "check_free_space", lambda *a, **k: None)  # as if it had fit then
    with pytest.raises(HybridMoeError) as info:
        to_gguf(checkpoints("qwen3_moe").path, small_disk / "m.gguf", "bf16")
    message = str(info.value)
    assert "the disk is full" in message and "The file needs" in message and "requested" not in message
    assert list(small_disk.iterdir()) == []  # the partial file is gone
