"""Whether this machine's engine computes CPU experts through the native kernels, without
importing torch (the planner asks; hybridmoe.backend.engine.native_kernels, which the engine
uses, imports torch).

The switch is the engine's: ``HYBRIDMOE_NATIVE`` set to 0/false/no/off, or an extension that was
never built, sends every CPU expert to the PyTorch reference (native_kernels.enabled).
"""

from __future__ import annotations

import os

__all__ = ["native_kernels_missing", "turned_off"]


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
