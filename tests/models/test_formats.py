"""Storage formats: bits per weight, exact block arithmetic, GGUF type names, the Q4_K_M recipe."""

import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.formats import (
    FORMATS,
    Q4_K_M_EXPERT_BITS,
    file_type_name,
    get_format,
    ggml_type_name,
    gguf_row_fallback,
    mix_tensor_format,
    tensor_bytes,
    use_more_bits,
)


@pytest.mark.parametrize("name, bits", [
    ("bf16", 16), ("fp16", 16), ("fp32", 32), ("int4_g32", 4.5), ("q8_0", 8.5), ("q4_0", 4.5),
    ("q4_k", 4.5), ("q5_k", 5.5), ("q6_k", 6.5625), ("mxfp4", 4.25),
    ("fp8_block", 8 + 32 / 16384),
    # the community GGUF types and the ternary ones (GGML_QUANT_SIZES: block bytes * 8 / 256)
    ("iq2_xxs", 2.0625), ("iq2_xs", 2.3125), ("iq2_s", 2.5625), ("iq3_xxs", 3.0625), ("iq3_s", 3.4375),
    ("iq1_s", 1.5625), ("iq1_m", 1.75), ("tq1_0", 1.6875), ("tq2_0", 2.0625), ("iq4_xs", 4.25), ("iq4_nl", 4.5),
    ("q4_1", 5), ("q5_1", 6),
])
def test_bits_per_weight_table(name, bits):
    assert FORMATS[name].bits_per_weight == pytest.approx(bits)


def test_q4_k_m_average_follows_the_llama_cpp_recipe():
    # gate and up Q4_K, down Q6_K in half the layers and Q4_K in the others.
    assert Q4_K_M_EXPERT_BITS == pytest.approx((4.5 + 4.5 + (6.5625 + 4.5) / 2) / 3)
    assert FORMATS["q4_k_m"].bits_per_weight == pytest.approx(4.84375)
    assert sum(use_more_bits(i, 48) for i in range(48)) == 24


def test_block_arithmetic_is_exact():
    h, inter = 7168, 2048
    # Kimi K2.6 expert at int4 g32: packed int32 [out, in/8] + bf16 scales [out, in/32].
    per_expert = 2 * tensor_bytes("int4_g32", (inter, h)) + tensor_bytes("int4_g32", (h, inter))
    assert per_expert == 24_772_608 == 3 * h * inter * 4.5 / 8
    # DeepSeek-V3 fp8: one fp32 scale per 128x128 block.
    assert tensor_bytes("fp8_block", (inter, h)) == inter * h + (inter // 128) * (h // 128) * 4
    assert tensor_bytes("fp8_block", (100, 300)) == 100 * 300 + 1 * 3 * 4  # partial blocks round up
    assert tensor_bytes("q8_0", (4, 64)) == 4 * 2 * 34
    assert tensor_bytes("q4_k", (2, 512)) == 2 * 2 * 144
    assert tensor_bytes("q6_k", (1, 256)) == 210
    assert tensor_bytes("mxfp4", (32, 2880, 2880)) == 32 * 2880 * 90 * 17
    assert tensor_bytes("bf16", (3, 5)) == 30
    assert tensor_bytes("q4_k", (0, 256)) == 0


def test_rows_that_are_not_whole_blocks():
    with pytest.raises(ValueError):
        tensor_bytes("q4_k", (4, 2880))
    # llama.cpp's quantizer falls back, to F16 when even 32-weight blocks do not fit.
    assert gguf_row_fallback("q4_k", 2880) == "q5_0"
    assert gguf_row_fallback("q6_k", 1408) == "q8_0"
    assert gguf_row_fallback("q4_k", 100) == "f16"
    assert gguf_row_fallback("q4_k", 512) == "q4_k"
    # the 2- and 3-bit types and the i-quants take IQ4_NL, the ternary ones Q4_0
    for fmt in ("q2_k", "q3_k", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s"):
        assert gguf_row_fallback(fmt, 2880) == "iq4_nl", fmt
        assert gguf_row_fallback(fmt, 100) == "f16"
        assert gguf_row_fallback(fmt, 1024) == fmt
    assert gguf_row_fallback("tq1_0", 2880) == gguf_row_fallback("tq2_0", 1408) == "q4_0"


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M,
                                   Q.TQ1_0, Q.TQ2_0])
def test_the_new_gguf_types_are_named_formats(qtype):
    block, size = GGML_QUANT_SIZES[qtype]
    f = get_format(qtype.name)
    assert FORMATS[qtype.name.lower()] is f and f.kind == "gguf" and f.is_gguf
    assert (f.ggml_type, f.block_size, f.block_bytes, f.bits_per_weight) == (qtype, block, size, 8 * size / block)
    assert ggml_type_name(qtype) == qtype.name.lower() and f.description
    assert tensor_bytes(f, (3, 7, 512)) == 3 * 7 * 2 * size


def test_ggml_names_and_file_types():
    assert ggml_type_name(Q.Q4_K) == "q4_k"
    assert ggml_type_name(Q.Q8_0) == "q8_0"
    assert ggml_type_name(Q.BF16) == "bf16"
    assert ggml_type_name(Q.F16) == "f16"
    assert ggml_type_name(Q.MXFP4) == "mxfp4"
    assert ggml_type_name(Q.IQ2_XXS) == "iq2_xxs"
    assert file_type_name(15) == "q4_k_m"
    assert file_type_name(7) == "q8_0"
    assert file_type_name(9999) is None
    assert get_format("Q4_K").name == "q4_k"
    assert get_format("int4_g128").bits_per_weight == pytest.approx(4.125)
    with pytest.raises(ModelError, match="Unknown storage format 'int3'"):
        get_format("int3")


def test_q4_k_m_recipe():
    n = 48
    assert mix_tensor_format("q4_k_m", "output", None, n, 128, 2048) == "q6_k"
    assert mix_tensor_format("q4_k_m", "token_embd", None, n, 128, 2048) == "q4_k"
    assert mix_tensor_format("q4_k_m", "ffn_down", 0, n, 128, 768) == "q6_k"
    assert mix_tensor_format("q4_k_m", "ffn_down", 6, n, 128, 768) == "q4_k"
    assert mix_tensor_format("q4_k_m", "matrix", 0, n, 128, 2048) == "q4_k"
    assert mix_tensor_format("q4_k_m", "router", 3, n, 128, 2048) == "f32"
    # Mixtral (8 experts): attn_v Q8_0 and attn_output Q5_K.
    assert mix_tensor_format("q4_k_m", "attn_v", 5, 32, 8, 4096) == "q8_0"
    assert mix_tensor_format("q4_k_m", "attn_output", 5, 32, 8, 4096) == "q5_k"
    # GPT-OSS rows of 2880 weights are not whole super-blocks.
    assert mix_tensor_format("q4_k_m", "matrix", 1, 24, 32, 2880) == "q5_0"
