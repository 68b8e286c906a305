"""Fixtures for the hub tests: a fake Hub, an isolated home, tiny repositories.

huggingface-hub 2.4 reads HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE into
``huggingface_hub.constants`` when it is first imported, which in a test session has long
happened; so the tests patch those constants (every call reads them from the module at call
time: ``hf_hub_url``, ``HfApi()``, ``is_offline_mode()``, ``get_token()``), and set the
environment variables too for code that reads them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from tests.hub.fakehub import FakeHub

TINY_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
    "torch_dtype": "float16", "rms_norm_eps": 1e-5, "rope_theta": 1e6,
}


def tiny_checkpoint_files() -> dict[str, bytes]:
    """A two-shard tiny Mixtral checkpoint (with its index and tokenizer files), as bytes."""
    from safetensors.numpy import save

    h, i, experts, vocab = 64, 32, 4, 128
    rng = np.random.default_rng(0)
    t: dict[str, np.ndarray] = {}

    def put(name, *shape):
        t[name] = rng.standard_normal(shape).astype(np.float16)

    put("model.embed_tokens.weight", vocab, h)
    put("model.norm.weight", h)
    put("lm_head.weight", vocab, h)
    for layer in range(2):
        p = f"model.layers.{layer}"
        put(f"{p}.input_layernorm.weight", h)
        put(f"{p}.post_attention_layernorm.weight", h)
        put(f"{p}.self_attn.q_proj.weight", 64, h)
        put(f"{p}.self_attn.k_proj.weight", 32, h)
        put(f"{p}.self_attn.v_proj.weight", 32, h)
        put(f"{p}.self_attn.o_proj.weight", h, 64)
        put(f"{p}.block_sparse_moe.gate.weight", experts, h)
        for e in range(experts):
            put(f"{p}.block_sparse_moe.experts.{e}.w1.weight", i, h)
            put(f"{p}.block_sparse_moe.experts.{e}.w3.weight", i, h)
            put(f"{p}.block_sparse_moe.experts.{e}.w2.weight", h, i)
    names = sorted(t)
    half = len(names) // 2
    files: dict[str, bytes] = {}
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"model-{k:05d}-of-00002.safetensors"
        files[shard] = save({n: t[n] for n in part})
        weight_map.update({n: shard for n in part})
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    files["config.json"] = json.dumps(TINY_CONFIG).encode()
    files["generation_config.json"] = b'{"eos_token_id": 2}'
    files["tokenizer_config.json"] = b'{"eos_token": "</s>"}'
    files["tokenizer.json"] = b'{"version": "1.0", "model": {"type": "BPE"}}'
    files["chat_template.jinja"] = b"{% for m in messages %}{{ m.content }}{% endfor %}"
    return files


# What the selection must leave on the Hub: pickles, another layout, duplicates, code, docs.
JUNK = {
    "original/consolidated.00.pth": b"pickle" * 400,
    "original/params.json": b"{}",
    "pytorch_model.bin": b"pickle" * 400,
    "consolidated.safetensors": b"dup" * 500,
    "onnx/model.onnx": b"onnx" * 300,
    "modeling_mixtral.py": b"import os  # never downloaded, never run",
    "README.md": b"# tiny",
    "model-Q4_0.gguf": b"GGUF" + b"\0" * 2000,
}


@pytest.fixture(scope="session")
def checkpoint_files() -> dict[str, bytes]:
    return tiny_checkpoint_files()


@pytest.fixture(scope="session")
def gguf_bytes(tmp_path_factory) -> dict[str, bytes]:
    """A tiny qwen3moe GGUF, single and split in 3 parts, as bytes."""
    from tests.models.conftest import write_qwen3moe_gguf

    root = tmp_path_factory.mktemp("gguf-src")
    (root / "single").mkdir()
    (root / "split").mkdir()
    single = write_qwen3moe_gguf(root / "single" / "tiny.gguf")
    parts = write_qwen3moe_gguf(root / "split" / "tiny.gguf", split_max_tensors=20)
    out = {"single": single[0].read_bytes()}
    for k, p in enumerate(parts, start=1):
        out[f"part{k}"] = p.read_bytes()
    out["n_parts"] = str(len(parts)).encode()
    return out


def gguf_repo_files(gguf_bytes) -> dict[str, bytes]:
    """A GGUF repository: Q8_0 single file, a split Q4_K_M set in a folder, a Q2_K file and
    a multimodal projector (not a model)."""
    n = int(gguf_bytes["n_parts"])
    files = {
        "README.md": b"# tiny GGUF",
        "tiny-Q8_0.gguf": gguf_bytes["single"],
        "tiny-Q2_K.gguf": gguf_bytes["single"],
        "mmproj-tiny-F16.gguf": b"GGUF" + b"\0" * 1500,
    }
    for k in range(1, n + 1):
        files[f"Q4_K_M/tiny-Q4_K_M-{k:05d}-of-{n:05d}.gguf"] = gguf_bytes[f"part{k}"]
    return files


class _NoSleep:
    """huggingface-hub waits 1 s before resuming a broken transfer; the tests need not."""

    def __getattr__(self, name):
        return getattr(time, name)

    @staticmethod
    def sleep(_seconds):
        pass


@pytest.fixture
def fake_hub():
    hub = FakeHub()
    yield hub
    hub.close()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """Settings, data dir, HOME and the HF cache in tmp_path; no token; online."""
    from huggingface_hub import constants

    home = tmp_path / "home"
    home.mkdir()
    hf_home = tmp_path / "hf"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HYBRIDMOE_CONFIG", str(tmp_path / "config" / "settings.toml"))
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "OLLAMA_MODELS", "HF_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(hf_home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(hf_home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(hf_home / ".agent_harnesses.json"))
    from huggingface_hub import file_download

    monkeypatch.setattr(file_download, "time", _NoSleep())
    return home


@pytest.fixture
def hub(fake_hub, home, monkeypatch) -> FakeHub:
    """The fake Hub, with huggingface-hub pointed at it."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", fake_hub.endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", fake_hub.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        fake_hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    return fake_hub


@pytest.fixture
def cache_dir(home) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)
