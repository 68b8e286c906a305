"""Whether this machine's engine computes CPU experts through the native kernels, without
importing torch (the planner asks; hybridmoe.backend.engine.native_kernels, which the engine
uses, imports torch).

The switch is the engine's: ``HYBRIDMOE_NATIVE`` set to 0/false/no/off, or an extension that was
never built, sends every CPU expert to the PyTorch reference (native_kernels.enabled).
"""

from __future__ import annotations

import os

__all__ = ["native_kernels_missing"]

# The values native_kernels.enabled() reads as "off".
_OFF = ("0", "false", "no", "off")


def native_kernels_missing() -> str | None:
    """Why the engine would not use the native CPU kernels here; None when it would."""
    if os.environ.get("HYBRIDMOE_NATIVE", "1") in _OFF:
        return f"turned off by HYBRIDMOE_NATIVE={os.environ['HYBRIDMOE_NATIVE']}"
    try:
        # The extension sits at the top of the package and imports nothing: no torch here.
        from hybridmoe import _native  # noqa: F401
    except ImportError as exc:
        return f"the native extension is not built ({exc})"
    return None
