"""IncrementalDetokenizer: pieces never split a character and add up to decode(all ids)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hybridmoe.backend.text.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

from .conftest import CORPUS, SAMPLES, train_sentencepiece_bpe, write_gguf_sentencepiece


@pytest.fixture(scope="module")
def byte_level(hf_dir: Path) -> Tokenizer:
    return load_tokenizer(hf_dir)


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    _, tokens, scores, types = train_sentencepiece_bpe()
    return load_tokenizer(write_gguf_sentencepiece(tmp_path_factory.mktemp("spm") / "spm.gguf", tokens, scores, types))


def stream(tok: Tokenizer, ids: list[int], skip_special: bool = False) -> list[str]:
    detok = tok.detokenizer(skip_special=skip_special)
    pieces = [detok.feed(i) for i in ids]
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    return pieces


TEXTS = SAMPLES + CORPUS + ["👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 中文字符和日本語かな, ﷽, 𝕏𝔸𝕄"]


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_streaming_real_text_never_splits_characters(name: str, request: pytest.FixtureRequest) -> None:
    tok: Tokenizer = request.getfixturevalue(name)
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces), (text, pieces)


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("skip_special", [False, True])
def test_streaming_random_ids_add_up_to_decode(name: str, skip_special: bool, request: pytest.FixtureRequest) -> None:
    """Random ids make invalid UTF-8 (lone continuation bytes, cut sequences, byte-fallback
    runs that never complete); the pieces must still concatenate to exactly decode()."""
    tok: Tokenizer = request.getfixturevalue(name)
    rng = random.Random(1234)
    byte_ids = sorted(tok.byte_fallback_ids)
    for _ in range(300):
        length = rng.randint(1, 24)
        if byte_ids and rng.random() < 0.5:  # favour byte-fallback runs
            ids = [rng.choice(byte_ids) if rng.random() < 0.7 else rng.randrange(tok.vocab_size) for _ in range(length)]
        else:
            ids = [rng.randrange(tok.vocab_size) for _ in range(length)]
        pieces = stream(tok, ids, skip_special)
        assert "".join(pieces) == tok.decode(ids, skip_special), ids


def test_emoji_split_over_byte_tokens_is_held_back(sentencepiece: Tokenizer) -> None:
    ids = sentencepiece.encode("a🦜b")
    assert sum(i in sentencepiece.byte_fallback_ids for i in ids) == 4  # F0 9F A6 9C
    detok = sentencepiece.detokenizer()
    out = [detok.feed(i) for i in ids]
    assert not any("\ufffd" in p for p in out)
    assert [p for p in out if p] == ["a", "🦜b"]  # the four byte tokens emit nothing on their own
    assert detok.flush() == ""


def test_byte_level_multi_token_characters(byte_level: Tokenizer) -> None:
    # A rare emoji is several byte-level tokens; nothing is emitted until it is whole.
    ids = byte_level.encode("🦜")
    assert len(ids) > 1
    detok = byte_level.detokenizer()
    out = [detok.feed(i) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "🦜"


def test_unfinished_character_is_flushed_as_replacement(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🦜")[:-1]
    detok = IncrementalDetokenizer(byte_level)
    assert "".join(detok.feed(i) for i in ids) == ""
    assert detok.flush() == byte_level.decode(ids) == "\ufffd"


def test_skip_special_hides_special_tokens(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("<|im_start|>assistant\n<think>x</think>ok<|im_end|>")
    assert "".join(stream(byte_level, ids, skip_special=True)) == "assistant\n<think>x</think>ok"


def test_endless_invalid_bytes_do_not_grow_the_window(byte_level: Tokenizer) -> None:
    from hybridmoe.backend.text.tokenizer import _bytes_to_unicode

    continuation = byte_level.token_to_id(_bytes_to_unicode()[0x80])  # a lone UTF-8 continuation byte
    detok = byte_level.detokenizer()
    pieces = [detok.feed(continuation) for _ in range(100)]
    first = next(i for i, p in enumerate(pieces) if p)
    assert first <= IncrementalDetokenizer.MAX_HELD_TOKENS
    assert "".join(pieces) + detok.flush() == byte_level.decode([continuation] * 100)
