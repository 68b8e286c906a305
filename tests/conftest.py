"""Fixtures every test package may use."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _models_on_the_cpu_unless_named():
    """Models built without a device go to the CPU here, on a machine with a GPU too: the
    tests feed them CPU tensors and compare with CPU results; those that want CUDA name it,
    and scripts/gpu_check.py checks the GPU paths. (Run on an H200 without this, 130 of 493
    engine tests failed; the two read through were CPU inputs to a model built on the GPU.)"""
    from hybridmoe.backend.engine import model

    saved, model.default_device = model.default_device, lambda: "cpu"
    yield
    model.default_device = saved


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A complete tiny model a person could chat with: a random Qwen3-MoE checkpoint written
    by transformers, a byte-level BPE tokenizer trained on the fly, and a chat template
    (a few seconds, once per session)."""
    from hybridmoe.backend.text import tokenizer as tokenizer_module
    from tests.engine.conftest import make_checkpoint
    from tests.text.conftest import QWEN_TEMPLATE, train_byte_level_bpe, write_hf_dir

    out = tmp_path_factory.mktemp("tiny-qwen3-moe")
    tokenizer = train_byte_level_bpe(tokenizer_module._QWEN2)
    make_checkpoint("qwen3_moe", out, vocab_size=tokenizer.get_vocab_size())
    write_hf_dir(out, tokenizer, {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
                                  "chat_template": QWEN_TEMPLATE})
    return out
