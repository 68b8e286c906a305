"""The project's GGUF reader (hybridmoe.backend.models.gguf_reader).

1. It reads what gguf-py's GGUFReader reads, value for value and tensor for tensor, on every
   kind of GGUF the test suites write: tests/models (qwen3moe single and split, deepseek2),
   tests/quant/tiny_gguf.py (every float and block type, every kind of key, split sets),
   tests/text (byte-level BPE and SentencePiece vocabularies, big-endian), tests/convert (the
   converter's files, every quantization) and tests/llamacpp's rewritten copies.
2. Damaged files fail at once with a ModelError naming the file: bad magic, truncation at
   every byte of the header, absurd counts and lengths (a corrupted array length in a
   truncated file must not allocate or loop), offsets past the end, bad alignment, unknown
   types; big-endian files are refused unless asked for.
3. Nothing in backend/ reads GGUF headers another way.

Open times against GGUFReader on a 150k-token vocabulary: ``python -m tests.models.time_gguf_open``.
"""

from __future__ import annotations

import ast
import re
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models.gguf_reader import (
    GGUFError,
    UnsupportedGGUFError,
    open_gguf_file,
    open_gguf_set,
    read_metadata,
)
from tests.convert.conftest import needs_llama_cpp

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------
# The comparison with gguf.GGUFReader
# --------------------------------------------------------------------------------------


def _same(ours, theirs) -> bool:
    """Equal values of the same Python types (a bool is not an int here, nor an int a float)."""
    if isinstance(theirs, list):
        return isinstance(ours, list) and len(ours) == len(theirs) and all(map(_same, ours, theirs))
    return type(ours) is type(theirs) and ours == theirs


def assert_same_as_gguf_reader(path: Path) -> None:
    ref = gguf.GGUFReader(path)
    with open_gguf_file(path, allow_big_endian=True) as g:
        assert g.version == ref.fields["GGUF.version"].contents()
        assert g.byte_order == ("<" if ref.byte_order == "I" else ">")
        keys = [k for k in ref.fields if not k.startswith("GGUF.")]
        assert g.keys() == keys, path
        for key in keys:
            field, ours = ref.fields[key], g.fields[key]
            assert ours.type == field.types[0], key
            if ours.is_array:
                assert ours.item_type == field.types[1] and ours.count == len(field.data), key
            assert _same(g[key], field.contents()), (path, key)
        assert g.alignment == ref.alignment and g.data_offset == ref.data_offset
        assert len(g.tensors) == len(ref.tensors)
        for t, r in zip(g.tensors, ref.tensors, strict=True):
            assert t.name == r.name and t.ggml_type == r.tensor_type, (path, r.name)
            assert t.ne == tuple(r.shape.tolist()) and t.shape == tuple(reversed(r.shape.tolist())), r.name
            assert (t.offset, t.nbytes, t.n_elements) == (r.data_offset, r.n_bytes, r.n_elements), r.name
            view = g.tensor_bytes(t)
            assert view.nbytes == r.data.nbytes and view.tobytes() == r.data.tobytes(), r.name
            assert np.shares_memory(view, g.data)  # a view of the mapping, not a copy
        metadata = g.metadata
    assert all(_same(metadata[k], ref.fields[k].contents()) for k in keys)
    assert read_metadata(path) == metadata


def test_tests_models_ggufs(gguf_dir):
    paths = sorted(gguf_dir.rglob("*.gguf"))
    assert len(paths) == 4  # qwen3moe, its two split parts, deepseek2
    for path in paths:
        assert_same_as_gguf_reader(path)


def test_tests_quant_tiny_ggufs(tmp_path):
    from tests.quant.tiny_gguf import rand, write_gguf

    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": (rand(rng, 96, 64), T.Q8_0),
        "output.weight": (rand(rng, 96, 64), T.F16),
        "output_norm.weight": (rand(rng, 64), T.F32),
        "blk.0.attn_q.weight": (rand(rng, 64, 64), T.BF16),
        "blk.0.ffn_gate_exps.weight": (rand(rng, 4, 32, 64), T.Q4_0),
        "blk.0.ffn_up_exps.weight": (rand(rng, 4, 32, 64), T.Q4_1),
        "blk.0.ffn_down_exps.weight": (rand(rng, 4, 64, 32), T.Q5_0),
        "blk.0.attn_k.weight": (rand(rng, 32, 64), T.Q5_1),
        "blk.0.attn_sinks.weight": (rand(rng, 4), T.F32),
    }
    kv = {"qwen3moe.block_count": 1, "qwen3moe.rope.freq_base": 1e6, "qwen3moe.expert_weights_norm": True,
          "general.name": "tiny ✓", "qwen3moe.layer_types": [1, 2, 3], "x.floats": [0.1, 1e-6, -2.5],
          "x.names": ["a", "", "ü"]}
    write_gguf(tmp_path / "one.gguf", "qwen3moe", tensors, kv)
    assert_same_as_gguf_reader(tmp_path / "one.gguf")
    write_gguf(tmp_path / "set.gguf", "qwen3moe", tensors, kv, split_max_tensors=3)
    parts = sorted(tmp_path.glob("set-*-of-*.gguf"))
    assert len(parts) == 3
    for part in parts:
        assert_same_as_gguf_reader(part)
    files = open_gguf_set(parts[1])
    assert [g.path for g in files] == parts
    assert sum(len(g.tensors) for g in files) == files[0]["split.tensors.count"] == len(tensors)


def test_tests_text_ggufs(tmp_path):
    from hybridmoe.backend.text.tokenizer import _QWEN2
    from tests.text.conftest import (
        train_byte_level_bpe,
        train_sentencepiece_bpe,
        write_gguf_from_hf,
        write_gguf_sentencepiece,
    )

    bpe = train_byte_level_bpe(_QWEN2)
    write_gguf_from_hf(tmp_path / "bpe.gguf", bpe, "qwen2", chat_template="{{ x }}", bos="<s>", eos="<|im_end|>",
                       eot="<|endoftext|>", add_bos=False)
    assert_same_as_gguf_reader(tmp_path / "bpe.gguf")
    _, tokens, scores, types = train_sentencepiece_bpe()
    write_gguf_sentencepiece(tmp_path / "spm.gguf", tokens, scores, types)
    assert_same_as_gguf_reader(tmp_path / "spm.gguf")

    writer = gguf.GGUFWriter(str(tmp_path / "be.gguf"), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_token_list(["a", "b"])
    writer.add_token_scores([0.5, -1.0])
    writer.add_token_types([1, 3])
    writer.add_eos_token_id(1)
    writer.add_tensor("output_norm.weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(tmp_path / "be.gguf")


@pytest.mark.parametrize("family, quant", [pytest.param("qwen3_moe", "q4_k_m", marks=needs_llama_cpp),
                                           ("deepseek_v3", "bf16"), ("qwen2_moe", "q4_0"), ("olmoe", "q8_0"),
                                           ("mixtral", "q8_0")])
def test_tests_convert_ggufs(family, quant, tmp_path):
    from hybridmoe.backend.convert import to_gguf
    from tests.convert.conftest import build_checkpoint

    (tmp_path / "hf").mkdir()
    checkpoint = build_checkpoint(tmp_path / "hf", family)
    out = to_gguf(checkpoint.path, tmp_path / f"{family}-{quant}.gguf", quant)
    assert_same_as_gguf_reader(out)
    if family == "qwen3_moe":  # tests/llamacpp rewrites converted files with GGUFWriter
        from tests.llamacpp.conftest import copy_gguf

        assert_same_as_gguf_reader(copy_gguf(out, tmp_path / "f32.gguf", f32=True))
        assert_same_as_gguf_reader(copy_gguf(out, tmp_path / "renamed.gguf", arch="qwen9moe"))


# --------------------------------------------------------------------------------------
# Reading: values, tensors, views, lifetime
# --------------------------------------------------------------------------------------


def _write(path: Path, *, kv: dict | None = None, tensors: dict | None = None, arch: str = "llama",
           endianess=gguf.GGUFEndian.LITTLE) -> Path:
    w = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    for key, (value, vtype) in (kv or {}).items():
        w.add_key_value(key, value, vtype, sub_type=None)
    for name, arr in (tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def vocab_gguf(tmp_path) -> Path:
    """Tokens, merges, scores and types, a few scalar keys, and three tensors."""
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "qwen3moe")
    w.add_uint32("qwen3moe.block_count", 2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(2000)])
    w.add_token_merges([f"tok{i} tok{i + 1}" for i in range(1999)])
    w.add_token_scores([float(i) / 4 for i in range(2000)])
    w.add_token_types([1 + i % 6 for i in range(2000)])
    w.add_chat_template("{{ messages }}")
    w.add_tensor("token_embd.weight", np.arange(1000 * 32, dtype=np.float32).reshape(1000, 32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float16))
    w.add_tensor("blk.0.ffn_gate_exps.weight", gguf.quants.quantize(np.ones((2, 4, 32), np.float32), T.Q8_0),
                 raw_dtype=T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tmp_path / "vocab.gguf"


def test_values_arrays_and_tensors(vocab_gguf):
    g = open_gguf_file(vocab_gguf)
    assert g["general.architecture"] == "qwen3moe" and g.get("qwen3moe.block_count") == 2
    assert g.get("missing", "default") == "default" and "missing" not in g
    with pytest.raises(KeyError):
        g["missing"]
    tokens = g.fields["tokenizer.ggml.tokens"]
    assert tokens.is_array and tokens.item_type == V.STRING and tokens.count == 2000
    assert g["tokenizer.ggml.tokens"][1999] == "tok1999" and g["tokenizer.ggml.token_type"][:3] == [1, 2, 3]
    scores = g.numeric_array("tokenizer.ggml.scores")
    assert scores.dtype == np.float32 and scores[8] == 2.0 and np.shares_memory(scores, g.data)
    with pytest.raises(TypeError):
        g.numeric_array("tokenizer.ggml.tokens")
    embd = g.tensor("token_embd.weight")
    assert embd.ne == (32, 1000) and embd.shape == (1000, 32) and embd.ggml_type == T.F32
    assert embd.nbytes == 1000 * 32 * 4 and embd.offset % 32 == 0 and embd.type_name == "f32"
    assert np.array_equal(g.tensor_bytes("token_embd.weight").view(np.float32), np.arange(32000, dtype=np.float32))
    experts = g.tensor("blk.0.ffn_gate_exps.weight")
    assert experts.shape == (2, 4, 32) and experts.nbytes == 2 * 4 * 34 and experts.type_name == "q8_0"


def test_views_outlive_close(vocab_gguf):
    g = open_gguf_file(vocab_gguf)
    view = g.tensor_bytes("token_embd.weight")
    g.close()
    assert g.closed and view.view(np.float32)[5] == 5.0  # the mapping stays while views exist
    g.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        g.data  # noqa: B018 - the property raises
    with open_gguf_file(vocab_gguf) as g2:
        g2.keys()
    assert g2.closed


def test_metadata_only(vocab_gguf, tmp_path):
    """tensors=False reads the key/values and never looks at the tensor directory, so a file
    cut inside it still gives its vocabulary (as the tokenizer's own reader used to)."""
    with open_gguf_file(vocab_gguf) as g:
        cut_at = max(f.end for f in g.fields.values()) + 100  # inside the second tensor info
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(vocab_gguf.read_bytes()[:cut_at])
    with open_gguf_file(cut, tensors=False) as g:
        assert g.tensors == () and g.data_offset is None
        assert len(g["tokenizer.ggml.tokens"]) == 2000
    with pytest.raises(GGUFError, match="cut.gguf.*truncated or damaged.*tensor info"):
        open_gguf_file(cut)


def test_nested_arrays_and_empty_values(tmp_path):
    path = _write(tmp_path / "nested.gguf", kv={
        "x.nested": ([[1, 2], [3, 4, 5]], V.ARRAY), "x.strings": (["", "é", "a b"], V.ARRAY),
        "x.bools": ([True, False], V.ARRAY), "x.empty_string": ("", V.STRING), "x.i64": (-(2**40), V.INT64),
        "x.f64": (0.1, V.FLOAT64), "x.bool": (False, V.BOOL), "x.i8": (-3, V.INT8),
    })
    g = open_gguf_file(path)
    assert g["x.nested"] == [[1, 2], [3, 4, 5]]  # GGUFReader flattens these; nesting is kept here
    assert g.fields["x.nested"].item_type == V.ARRAY and g.fields["x.nested"].count == 2
    assert g["x.strings"] == ["", "é", "a b"] and g["x.bools"] == [True, False]
    assert g["x.empty_string"] == "" and g["x.i64"] == -(2**40) and g["x.f64"] == 0.1
    assert g["x.bool"] is False and g["x.i8"] == -3


def test_alignment_is_honoured(tmp_path):
    path = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_tensor("a.weight", np.ones(3, np.float32))
    w.add_tensor("b.weight", np.ones(5, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_as_gguf_reader(path)
    g = open_gguf_file(path)
    assert g.alignment == 64 and g.data_offset % 64 == 0 and all(t.offset % 64 == 0 for t in g.tensors)


def test_invalid_utf8_is_replaced_not_fatal(tmp_path):
    path = _write(tmp_path / "u.gguf", kv={"x.s": ("abc", V.STRING), "x.a": (["abc", "def"], V.ARRAY)})
    data = bytearray(path.read_bytes())
    data[data.index(b"abc")] = 0xFF
    data[data.rindex(b"def")] = 0xFE
    path.write_bytes(bytes(data))
    g = open_gguf_file(path)
    assert g["x.s"] == "\ufffdbc" and g["x.a"] == ["abc", "\ufffdef"]


# --------------------------------------------------------------------------------------
# Damaged files
# --------------------------------------------------------------------------------------


def _patch(path: Path, offset: int, fmt: str, *values) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into(fmt, data, offset, *values)
    path.write_bytes(bytes(data))


def _damaged(path: Path, match: str, **options) -> GGUFError:
    with pytest.raises(GGUFError) as err:  # a reader trusting a damaged count would hang: pytest-timeout stops it
        open_gguf_file(path, **options)
    assert isinstance(err.value, ModelError) and str(path) in str(err.value) and err.value.hint
    assert re.search(match, str(err.value)), str(err.value)
    return err.value


def test_missing_empty_and_not_gguf(tmp_path):
    _damaged(tmp_path / "nowhere.gguf", "does not exist")
    _damaged(tmp_path, "is a directory")
    (tmp_path / "empty.gguf").write_bytes(b"")
    _damaged(tmp_path / "empty.gguf", "is empty")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}      ")
    err = _damaged(tmp_path / "model.safetensors", r"is not a GGUF file \(it does not start with 'GGUF'\)")
    assert not isinstance(err, UnsupportedModelError)
    (tmp_path / "ggu.gguf").write_bytes(b"GGU")
    _damaged(tmp_path / "ggu.gguf", "truncated or damaged.*only 3 bytes")


def test_truncated_at_every_byte_of_the_header(vocab_gguf, tmp_path):
    data = vocab_gguf.read_bytes()
    with open_gguf_file(vocab_gguf) as g:
        header_end = g.data_offset
        last = max(g.tensors, key=lambda t: t.offset)
        end = last.offset + last.nbytes
    cut = tmp_path / "cut.gguf"
    # every byte of the fixed header, the first keys and the tensor directory; every 53rd between
    for n in sorted({*range(4, 300), *range(300, header_end, 53), *range(header_end - 300, header_end + 1)}):
        cut.write_bytes(data[:n])
        err = _damaged(cut, "truncated or damaged")
        assert not isinstance(err, UnsupportedModelError), n
    # Cut inside the tensor data: the header parses, the last tensor is not within the file.
    cut.write_bytes(data[:end - 8])
    _damaged(cut, rf"tensor '{last.name}' data is not within the file bounds: it ends at byte {end}, the file has "
                  rf"{end - 8}")


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"])
@pytest.mark.parametrize("count", [2**63 + 5, 2**40, 10**6])
def test_huge_array_length_in_a_truncated_file_fails_fast(vocab_gguf, tmp_path, key, count):
    with open_gguf_file(vocab_gguf) as g:
        where = g.fields[key].offset - 8  # the u64 element count before the first element
    bad = tmp_path / "bad.gguf"
    shutil.copy(vocab_gguf, bad)
    _patch(bad, where, "<Q", count)
    with open(bad, "r+b") as f:
        f.truncate(where + 100)
    _damaged(bad, rf"metadata array '{re.escape(key)}' claims {count} elements, more than the \d+ bytes left")
    _damaged(bad, "claims", tensors=False)


def test_huge_lengths_inside_arrays_and_keys(vocab_gguf, tmp_path):
    with open_gguf_file(vocab_gguf) as g:
        tokens = g.fields["tokenizer.ggml.tokens"].offset
        template = g.fields["tokenizer.chat_template"].offset
        first_key = 24
    bad = tmp_path / "bad.gguf"
    for offset, length, match in (
        (tokens + 8 + 4, 2**63, "ends inside the value of metadata key 'tokenizer.ggml.tokens'"),  # 2nd token
        (tokens, 2**64 - 1, "ends inside"),  # the first token
        (template, 10**12, "metadata string 'tokenizer.chat_template' is 1000000000000 bytes long"),
        (first_key, 2**62, "metadata key #1 of .* is 4611686018427387904 bytes long"),
    ):
        shutil.copy(vocab_gguf, bad)
        _patch(bad, offset, "<Q", length)
        _damaged(bad, match)


def test_huge_counts_in_the_header(vocab_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    shutil.copy(vocab_gguf, bad)
    _patch(bad, 16, "<Q", 2**62)
    _damaged(bad, "claims 4611686018427387904 metadata keys")
    shutil.copy(vocab_gguf, bad)
    _patch(bad, 8, "<Q", 2**50)
    _damaged(bad, "claims 1125899906842624 tensors")
    open_gguf_file(bad, tensors=False).close()  # the key/values alone are fine


def _tensor_info_offset(path: Path, name: str) -> int:
    """Where the tensor info of `name` starts (its u64 name length)."""
    data = path.read_bytes()
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded)


def test_bad_tensor_infos(vocab_gguf, tmp_path):
    bad = tmp_path / "bad.gguf"
    name = "output_norm.weight"
    info = _tensor_info_offset(vocab_gguf, name)
    n_dims_at = info + 8 + len(name)
    after_dims = n_dims_at + 4 + 8  # one dimension
    for offset, fmt, value, match, error in (
        (n_dims_at, "<I", 7, f"tensor '{name}' has 7 dimensions", GGUFError),
        (after_dims, "<I", 999, f"tensor '{name}' has ggml type 999, which gguf-py does not know", UnsupportedGGUFError),
        (after_dims + 4, "<Q", 2**40, f"tensor '{name}' data is not within the file bounds", GGUFError),
        (after_dims + 4, "<Q", 1000 * 32 * 4 + 16, f"tensor '{name}' has data offset \\d+, not a multiple of the alignment 32", GGUFError),
    ):
        shutil.copy(vocab_gguf, bad)
        _patch(bad, offset, fmt, value)
        err = _damaged(bad, match)
        assert error is None or type(err) is error
    # ne[0] of F16 may be anything; of Q8_0 it must be whole blocks of 32
    q8 = _tensor_info_offset(vocab_gguf, "blk.0.ffn_gate_exps.weight") + 8 + len("blk.0.ffn_gate_exps.weight")
    shutil.copy(vocab_gguf, bad)
    _patch(bad, q8 + 4, "<Q", 33)
    _damaged(bad, "rows of 33 values, not whole Q8_0 blocks of 32")
    # A dimension so large that the size computation itself is absurd.
    shutil.copy(vocab_gguf, bad)
    _patch(bad, q8 + 4 + 8, "<Q", 2**62)
    _damaged(bad, "impossible shape")


def test_unknown_ggml_type_can_be_let_through(vocab_gguf, tmp_path):
    bad = tmp_path / "newer.gguf"
    shutil.copy(vocab_gguf, bad)
    name = "output_norm.weight"
    _patch(bad, _tensor_info_offset(bad, name) + 8 + len(name) + 4 + 8, "<I", 250)
    g = open_gguf_file(bad, allow_unknown_types=True)
    t = g.tensor(name)
    assert t.ggml_type == 250 and t.nbytes is None and t.type_name == "type250"
    with pytest.raises(UnsupportedGGUFError, match="ggml type 250"):
        g.tensor_bytes(t)


def test_bad_values(tmp_path):
    base = _write(tmp_path / "base.gguf", kv={"x.a": ([1, 2], V.ARRAY), "x.b": (7, V.UINT32)})
    with open_gguf_file(base) as g:
        a_type = g.fields["x.a"].offset - 12  # u32 element type, u64 count
        b_type = g.fields["x.b"].offset - 4
    bad = tmp_path / "bad.gguf"
    for offset, value, match in ((a_type, 77, "'x.a' is an array of unknown value type 77"),
                                 (b_type, 13, "'x.b' has unknown value type 13")):
        shutil.copy(base, bad)
        _patch(bad, offset, "<I", value)
        _damaged(bad, match)
    # the same key twice
    data = base.read_bytes().replace(b"x.b", b"x.a")
    bad.write_bytes(data)
    _damaged(bad, "metadata key 'x.a' appears twice")


def test_bad_nested_array_length(tmp_path):
    path = _write(tmp_path / "n.gguf", kv={"x.nested": ([[1, 2], [3]], V.ARRAY)})
    with open_gguf_file(path) as g:
        inner = g.fields["x.nested"].offset  # u32 type, u64 count of the first inner array
    _patch(path, inner + 4, "<Q", 2**61)
    _damaged(path, "an array inside metadata array 'x.nested' claims 2305843009213693952 elements")


def test_duplicate_tensor_and_bad_alignment(tmp_path):
    path = _write(tmp_path / "d.gguf", tensors={"aaaa": np.ones(4, np.float32), "bbbb": np.ones(4, np.float32)})
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(path.read_bytes().replace(b"bbbb", b"aaaa"))
    _damaged(bad, "tensor 'aaaa' appears twice")
    for value, vtype, match in ((48, V.UINT32, "general.alignment is 48, not a power of two"),
                                (0, V.UINT32, "general.alignment is 0"),
                                (64, V.UINT64, "general.alignment is a uint64, not a uint32")):
        _write(bad, kv={"general.alignment": (value, vtype)}, tensors={"a": np.ones(4, np.float32)})
        _damaged(bad, match)


def test_versions_and_byte_order(tmp_path):
    path = _write(tmp_path / "v.gguf", kv={"x.b": (7, V.UINT32)})
    bad = tmp_path / "bad.gguf"
    shutil.copy(path, bad)
    _patch(bad, 4, "<I", 1)
    err = _damaged(bad, "version 1")
    assert isinstance(err, UnsupportedModelError)
    _patch(bad, 4, "<I", 2)
    assert open_gguf_file(bad)["x.b"] == 7  # version 2 has the same layout
    _patch(bad, 4, "<I", 99)
    assert not isinstance(_damaged(bad, "unknown GGUF version 99"), UnsupportedModelError)

    big = _write(tmp_path / "be.gguf", kv={"x.b": (7, V.UINT32)}, tensors={"t": np.arange(4, dtype=np.float32)},
                 endianess=gguf.GGUFEndian.BIG)
    err = _damaged(big, "is a big-endian GGUF")
    assert isinstance(err, UnsupportedModelError)
    g = open_gguf_file(big, allow_big_endian=True)
    assert g.byte_order == ">" and g["x.b"] == 7
    assert np.array_equal(g.tensor_bytes("t").view(">f4"), np.arange(4))
    assert read_metadata(big)["x.b"] == 7


def test_random_damage_never_escapes_as_another_error(vocab_gguf, tmp_path):
    """Bytes of the header overwritten at random: the file opens, or fails with a GGUFError."""
    data = vocab_gguf.read_bytes()
    with open_gguf_file(vocab_gguf) as g:
        header_end = g.data_offset
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.gguf"
    outcomes = {"ok": 0, "error": 0}
    for _ in range(400):
        damaged = bytearray(data)
        for pos in rng.integers(0, header_end, rng.integers(1, 4)):
            damaged[pos] = rng.integers(0, 256)
        bad.write_bytes(bytes(damaged))
        try:
            with open_gguf_file(bad, allow_big_endian=True) as g:
                g.metadata  # noqa: B018 - decoding must not fail either
            outcomes["ok"] += 1
        except GGUFError as exc:
            assert "bad.gguf" in str(exc)
            outcomes["error"] += 1
        except ModelError as exc:  # split checks, none expected here
            pytest.fail(f"unexpected {exc!r}")
    assert outcomes["ok"] and outcomes["error"]


def test_split_sets(tmp_path):
    from tests.quant.tiny_gguf import rand, write_gguf

    rng = np.random.default_rng(1)
    tensors = {f"blk.{i}.attn_norm.weight": (rand(rng, 64), T.F32) for i in range(4)}
    write_gguf(tmp_path / "s.gguf", "qwen3moe", tensors, split_max_tensors=2)
    parts = sorted(tmp_path.glob("s-*-of-*.gguf"))
    assert len(parts) == 2
    with open_gguf_file(parts[0]) as g:
        count_at = g.fields["split.tensors.count"].offset
        no_at = g.fields["split.no"].offset
    with open_gguf_file(parts[1]) as g:
        second_count_at = g.fields["split.tensors.count"].offset
    first, second = parts[0].read_bytes(), parts[1].read_bytes()

    _patch(parts[0], count_at, "<i", 5)  # split.tensors.count is an int32
    with pytest.raises(ModelError, match=r"s-00002-of-00002.gguf belongs to another GGUF set than s-00001-of-00002.gguf: "
                                         r"it says the set holds 4 tensors, s-00001-of-00002.gguf says 5"):
        open_gguf_set(parts[1])
    _patch(parts[1], second_count_at, "<i", 5)  # the parts agree, and lie together
    with pytest.raises(ModelError, match="lists 5 tensors but its parts hold 4"):
        open_gguf_set(parts[1])
    parts[0].write_bytes(first)
    parts[1].write_bytes(second)
    _patch(parts[0], no_at, "<H", 1)
    with pytest.raises(ModelError, match="s-00001-of-00002.gguf says it is part 2 of 2"):
        open_gguf_set(parts[0])
    parts[0].write_bytes(first)
    parts[1].write_bytes(parts[1].read_bytes().replace(b"blk.3.attn_norm", b"blk.0.attn_norm"))
    with pytest.raises(ModelError, match=r"Tensor 'blk.0.attn_norm.weight' appears twice in the GGUF set "
                                         r"s-00001-of-00002.gguf \(s-00001-of-00002.gguf and s-00002-of-00002.gguf\)"):
        open_gguf_set(parts[0])
    parts[1].unlink()
    with pytest.raises(ModelError, match="s-00002-of-00002.gguf is missing"):
        open_gguf_set(parts[0])


# --------------------------------------------------------------------------------------
# One reader for the whole project
# --------------------------------------------------------------------------------------


def test_every_reader_uses_it(vocab_gguf, monkeypatch):
    """backend/ neither imports gguf-py's GGUFReader nor calls ggml's C GGUF reader; the four
    readers of the project all go through gguf_reader (seen by making GGUFReader explode)."""
    offenders = []
    for path in (ROOT / "backend").rglob("*.py"):
        if path.is_relative_to(ROOT / "backend" / "convert"):  # the converter writes, and is not ours
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gguf"):
                offenders += [f"{path}: imports {a.name}" for a in node.names if a.name in ("GGUFReader", "gguf_reader")]
            elif isinstance(node, ast.Attribute) and node.attr == "GGUFReader":
                offenders.append(f"{path}: uses gguf.GGUFReader")
            elif isinstance(node, ast.Constant) and node.value == "gguf_init_from_file":
                offenders.append(f"{path}: binds ggml's gguf_init_from_file")
    assert offenders == []

    def boom(*args, **kwargs):
        raise AssertionError("gguf.GGUFReader was used")

    monkeypatch.setattr(gguf, "GGUFReader", boom)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", boom)
    from hybridmoe.backend.formats.gguf_weights import open_gguf
    from hybridmoe.backend.text.tokenizer import read_gguf_metadata
    from hybridmoe.backend.models.gguf_files import read_gguf

    assert read_gguf(vocab_gguf).metadata["tokenizer.ggml.tokens"].length == 2000
    assert read_gguf_metadata(vocab_gguf)["tokenizer.ggml.merges"][0] == "tok0 tok1"
    with open_gguf(vocab_gguf) as weights:
        assert weights.get("model.embed_tokens.weight").shape == (1000, 32)
        assert weights.metadata["qwen3moe.block_count"] == 2
    from hybridmoe.backend.llamacpp.header import read_header

    header = read_header(vocab_gguf)
    assert header.values["qwen3moe.block_count"] == 2 and "tokenizer.ggml.tokens" not in header.values
    assert header.tensor_names == ("token_embd.weight", "output_norm.weight", "blk.0.ffn_gate_exps.weight")


def test_each_reader_words_damage_its_way(vocab_gguf, tmp_path):
    from hybridmoe.backend.formats.gguf_weights import open_gguf
    from hybridmoe.backend.text.tokenizer import load_tokenizer, read_gguf_metadata
    from hybridmoe.backend.llamacpp.header import read_header
    from hybridmoe.backend.models.gguf_files import read_gguf

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(vocab_gguf.read_bytes()[:-400])  # inside the tensor data
    for read in (read_gguf, open_gguf):
        with pytest.raises(ModelError, match=r"cut.gguf cannot be read as GGUF: it is truncated or damaged \(tensor "
                                             r"'[^']+' data is not within the file bounds"):
            read(cut)
    with pytest.raises(ModelError, match="cut.gguf is damaged or incomplete: tensor '[^']+' data is not within the "
                                         "file bounds") as err:
        read_header(cut)
    assert err.value.hint == "Download the file again."
    assert len(read_gguf_metadata(cut)["tokenizer.ggml.tokens"]) == 2000  # the vocabulary is whole
    cut.write_bytes(vocab_gguf.read_bytes()[:5000])  # inside the token list
    with pytest.raises(ModelError, match="cut.gguf cannot be read as GGUF: it is truncated or damaged"):
        load_tokenizer(cut)

    big = _write(tmp_path / "be.gguf", kv={"qwen3moe.block_count": (2, V.UINT32)}, arch="qwen3moe",
                 tensors={"output_norm.weight": np.ones(8, np.float32)}, endianess=gguf.GGUFEndian.BIG)
    assert read_gguf(big).metadata["qwen3moe.block_count"] == 2  # inspecting needs no tensor data
    assert read_gguf_metadata(big)["qwen3moe.block_count"] == 2
    for read in (open_gguf, read_header):  # neither torch nor llama.cpp can use the data
        with pytest.raises(UnsupportedModelError, match="be.gguf is a big-endian GGUF"):
            read(big)
