"""Vocabularies without a tokenizer.json: Kimi K2's tiktoken rank file becomes a byte-level
BPE GGUF vocabulary under llama.cpp's "kimi-k2" pre-tokenizer; unknown pre-tokenizers are
refused rather than mis-tokenized."""

from __future__ import annotations

import base64
import json

import pytest
from tokenizers import Regex, Tokenizer, pre_tokenizers

from hybridmoe.backend.convert.vocab import vocab_from_hf
from hybridmoe.backend.errors import UnsupportedModelError
from tests.convert.conftest import train_byte_level_bpe


def _byte_decoder() -> dict[str, int]:
    from hybridmoe.backend.text.tokenizer import _bytes_to_unicode

    return {c: b for b, c in _bytes_to_unicode().items()}


def test_kimi_tiktoken_vocabulary(tmp_path):
    bpe = train_byte_level_bpe()
    decode = _byte_decoder()
    added = bpe.get_added_tokens_decoder()
    ranks = [(bytes(decode[c] for c in tok), i) for tok, i in bpe.get_vocab(with_added_tokens=False).items()
             if i not in added]
    ranks.sort(key=lambda r: r[1])
    lines = [f"{base64.b64encode(b).decode()} {rank}" for rank, (b, _) in enumerate(ranks)]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True},
                                 str(n + 1): {"content": "[EOS]", "special": True},
                                 str(n + 4): {"content": "<|im_end|>", "special": True}},
        "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    vocab = vocab_from_hf(tmp_path, "deepseek", vocab_size=n + 256)
    assert vocab.model == "gpt2" and vocab.pre == "kimi-k2"
    assert len(vocab.tokens) == n + 256 and vocab.merges
    assert vocab.tokens[n] == "[BOS]" and vocab.types[n] == 3  # CONTROL
    assert vocab.tokens[n + 2] == f"<|reserved_token_{n + 2}|>"
    assert vocab.special_ids == {"bos": n, "eos": n + 1, "eot": n + 4}


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    tok = train_byte_level_bpe()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[a-z]+|\s+|."), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer"):
        vocab_from_hf(tmp_path, "qwen3_moe", vocab_size=Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size())
