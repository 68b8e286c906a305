"""Tiny tokenizers built on the fly: a byte-level BPE trained in milliseconds with `tokenizers`,
saved as a Hugging Face directory and as GGUF files that hold the same vocabulary."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import gguf
import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from hybridmoe.backend.text import tokenizer as tokenizer_module

CORPUS = [
    "Hello world! This is a tiny corpus for a tiny tokenizer. It's 2024; numbers 12345 and 3.14159.",
    "def add(a, b):\n    return a + b\n\nclass Foo:\n    pass\n\tindented with a tab\r\n",
    "你好，世界！这是一个测试。日本語のテキストです。カタカナ。한국어 텍스트.",
    "Emoji 😀😃🎉👍🏽 and flags 🇫🇷. Café naïve résumé — combining e\u0301 a\u0308 \u00e9.",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX'S DOG'LL RUN. I've, we're, they'd.",
    "Mixture-of-Experts models route each token to a few experts; the rest stay idle.",
    "<div class=\"x\">&amp; {\"key\": [1, 2, 3]}</div> $HOME ~/path/to/file.txt",
]

# Special tokens the hand-written chat templates in these tests use, plus non-special
# added tokens (<think>), as real vocabularies have them.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
    "<s>", "</s>", "[INST]", "[/INST]",
]
USER_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

SAMPLES = [
    "Hello world!",
    "  leading spaces and trailing   ",
    "It's THE fox's DOG'LL run; we've 1234567 tokens, 3.14159 and $HOME.",
    "你好，世界！日本語のテキスト。한국어",
    "Emoji 😀🎉👍🏽🇫🇷 and a rare one 🦜🪐",
    "Combining: e\u0301 a\u0308 o\u0303\u0301 and precomposed \u00e9.",
    "def f(x):\n\treturn x  # tab\r\n\n\n   indented\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nOK",
    "mixed<｜User｜>中文and English<｜Assistant｜>",
    "",
    " ",
    "\n",
    "a\u00a0b\u2009c\u3000d",  # no-break, thin and ideographic spaces
    "\u200b\ufeffzero width",
]


def train_byte_level_bpe(pattern: str, vocab_size: int = 800) -> Tokenizer:
    """Byte-level BPE as Qwen/DeepSeek/Kimi have it: a Split regex, then ByteLevel without
    its own regex."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in USER_TOKENS])
    return tok


def train_sentencepiece_bpe(vocab_size: int = 500) -> tuple[Tokenizer, list[str], list[float], list[int]]:
    """A Llama/Mixtral-style vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces with '▁'.

    Returns the HF-style tokenizer (Prepend/Replace normalizer, byte fallback) and the GGUF
    arrays (tokens, scores, types). Scores are minus the piece's rank, as in SentencePiece BPE
    models.
    """
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    # ASCII-only training text: CJK, emoji and accents then always need byte fallback (and the
    # alphabet does not depend on how the trainer breaks frequency ties).
    trainer_tok.train_from_iterator([t.encode("ascii", "ignore").decode() for t in CORPUS] * 5, trainer)
    data = json.loads(trainer_tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in data["model"]["merges"]], unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return hf, tokens, scores, types


@pytest.fixture(scope="session")
def qwen_bpe() -> Tokenizer:
    return train_byte_level_bpe(tokenizer_module._QWEN2)


def write_hf_dir(path: Path, backend: Tokenizer, config: dict, generation_config: dict | None = None, files: dict[str, str] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}, ensure_ascii=False), encoding="utf-8")
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config), encoding="utf-8")
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    return path


QWEN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, qwen_bpe: Tokenizer) -> Path:
    """A Qwen-style model directory: eos from the tokenizer config plus a list in
    generation_config.json, no BOS, a chat template in tokenizer_config.json."""
    return write_hf_dir(
        tmp_path_factory.mktemp("qwen_style"),
        qwen_bpe,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False, "chat_template": QWEN_TEMPLATE},
        generation_config={"eos_token_id": [qwen_bpe.token_to_id("<|im_end|>"), qwen_bpe.token_to_id("<|endoftext|>")], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True},
    )


def write_gguf_from_hf(path: Path, backend: Tokenizer, pre: str, *, chat_template: str | None = None, bos: str | None = None, eos: str | None = None, eot: str | None = None, add_bos: bool | None = None) -> Path:
    """A GGUF holding the HF tokenizer's vocabulary as convert_hf_to_gguf.py writes it: tokens
    by id (byte-level spelling, added tokens as plain text), CONTROL for special added tokens,
    USER_DEFINED for the others, merges as "left right"."""
    data = json.loads(backend.to_str())
    size = backend.get_vocab_size(with_added_tokens=True)
    added = backend.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(size):
        tokens.append(backend.id_to_token(i))
        if i in added:
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_llama_hparams(writer)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if bos is not None:
        writer.add_bos_token_id(backend.token_to_id(bos))
    if eos is not None:
        writer.add_eos_token_id(backend.token_to_id(eos))
    if eot is not None:
        writer.add_eot_token_id(backend.token_to_id(eot))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    _finish(writer)
    return path


def write_gguf_sentencepiece(path: Path, tokens: list[str], scores: list[float], types: list[int]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_llama_hparams(writer)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    _finish(writer)
    return path


def _add_llama_hparams(writer: gguf.GGUFWriter) -> None:
    # What llama.cpp reads before the vocabulary; with vocab_only nothing else is needed.
    writer.add_context_length(256)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(1)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed; the comparison with llama.cpp's tokenizer needs it")


def llama_cpp_tokenize(gguf_path: Path, texts: list[str], add_bos: bool = False) -> list[list[int]]:
    from hybridmoe.backend.llamacpp.model import RawModel

    with RawModel(gguf_path, vocab_only=True) as llm:
        return [llm.tokenize(t.encode("utf-8"), add_bos=add_bos, special=True) for t in texts]
