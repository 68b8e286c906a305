"""Which of kt-kernel's paths `bench kernels` compares each format with (kt-kernel itself is a
benchmark peer, not installed for the tests)."""

from __future__ import annotations

from hybridmoe.backend.bench.kt_kernel_peer import methods

AMX = {"avx512f", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}


def test_on_amx_its_amx_classes_come_first_where_they_have_the_formats_bits():
    assert methods("q8_0", AMX) == ("amx", "default")
    assert methods("q4_0", AMX) == ("amx", "default")
    assert methods("q4_k", AMX) == ("default",)  # no AMX class stores K-quant blocks


def test_without_amx_the_llamafile_raw_int4_or_bf16_path_alone():
    assert methods("q8_0", {"avx512f", "avx512_bf16"}) == ("default",)
    assert methods("int4_g32", set()) == ("default",)
    assert methods("iq2_s", AMX) == ()  # its llamafile path refuses iq2_s
