"""Fixtures every test package may use."""

from __future__ import annotations

import pytest


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
