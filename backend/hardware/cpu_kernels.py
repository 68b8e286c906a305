"""Whether this machine's engine computes CPU experts through the native kernels, and which
kernel set a CPU of given features runs, without importing torch (the planner asks;
hybridmoe.backend.engine.native_kernels, which the engine uses, imports torch).

The switch is the engine's: ``HYBRIDMOE_NATIVE`` set to 0/false/no/off, or an extension that was
never built, sends every CPU expert to the PyTorch reference (native_kernels.enabled).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = [
    "KERNEL_SET_NAMES",
    "NATIVE_KERNEL_SETS",
    "PORTABLE_KERNEL_SET",
    "native_kernel_set",
    "native_kernel_set_lacks",
    "native_kernels_missing",
    "turned_off",
]

# The flags each x86 kernel set of the native extension needs at run time, best set first, as
# /proc/cpuinfo names them (all in cpu.X86_FEATURES): native/src/dispatch.cpp's
# supported_tables, which must be mirrored here exactly. A CPU with AVX-512 that lacks one of
# the AVX-512 set's flags (Skylake-X: no VNNI; Cascade Lake and Cooper Lake: no VBMI, BITALG,
# GFNI) runs the AVX2 set; Ice Lake and Tiger Lake (no BF16, which the set does not use) run the
# AVX-512 set. The AMX set ("avx512_amx", where the OS allows the tiles and AVX512-BF16 converts
# its rows: every AMX CPU has it) is only offered beside the AVX-512 set and
# decodes with its kernels: it is "avx512" here. The extension's own names: "avx512_amx" or
# "avx512_vnni" for "avx512", "avx2", and "scalar" for the portable set, which every CPU runs
# (an Arm one among them: the x86 sets are not built there).
NATIVE_KERNEL_SETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512vbmi", "avx512_bitalg",
                "gfni", "fma", "f16c")),
    ("avx2", ("avx2", "fma", "f16c")),
)
PORTABLE_KERNEL_SET = "portable"
# How a plan's text names each set's kernels ("the AVX-512 kernels").
KERNEL_SET_NAMES = {"avx512": "AVX-512", "avx2": "AVX2", PORTABLE_KERNEL_SET: "portable"}


def native_kernel_set(features: Iterable[str]) -> str:
    """The native kernel set a CPU with `features` (lower-case /proc/cpuinfo names) runs the
    engine's CPU experts with: "avx512" (also on a CPU with AMX), "avx2" or "portable", by
    NATIVE_KERNEL_SETS (dispatch.cpp's run-time requirements)."""
    have = set(features)
    return next((name for name, needs in NATIVE_KERNEL_SETS if have.issuperset(needs)), PORTABLE_KERNEL_SET)


def native_kernel_set_lacks(kernel_set: str, features: Iterable[str]) -> tuple[str, ...]:
    """The flags of NATIVE_KERNEL_SETS' `kernel_set` that `features` lacks (none for the portable set)."""
    have = set(features)
    return tuple(f for f in dict(NATIVE_KERNEL_SETS).get(kernel_set, ()) if f not in have)


def turned_off() -> str | None:
    """Why HYBRIDMOE_NATIVE turns the kernels off, or None (the one reading of the switch:
    native_kernels.enabled asks it too)."""
    value = os.environ.get("HYBRIDMOE_NATIVE", "1")
    return f"turned off by HYBRIDMOE_NATIVE={value}" if value in ("0", "false", "no", "off") else None


def native_kernels_missing() -> str | None:
    """Why the engine would not use the native CPU kernels here; None when it would."""
    if off := turned_off():
        return off
    try:
        # The extension sits at the top of the package and imports nothing: no torch here.
        from hybridmoe import _native  # noqa: F401
    except ImportError as exc:
        return f"the native extension is not built ({exc})"
    return None
