"""Which routed experts the embedded engine would compute on a slow path on the CPU, and why.

The engine's CPU experts run through the native kernels (``native/``), which read the stored
blocks in place at memory speed, for the formats in ``formats.CPU_KERNEL_DTYPES``. Experts in
any other format, and every CPU expert when the kernels are not in use (not built, or
``HYBRIDMOE_NATIVE=0``), go through the PyTorch reference (``engine/experts.py``), which
dequantizes each expert it needs on every call: measured in issue 45 on IQ4_XS, IQ4_NL, Q4_1 and
Q5_1 files before the kernels read them, 0.01-0.03x llama.cpp's decode speed on the same file.
(The always-read matrices in such a format are widened once at load instead: memory, not time,
and ``TensorInventory.widened`` counts it.)

Since issue 45 every GGUF type the engine reads, the kernels read too (tests/models/
test_slow_paths.py holds formats/quant.py's dequantizers to that), so a GGUF type outside
``CPU_KERNEL_DTYPES`` is one the engine does not read at all (TQ1_0, TQ2_0): not a slow path but
a refusal, which names the tensor and type (formats/gguf_weights.py) and sends ``auto`` to
llama.cpp. The slow formats left are safetensors layouts (fp8_block, int4 with groups other
than 32), and every format on a machine without the kernels.

``cpu_slow_path`` is pure: the model's tensor inventory and whether this machine's kernels are
in use in, the slow experts and the reason out. The planner counts them in its estimate and
names them in the plan; ``backends.load_session`` then prefers llama.cpp under ``auto``; ``run``
and the TUI say so.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType

from hybridmoe.backend.models.formats import CPU_KERNEL_DTYPES
from hybridmoe.backend.models.inventory import TensorInventory

__all__ = ["SLOW_PATH_SLOWDOWN", "SlowPath", "cpu_slow_path"]

# How many times longer a byte of a slow-path expert takes than a byte the kernels read at
# memory speed. Measured: the mid-size Q4_0 model with HYBRIDMOE_NATIVE=0 decodes 0.19 tokens/s
# where the kernels give 35-92 in the same session (180-480x; llama.cpp 21.4, so 0.009x) on
# the 2-core Xeon; the issue saw 0.01-0.03x llama.cpp on IQ4/Q4_1 files. 100 stays below every
# measured ratio, so that the plan's figure stays an upper bound.
SLOW_PATH_SLOWDOWN = 100.0


@dataclass(frozen=True)
class SlowPath:
    """Routed experts the CPU would compute by dequantizing them with PyTorch on every call."""

    formats: tuple[str, ...]  # their storage formats, the most bytes first
    tensors: int  # how many routed-expert tensors (a GGUF's merged [E, out, in] tensor is one)
    example: str  # one of them, by name
    bytes_by_layer: dict[int, int]  # their bytes per MoE layer (all experts of the layer)
    reason: str  # why they take the slow path

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_layer.values())

    def describe(self) -> str:
        """One sentence: what, where, why."""
        what = "routed-expert tensor" + ("s" if self.tensors != 1 else "")
        return (f"{self.tensors} {what} in {', '.join(f.upper() for f in self.formats)} (e.g. {self.example}) "
                f"would be computed on a slow path on the CPU: {self.reason}")


def cpu_slow_path(inventory: TensorInventory, kernels_missing: str | None) -> SlowPath | None:
    """The routed experts that would take the slow path if held in host memory (None: none).

    `kernels_missing` is why the native CPU kernels are not in use on the machine (None: they
    are). Which experts are held on the CPU is the plan's business: it scales these bytes by
    the share of each layer's experts it leaves there.
    """
    read = [f for f in inventory.routed_formats if f.lower() in CPU_KERNEL_DTYPES or not _is_gguf_type(f)]
    if kernels_missing is None:
        slow = [f for f in read if f.lower() not in CPU_KERNEL_DTYPES]
        reason = ("the native CPU kernels do not read " + ", ".join(f.upper() for f in slow)
                  + f", so every call dequantizes these experts with PyTorch (about {SLOW_PATH_SLOWDOWN:g}x "
                  "slower than reading them in place)")
    else:
        slow = read
        reason = (f"the native CPU kernels are not in use ({kernels_missing}), so the CPU experts run on the "
                  f"PyTorch reference, which dequantizes them on every call (about {SLOW_PATH_SLOWDOWN:g}x slower)")
    if not slow:
        return None
    slow.sort(key=lambda f: -inventory.routed_formats[f].bytes)
    by_layer = {layer: sum(b for f, b in formats.items() if f in slow)
                for layer, formats in inventory.routed_format_bytes_by_layer.items()}
    first = slow[0]
    return SlowPath(
        formats=tuple(slow),
        tensors=sum(inventory.routed_formats[f].tensors for f in slow),
        example=inventory.routed_formats[first].example,
        bytes_by_layer={layer: b for layer, b in by_layer.items() if b},
        reason=reason,
    )


def _is_gguf_type(name: str) -> bool:
    return name.upper() in GGMLQuantizationType.__members__
