"""The native extension (``native/``) as the engine uses it: whether it loaded, which kernel
set it runs, which stored formats it reads, and the addresses it is handed.

Every engine module that calls the kernels (the CPU experts in ``native_experts.py``, the
dense projections in ``native_linear.py``, decode attention in ``native_attention.py``, the
CPU decode step in ``cpu_decode.py``) goes through here, so the extension is imported once
and ``HYBRIDMOE_NATIVE=0`` turns all of them off at one switch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from hybridmoe.backend.formats.quant import QuantTensor
from hybridmoe.backend.hardware.cpu_kernels import turned_off
from hybridmoe.backend.models.formats import GGUF_CPU_KERNEL_TYPES

try:  # built by the package build; absent in a source tree that was never installed
    from hybridmoe import _native
except ImportError as e:  # pragma: no cover - depends on the build
    _native = None
    _IMPORT_ERROR = str(e)
else:
    _IMPORT_ERROR = ""

__all__ = [
    "Unsupported",
    "available",
    "enabled",
    "isa",
    "isa_info",
    "matrix_ref",
    "native_format",
    "rms_norm",
    "summary",
]

_GGUF_NATIVE = GGUF_CPU_KERNEL_TYPES
_FLOAT_NATIVE = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / rms(x) (* weight) over x's last dimension in float32, the mean of the squares in double
    as llama.cpp's (native/src/decode_ops.h)."""
    x = x.float().contiguous()
    out = torch.empty_like(x)
    if x.numel():
        w = None if weight is None else weight.float().contiguous().numpy()
        _native.rms_norm(x.numpy(), w, float(eps), out.numpy())
    return out


def available() -> bool:
    """Whether the extension was built and imports."""
    return _native is not None


def isa() -> str:
    """The native kernel set in use ("avx512_amx", "avx512_vnni", "avx2", "scalar"), or why there is none."""
    if _native is None:
        return f"unavailable ({_IMPORT_ERROR or 'not built'})"
    return _native.isa()


def isa_info() -> dict[str, Any]:
    """isa, note (a refused variant and why), supported variants, threads, NUMA nodes."""
    if _native is None:
        return {"isa": None, "note": _IMPORT_ERROR or "not built"}
    return dict(_native.isa_info())


def summary() -> str:
    """One line for `hybridmoe doctor`: the kernel set in use, its threads, and why a better
    one was not used; or why the CPU experts run on the PyTorch reference."""
    if not enabled():
        why = "turned off by HYBRIDMOE_NATIVE" if _native is not None else isa()
        return f"PyTorch reference ({why}): CPU experts and projections run far slower"
    info = isa_info()
    nodes = info["numa_nodes"]
    line = f"{info['isa']}, {info['threads']} threads" + (f" on {nodes} NUMA nodes" if nodes > 1 else "")
    return line + (f" ({info['note']})" if info.get("note") else "")


# What the rows of the kernels' calls in this thread are (``rows_are``): "decode" rows are
# tokens of different sequences, each computed on the few-token paths (the integer GEMV on
# Q8 activations, the experts' decode regime) at any count, so that a step of several
# sequences computes each row as a step of one would; "prompt" rows are a prompt chunk, each
# matrix computed on one path chosen by its stored format alone, at any count, so that a
# prompt gives the same numbers however it was split into chunks (a conversation continued
# from the cache gets the logits of a fresh prefill): the many-token path (dequantized panels
# and a GEMM), except for the formats with a row-interleaved copy (q4_0, iq4_nl, iq4_xs, q4_k,
# int4_g32, q8_0), whose integer GEMV is the faster at every count (native prompt_takes_gemv; on the
# mid-size Qwen3-MoE model, 2-core Zen 5: a 64-token prompt 1.5-1.6x, a 512-token one
# 1.06-1.3x faster than on the GEMM), and the other formats that take their GEMV at every
# count (q2_k, q3_k, q4_1, q5_1, the i-quants: native formats.h). "auto": by the measured
# switch points.
_ROWS: ContextVar[str] = ContextVar("hybridmoe_rows", default="auto")
_DENSE_THRESHOLD = {"auto": 0, "decode": 1 << 30, "prompt": -1}  # -1: native kPromptRows
_EXPERT_REGIME = {"auto": "auto", "decode": "decode", "prompt": "prompt"}


@contextmanager
def rows_are(kind: str) -> Iterator[None]:
    token = _ROWS.set(kind)
    try:
        yield
    finally:
        _ROWS.reset(token)


def dense_threshold(rows: str | None = None) -> int:
    """prefill_min_tokens for a dense projection's call over `rows` (default: this thread's,
    ``rows_are``; 0: the measured one)."""
    return _DENSE_THRESHOLD[rows or _ROWS.get()]


def expert_regime(rows: str | None = None) -> str:
    return _EXPERT_REGIME[rows or _ROWS.get()]


def enabled() -> bool:
    """Whether the engine uses the kernels: built, and not turned off by HYBRIDMOE_NATIVE."""
    return _native is not None and turned_off() is None


def native_format(w: Any) -> str | None:
    """The native kernels' name for how `w` (a stored matrix) is stored, or None."""
    if isinstance(w, QuantTensor):
        if w.layout == "gguf":
            return w.format if w.format in _GGUF_NATIVE else None
        if w.format == "int4_g32" and w.parts["weight_scale"].dtype == torch.bfloat16:
            return "int4_g32"
        if w.format == "mxfp4":
            return "mxfp4_hf"
        return None
    if isinstance(w, torch.Tensor):
        return _FLOAT_NATIVE.get(w.dtype)
    return None


# ---- addressing stored matrices ------------------------------------------------------


class Unsupported(Exception):
    """The native kernels cannot read this storage (the message says why)."""


def _row_major(t: torch.Tensor, inner_dims: int, what: str) -> None:
    """Raise unless the last `inner_dims` dims of `t` are one contiguous run per row."""
    if t.device.type != "cpu":
        raise Unsupported(f"{what} is not in host memory")
    expect = 1
    for d in range(t.dim() - 1, t.dim() - 1 - inner_dims, -1):
        if t.shape[d] != 1 and t.stride(d) != expect:
            raise Unsupported(f"{what} rows are not contiguous")
        expect *= t.shape[d]


def matrix_ref(w: Any, fmt: str, rows: int, start: int = 0, step: int = 1) -> tuple[list[int], list[torch.Tensor]]:
    """(data address, scale address, row stride, scale row stride) of rows start, start+step, ...
    of the 2-D stored matrix `w`, and the tensors those addresses point into."""
    if isinstance(w, torch.Tensor):
        parts = [(w, 1)]
    elif fmt == "int4_g32":
        parts = [(w.parts["weight_packed"], 1), (w.parts["weight_scale"], 1)]
    elif fmt == "mxfp4_hf":
        parts = [(w.parts["blocks"], 2), (w.parts["scales"], 1)]
    else:
        parts = [(w.parts["data"], 1)]
    if w.shape[0] < start + (rows - 1) * step + 1:
        raise Unsupported("matrix has fewer rows than the layer needs")
    out = [0, 0, 0, 0]
    keep = []
    for i, (t, inner) in enumerate(parts):
        _row_major(t, inner, "expert weight")
        stride = t.stride(0) * t.element_size()  # bytes from one row to the next
        out[i] = t.data_ptr() + start * stride
        out[2 + i] = stride * step
        keep.append(t)
    return out, keep
