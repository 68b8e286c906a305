"""Which native kernel set a CPU's features get (cpu_kernels.native_kernel_set): the run-time
requirements of native/src/dispatch.cpp's supported_tables, mirrored."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridmoe.backend.hardware.cpu import X86_FEATURES
from hybridmoe.backend.hardware.cpu_kernels import (NATIVE_KERNEL_SETS, native_kernel_set, native_kernel_set_lacks)

AVX512_SET = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi", "avx512_bitalg", "gfni",
              "fma", "f16c")
AVX2_SET = ("avx2", "fma", "f16c")
DISPATCH = Path(__file__).resolve().parents[2] / "native" / "src" / "dispatch.cpp"


def test_a_cpu_with_every_flag_gets_the_avx512_set_also_with_amx():
    assert native_kernel_set((*AVX2_SET, *AVX512_SET)) == "avx512"
    assert native_kernel_set((*AVX2_SET, *AVX512_SET, "amx_tile", "amx_int8", "amx_bf16")) == "avx512"
    # dispatch.cpp asks for the AVX-512 set's flags alone (AVX2 is implied by the CPU, not checked).
    assert native_kernel_set(AVX512_SET) == "avx512"


def test_ice_lake_without_bf16_gets_the_avx512_set():
    # Ice Lake and Tiger Lake: VNNI, VBMI, BITALG, GFNI but no AVX512-BF16, which no kernel of the set uses.
    ice_lake = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi",
                "avx512_bitalg", "gfni", "avx512ifma", "avx512_vbmi2", "avx512_vpopcntdq")
    assert native_kernel_set(ice_lake) == "avx512"


def test_avx512_without_vbmi_or_another_flag_gets_the_avx2_set():
    # Cooper Lake: AVX-512 F/BW/VL/DQ, VNNI and BF16, but no VBMI (nor BITALG, GFNI).
    cooper_lake = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")
    assert native_kernel_set(cooper_lake) == "avx2"
    assert native_kernel_set_lacks("avx512", cooper_lake) == ("avx512vbmi", "avx512_bitalg", "gfni")
    # Every one of the AVX-512 set's flags is needed.
    for missing in AVX512_SET:
        features = tuple(f for f in (*AVX2_SET, *AVX512_SET) if f != missing)
        expected = "portable" if missing in AVX2_SET else "avx2"
        assert native_kernel_set(features) == expected, missing


def test_avx2_fma_f16c_gets_the_avx2_set_and_less_the_portable_one():
    assert native_kernel_set(AVX2_SET) == "avx2"
    assert native_kernel_set(["avx2", "fma", "f16c", "avx_vnni"]) == "avx2"  # a list, order free
    for missing in AVX2_SET:
        assert native_kernel_set(tuple(f for f in AVX2_SET if f != missing)) == "portable"
    assert native_kernel_set(("avx2", "avx512f")) == "portable"  # no FMA, F16C named: as dispatch.cpp
    assert native_kernel_set(()) == "portable"
    assert native_kernel_set(("neon", "dotprod", "sve")) == "portable"  # Arm: no x86 set is built
    assert native_kernel_set_lacks("portable", ()) == ()


def test_every_flag_a_kernel_set_needs_is_detected():
    for _, needs in NATIVE_KERNEL_SETS:
        assert set(needs) <= set(X86_FEATURES)


@pytest.mark.skipif(not DISPATCH.is_file(), reason="the native sources are not in this tree")
def test_the_requirements_are_dispatch_cpps():
    """The flags supported_tables checks for each x86 set, in GCC's names (no underscores):
    ours, by the same names with their underscores taken out."""
    source = DISPATCH.read_text()
    body = source[source.index("supported_tables()"):]
    body = body[: body.index("kernels_scalar()")]
    avx512, avx2 = body.split("v.push_back(kernels_avx512());")
    checked = [set(re.findall(r'__builtin_cpu_supports\("(\w+)"\)', part)) for part in (avx512, avx2)]
    ours = {name: {f.replace("_", "") for f in needs} for name, needs in NATIVE_KERNEL_SETS}
    assert checked == [ours["avx512"], ours["avx2"]]
