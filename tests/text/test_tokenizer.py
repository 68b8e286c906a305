"""load_tokenizer for Hugging Face directories and GGUF files, checked against the `tokenizers`
library on the same files, against transformers, and against llama.cpp when it is installed."""

from __future__ import annotations

import base64
import json
import os
import struct
from pathlib import Path

import gguf
import pytest
from tokenizers import Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from hybridmoe.backend.text import tokenizer as tokenizer_module
from hybridmoe.backend.text.tokenizer import load_tokenizer, read_gguf_metadata
from hybridmoe.backend.errors import ModelError, UnsupportedModelError

from .conftest import (
    CORPUS,
    QWEN_TEMPLATE,
    SAMPLES,
    llama_cpp_tokenize,
    needs_llama_cpp,
    train_sentencepiece_bpe,
    write_gguf_from_hf,
    write_gguf_sentencepiece,
    write_hf_dir,
)

TEXTS = SAMPLES + CORPUS + [
    "Ünïcödé ÉCOLE école Straße İstanbul ǅemal",
    "x/y/z //comment\n\n\n",
    "123456789 1,234,567.89",
    "日本語と中文と한국어 mixed漢字kanji",
]


# -- Hugging Face directories ------------------------------------------------------------------


def test_hf_encode_matches_tokenizers_and_round_trips(hf_dir: Path, qwen_bpe: HFTokenizer) -> None:
    tok = load_tokenizer(hf_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == qwen_bpe.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == text


def test_hf_special_tokens_ids_and_template(hf_dir: Path, qwen_bpe: HFTokenizer) -> None:
    tok = load_tokenizer(hf_dir)
    im_end, eot = qwen_bpe.token_to_id("<|im_end|>"), qwen_bpe.token_to_id("<|endoftext|>")
    assert tok.eos_ids == {im_end, eot}  # tokenizer_config eos plus generation_config's list
    assert tok.eos_id == im_end
    assert {im_end, eot} <= tok.stop_ids
    assert tok.bos_id is None and not tok.add_bos
    assert tok.vocab_size == qwen_bpe.get_vocab_size(with_added_tokens=True)
    assert tok.chat_template == QWEN_TEMPLATE
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.special_tokens["pad_token"] == "<|endoftext|>"
    # Special tokens written in text are single tokens; <think> is added but not special.
    assert tok.encode("<|im_end|>") == [im_end]
    think = tok.encode("<think>")
    assert len(think) == 1 and think[0] not in tok.special_ids and im_end in tok.special_ids
    assert tok.decode([*think, im_end, *tok.encode("hi")], skip_special=True) == "<think>hi"
    assert tok.encode("hi", add_special=True) == tok.encode("hi")  # no BOS for this model


def test_hf_matches_transformers(hf_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    tok = load_tokenizer(hf_dir)
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text, add_special_tokens=False), text
        assert tok.encode(text, add_special=True) == reference.encode(text, add_special_tokens=True), text
    assert tok.eos_id == reference.eos_token_id


def test_hf_bos_from_config_and_encode_prompt(tmp_path: Path, qwen_bpe: HFTokenizer) -> None:
    """DeepSeek-style: add_bos_token true, and templates that write the BOS themselves."""
    bos = "<｜begin▁of▁sentence｜>"
    model = write_hf_dir(
        tmp_path / "ds",
        qwen_bpe,
        {"bos_token": {"content": bos, "special": True}, "eos_token": {"content": "<｜end▁of▁sentence｜>"}, "add_bos_token": True, "add_eos_token": False},
        generation_config={"bos_token_id": 3, "eos_token_id": 4},
    )
    tok = load_tokenizer(model)
    bos_id = qwen_bpe.token_to_id(bos)
    assert tok.bos_id == bos_id and tok.add_bos and tok.bos_token == bos
    assert tok.encode("hi", add_special=True) == [bos_id, *tok.encode("hi")]
    assert tok.encode_prompt(bos + "hi") == [bos_id, *tok.encode("hi")]  # not twice
    assert tok.encode_prompt("hi") == [bos_id, *tok.encode("hi")]


def test_hf_add_bos_inferred_from_post_processor(tmp_path: Path, qwen_bpe: HFTokenizer) -> None:
    """No add_bos_token in the config: the tokenizer.json post-processor decides, as in
    transformers (Llama-3 style TemplateProcessing)."""
    backend = HFTokenizer.from_str(qwen_bpe.to_str())
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    model = write_hf_dir(tmp_path / "llama3ish", backend, {"bos_token": "<s>", "eos_token": "</s>"})
    tok = load_tokenizer(model)
    assert tok.add_bos and tok.encode("x", add_special=True)[0] == backend.token_to_id("<s>")


def test_hf_chat_template_file_precedence(tmp_path: Path, qwen_bpe: HFTokenizer) -> None:
    listed = [{"name": "default", "template": "config default"}, {"name": "tool_use", "template": "config tools"}]
    model = write_hf_dir(tmp_path / "a", qwen_bpe, {"eos_token": "<|im_end|>", "chat_template": listed})
    tok = load_tokenizer(model)
    assert tok.chat_templates == {"default": "config default", "tool_use": "config tools"}
    assert "tokenizer_config.json" in tok.chat_template_origins["tool_use"]

    # chat_template.jinja and additional_chat_templates/ win over the config entry.
    files = {"chat_template.jinja": "jinja default", "additional_chat_templates/tool_use.jinja": "jinja tools"}
    model = write_hf_dir(tmp_path / "b", qwen_bpe, {"eos_token": "<|im_end|>", "chat_template": "config"}, files=files)
    tok = load_tokenizer(model)
    assert tok.chat_templates == {"default": "jinja default", "tool_use": "jinja tools"}
    assert tok.chat_template_origins["default"].endswith("chat_template.jinja")

    # The legacy processor file comes last.
    model = write_hf_dir(tmp_path / "c", qwen_bpe, {"eos_token": "<|im_end|>"}, files={"chat_template.json": json.dumps({"chat_template": "legacy"})})
    assert load_tokenizer(model).chat_template == "legacy"

    model = write_hf_dir(tmp_path / "d", qwen_bpe, {"eos_token": "<|im_end|>"})
    assert load_tokenizer(model).chat_template is None


def test_bad_paths_and_files(tmp_path: Path, qwen_bpe: HFTokenizer) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="holds no tokenizer"):
        load_tokenizer(tmp_path / "empty")
    model = write_hf_dir(tmp_path / "broken", qwen_bpe, {})
    (model / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelError, match="tokenizer_config.json cannot be read"):
        load_tokenizer(model)
    model = write_hf_dir(tmp_path / "broken2", qwen_bpe, {})
    (model / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ModelError, match="tokenizer.json cannot be read"):
        load_tokenizer(model)


# -- tiktoken rank files (Kimi K2) ---------------------------------------------------------------


def _tiktoken_dir(tmp_path: Path, backend: HFTokenizer) -> tuple[Path, dict[bytes, int]]:
    """A Kimi-style directory: tiktoken.model (base64 token bytes and rank) plus
    tokenizer_config.json naming some of the special tokens after the ranks."""
    from_unicode = {c: b for b, c in tokenizer_module._bytes_to_unicode().items()}
    added = backend.get_added_tokens_decoder()
    ranks = {}
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        if i not in added:
            ranks[bytes(from_unicode[c] for c in backend.id_to_token(i))] = len(ranks)
    path = tmp_path / "kimi"
    path.mkdir()
    (path / "tiktoken.model").write_bytes(b"".join(base64.b64encode(b) + b" %d\n" % r for b, r in ranks.items()))
    n = len(ranks)
    config = {
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": {str(n): {"content": "[BOS]", "special": True}, str(n + 1): {"content": "[EOS]", "special": True}, str(n + 2): {"content": "<|im_end|>", "special": True}, str(n + 3): {"content": "<|im_user|>", "special": True}},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": n + 2}))
    return path, ranks


def _tiktoken_reference(ranks: dict[bytes, int], pieces: list[str]) -> list[int]:
    """tiktoken's algorithm written out: within each pre-token, merge the adjacent pair whose
    concatenation has the lowest rank, until none is in the table."""
    out = []
    for piece in pieces:
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while True:
            best = min(((ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1) if parts[i] + parts[i + 1] in ranks), default=None)
            if best is None:
                break
            i = best[1]
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        out.extend(ranks[p] for p in parts)
    return out


def test_tiktoken_directory_matches_tiktoken_algorithm(tmp_path: Path) -> None:
    from .conftest import train_byte_level_bpe

    backend = train_byte_level_bpe(tokenizer_module._KIMI_K2)
    model, ranks = _tiktoken_dir(tmp_path, backend)
    tok = load_tokenizer(model)
    split = pre_tokenizers.Split(Regex(tokenizer_module._KIMI_K2), behavior="isolated")
    for text in TEXTS:
        if "<|" in text or "<｜" in text or "<think>" in text:
            continue  # those are added tokens in the trained tokenizer, not in the rank file
        expected = _tiktoken_reference(ranks, [p for p, _ in split.pre_tokenize_str(text)])
        assert tok.encode(text) == expected, text
        assert tok.decode(expected) == text
    n = len(ranks)
    assert tok.encode("<|im_end|><|im_user|>") == [n + 2, n + 3]
    assert tok.token_to_id(f"<|reserved_token_{n + 10}|>") == n + 10  # Kimi reserves 256 slots
    assert tok.vocab_size == n + 256
    assert tok.bos_id == n and tok.eos_ids == {n + 1, n + 2} and tok.eos_id == n + 1


def test_tiktoken_directory_matches_tiktoken_library(tmp_path: Path) -> None:
    tiktoken = pytest.importorskip("tiktoken")
    from .conftest import train_byte_level_bpe

    backend = train_byte_level_bpe(tokenizer_module._KIMI_K2)
    model, ranks = _tiktoken_dir(tmp_path, backend)
    # The same construction as Kimi's tokenization_kimi.py: its pat_str over the ranks.
    encoding = tiktoken.Encoding("kimi-test", pat_str=tokenizer_module._KIMI_K2, mergeable_ranks=ranks, special_tokens={})
    tok = load_tokenizer(model)
    for text in TEXTS:
        if "<|" in text or "<｜" in text or "<think>" in text:
            continue
        assert tok.encode(text) == encoding.encode(text, disallowed_special=()), text


# -- GGUF: byte-level BPE ------------------------------------------------------------------------

# Pre-tokenizers as the models' own tokenizer.json files define them (the reference side).
_REFERENCE_PRE = {
    "qwen2": [tokenizer_module._QWEN2],
    "deepseek-v3": list(tokenizer_module._DEEPSEEK_V3),
    "llama-bpe": [tokenizer_module._LLAMA3],
    "gpt-4o": [tokenizer_module._GPT4O],
    "kimi-k2": [tokenizer_module._KIMI_K2],
    "glm4": [tokenizer_module._LLAMA3],
    "gpt-2": None,  # ByteLevel's own regex
}


def _reference(qwen_bpe: HFTokenizer, pre: str) -> HFTokenizer:
    data = json.loads(qwen_bpe.to_str())
    data["model"]["ignore_merges"] = pre in ("llama-bpe", "glm4")
    ref = HFTokenizer.from_str(json.dumps(data))
    regexes = _REFERENCE_PRE[pre]
    if regexes is None:
        ref.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        ref.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes] + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    ref.decoder = decoders.ByteLevel()
    return ref


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory, qwen_bpe: HFTokenizer) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {
        pre: write_gguf_from_hf(folder / f"{pre}.gguf", qwen_bpe, pre, eos="<|im_end|>", eot="<|endoftext|>", chat_template=QWEN_TEMPLATE)
        for pre in _REFERENCE_PRE
    }


@pytest.mark.parametrize("pre", list(_REFERENCE_PRE))
def test_gguf_byte_level_matches_hf(pre: str, gguf_files: dict[str, Path], qwen_bpe: HFTokenizer) -> None:
    tok = load_tokenizer(gguf_files[pre])
    ref = _reference(qwen_bpe, pre)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids, (pre, text)
        assert tok.decode(ids) == text


def test_gguf_metadata_ids_and_template(gguf_files: dict[str, Path], qwen_bpe: HFTokenizer) -> None:
    tok = load_tokenizer(gguf_files["qwen2"])
    im_end, eot = qwen_bpe.token_to_id("<|im_end|>"), qwen_bpe.token_to_id("<|endoftext|>")
    assert tok.eos_ids == {im_end} and {im_end, eot} <= tok.stop_ids
    assert tok.chat_template == QWEN_TEMPLATE and "tokenizer.chat_template" in tok.chat_template_origins["default"]
    assert tok.special_tokens["eos_token"] == "<|im_end|>"
    assert tok.vocab_size == qwen_bpe.get_vocab_size(with_added_tokens=True)
    think = qwen_bpe.token_to_id("<think>")
    assert tok.encode("<think>") == [think] and think not in tok.special_ids and im_end in tok.special_ids
    assert not tok.add_bos  # BPE vocabularies default to no BOS, as in llama.cpp


@needs_llama_cpp
@pytest.mark.parametrize("pre", list(_REFERENCE_PRE))
def test_gguf_byte_level_matches_llama_cpp(pre: str, gguf_files: dict[str, Path]) -> None:
    tok = load_tokenizer(gguf_files[pre])
    expected = llama_cpp_tokenize(gguf_files[pre], TEXTS)
    for text, ids in zip(TEXTS, expected):
        assert tok.encode(text) == ids, (pre, text)


def test_gguf_directory_and_shards(tmp_path: Path, qwen_bpe: HFTokenizer) -> None:
    first = write_gguf_from_hf(tmp_path / "model-00001-of-00002.gguf", qwen_bpe, "qwen2", eos="<|im_end|>")
    second = tmp_path / "model-00002-of-00002.gguf"
    writer = gguf.GGUFWriter(str(second), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_tokenizer(tmp_path).source == str(first)
    assert load_tokenizer(second).source == str(first)  # the vocabulary lives in shard 1


def test_gguf_errors(tmp_path: Path, qwen_bpe: HFTokenizer) -> None:
    unknown_pre = write_gguf_from_hf(tmp_path / "pre.gguf", qwen_bpe, "no-such-pre")
    with pytest.raises(UnsupportedModelError, match="no-such-pre"):
        load_tokenizer(unknown_pre)

    writer = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'bert'"):
        load_tokenizer(tmp_path / "bert.gguf")

    good = write_gguf_from_hf(tmp_path / "good.gguf", qwen_bpe, "qwen2")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(ModelError, match="truncated"):
        load_tokenizer(truncated)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 64)
    with pytest.raises(ModelError, match="neither a GGUF"):
        load_tokenizer(not_gguf)


def test_read_gguf_metadata_agrees_with_gguf_reader(gguf_files: dict[str, Path]) -> None:
    path = gguf_files["qwen2"]
    ours = read_gguf_metadata(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        assert ours[key] == field.contents(), key


def test_read_gguf_metadata_big_endian(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b"])
    writer.add_token_types([1, 3])
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = read_gguf_metadata(tmp_path / "be.gguf")
    assert meta["tokenizer.ggml.tokens"] == ["a", "b"] and meta["tokenizer.ggml.token_type"] == [1, 3]
    assert meta["tokenizer.ggml.eos_token_id"] == 1
    assert struct.unpack(">I", (tmp_path / "be.gguf").read_bytes()[4:8])[0] == 3


# -- GGUF: SentencePiece ("llama") -----------------------------------------------------------------


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> tuple[HFTokenizer, Path]:
    hf, tokens, scores, types = train_sentencepiece_bpe()
    return hf, write_gguf_sentencepiece(tmp_path_factory.mktemp("spm") / "spm.gguf", tokens, scores, types)


def test_gguf_sentencepiece_matches_hf(spm: tuple[HFTokenizer, Path]) -> None:
    hf, path = spm
    tok = load_tokenizer(path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == text
    assert tok.bos_id == 1 and tok.add_bos and tok.eos_ids == {2}
    assert tok.encode("hi", add_special=True)[0] == 1
    assert tok.byte_fallback_ids == set(range(3, 259))
    # Characters outside the pieces (emoji) come out as UTF-8 byte tokens.
    assert [tok.id_to_token(i) for i in tok.encode("🦜")][-4:] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x9C>"]


@needs_llama_cpp
def test_gguf_sentencepiece_matches_llama_cpp(spm: tuple[HFTokenizer, Path]) -> None:
    _, path = spm
    tok = load_tokenizer(path)
    texts = TEXTS + ["<s>[INST] hello [/INST] hi</s>"]
    for text, ids in zip(texts, llama_cpp_tokenize(path, texts)):
        assert tok.encode(text) == ids, text
    assert llama_cpp_tokenize(path, ["hello"], add_bos=True)[0] == tok.encode("hello", add_special=True)


# -- real vocabularies (llama.cpp's test files, when a checkout is at hand) ------------------------

_VOCAB_DIR = os.environ.get("HYBRIDMOE_LLAMA_CPP_VOCABS")  # llama.cpp's models/ directory


@pytest.mark.skipif(not _VOCAB_DIR, reason="set HYBRIDMOE_LLAMA_CPP_VOCABS to llama.cpp's models/ directory to check real vocabularies")
def test_real_vocabularies_match_their_expected_ids() -> None:
    """llama.cpp ships ggml-vocab-*.gguf with .inp/.out files: texts and the ids the original
    Hugging Face tokenizer gives them."""
    checked = 0
    for path in sorted(Path(_VOCAB_DIR).glob("ggml-vocab-*.gguf")):
        out = path.with_suffix(".gguf.out")
        if not out.exists():
            continue
        try:
            tok = load_tokenizer(path)
        except UnsupportedModelError:
            continue  # WordPiece / Unigram vocabularies are for llama.cpp
        texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
        for text, line in zip(texts, out.read_text(encoding="utf-8").splitlines()):
            assert tok.encode(text) == [int(x) for x in line.split()], (path.name, text)
        checked += 1
    assert checked


# ---- the lower bound on a text's tokens, from its length (a prompt too long is refused untokenized)


def test_min_tokens_is_a_lower_bound(hf_dir: Path, gguf_files: dict[str, Path]) -> None:
    texts = [*TEXTS, "ab " * 5000, " " * 3000, "x" * 3000, "你好" * 999, "\n\n" * 800, "😀" * 700]
    for tokenizer in (load_tokenizer(hf_dir), *(load_tokenizer(p) for p in gguf_files.values())):
        for text in texts:
            assert tokenizer.min_tokens(text) <= len(tokenizer.encode_prompt(text)), (tokenizer.source, text[:20])
        assert tokenizer.min_tokens("ab " * 100_000) >= 1000  # and bounds something: 300 kB is many tokens


@pytest.mark.parametrize("normalizer, shrink", [
    (None, 1),
    ({"type": "NFC"}, 4),
    ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                          {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}, 4),
    ({"type": "Replace", "pattern": {"String": "  "}, "content": " "}, 2),
    ({"type": "Strip", "strip_left": True, "strip_right": True}, None),  # drops whitespace
    ({"type": "Precompiled", "precompiled_charsmap": ""}, None),  # SentencePiece's map: may collapse spaces
    ({"type": "Replace", "pattern": {"Regex": " +"}, "content": " "}, None),
    ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Strip"}]}, None),
])
def test_only_normalizers_that_keep_characters_allow_a_bound(normalizer, shrink) -> None:
    assert tokenizer_module._normalizer_shrink(normalizer) == shrink
