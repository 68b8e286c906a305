"""The CPU-resident experts of a MoE layer through the native kernels (``native/``).

``cpu_experts_forward`` has the contract of the PyTorch reference in ``experts.py``: x
[T, H], topk_ids [T, k] int64, topk_weights [T, k] on the CPU; the float32 partial sum
[T, H] over the experts of ``experts`` (ids of other experts, and -1, contribute nothing).
It computes them in one native call that releases the GIL, reading the stored bytes in
place: the views of the mmap'd checkpoint that ``ExpertStore`` holds are handed to C++ as
addresses (biases, a few KB, become float32). One exception, where it pays: q4_0,
int4_g32 and q4_k experts are copied once, at load (``prepare``), into a row-interleaved
layout whose integer GEMV runs at memory speed for a token and beats the fp32 GEMM for a
prompt (``native/src/repack.h`` says why); the copy has the stored size (q4_k +2.8 %) and
the source pages are released when they are a read-only file mapping (GGUF).

``try_forward`` is the engine's entry point: the native result when the extension is built
and the layer's storage is one it reads (see ``native_kernels.native_format``), else ``None``
and the caller runs the reference. ``HYBRIDMOE_NATIVE=0`` turns the native path off.

Formats: GGUF q8_0, q4_0, q5_0, q2_k, q3_k, q4_k, q5_k, q6_k, mxfp4, bf16, f16, f32 tensors; compressed-tensors
int4 with groups of 32 and bf16 scales (Kimi K2); GPT-OSS MXFP4 safetensors. gate and up
must share a format; down may differ (GGUF quant mixes). Not native: fp8_block, other int4
group sizes, the GGUF types without a kernel (q2_k, q3_k, iq*), GPT-OSS float checkpoints
stored transposed. They fall back to the reference, which reads everything.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.models.layer_description import CLAMPED_SWIGLU
from hybridmoe.backend.engine.native_kernels import Unsupported, enabled, matrix_ref, native_format
from hybridmoe.backend.formats.quant import QuantTensor

if TYPE_CHECKING:
    from hybridmoe.backend.engine.experts import HostExperts

__all__ = [
    "NativeExperts",
    "cpu_experts_forward",
    "native_for",
    "prepare",
    "try_forward",
    "unsupported_reason",
]

REGIMES = {"auto": 0, "decode": 1, "prefill": 2, "prompt": 3}


def _bias(b: torch.Tensor | None, start: int, step: int, n: int) -> torch.Tensor | None:
    if b is None:
        return None
    return b[start : start + (n - 1) * step + 1 : step].to(torch.float32).contiguous()


class NativeExperts:
    """One layer's CPU experts described to the native kernels (built once, kept)."""

    def __init__(self, experts: HostExperts, *, interleave: bool = True):
        store = experts.store
        if store.transposed:
            raise Unsupported("float GPT-OSS experts stored as x @ W are not read natively")
        H, I, E = store.hidden, store.intermediate, store.n_experts
        gate_up_alternate = experts.act.interleaved  # GPT-OSS: gate and up rows alternate in one matrix
        act = experts.act.kind
        if act in ("silu", "swish"):
            act = "silu"
        elif act == CLAMPED_SWIGLU:
            act = "gpt_oss"  # the native kernels' name for it
        else:
            raise Unsupported(f"activation {act!r}")
        self.hidden, self.intermediate, self.n_experts = H, I, E
        refs = torch.zeros((E, 3, 4), dtype=torch.int64)
        biases = torch.zeros((E, 3), dtype=torch.int64)
        cpu = torch.zeros(E, dtype=torch.uint8)
        keep: list[torch.Tensor] = []
        formats: set[tuple[str, str]] = set()
        for e in experts.ids:
            parts = store.stored(e)
            if "gate_up" in parts:
                gu = parts["gate_up"]
                fmt = native_format(gu)
                g_at, u_at, step = ((0, 1, 2) if gate_up_alternate else (0, I, 1))
                gate = matrix_ref(gu, fmt, I, g_at, step) if fmt else None
                up = matrix_ref(gu, fmt, I, u_at, step) if fmt else None
                gub = parts.get("gate_up_bias")
                gb, ub = _bias(gub, g_at, step, I), _bias(gub, u_at, step, I)
            else:
                fmt = native_format(parts["gate"])
                if fmt != native_format(parts["up"]):
                    raise Unsupported("gate and up are stored in different formats")
                gate = matrix_ref(parts["gate"], fmt, I) if fmt else None
                up = matrix_ref(parts["up"], fmt, I) if fmt else None
                gb, ub = _bias(parts.get("gate_bias"), 0, 1, I), _bias(parts.get("up_bias"), 0, 1, I)
            dfmt = native_format(parts["down"])
            if fmt is None or dfmt is None:
                what = parts.get("gate_up", parts.get("gate")) if fmt is None else parts["down"]
                raise Unsupported(f"stored as {_describe(what)}")
            down = matrix_ref(parts["down"], dfmt, H)
            db = _bias(parts.get("down_bias"), 0, 1, H)
            formats.add((fmt, dfmt))
            for j, (ref, kept) in enumerate((gate, up, down)):
                refs[e, j] = torch.tensor(ref, dtype=torch.int64)
                keep.extend(kept)
            for j, b in enumerate((gb, ub, db)):
                if b is not None:
                    biases[e, j] = b.data_ptr()
                    keep.append(b)
            cpu[e] = 1
        if len(formats) > 1:
            raise Unsupported(f"experts of one layer stored in several formats: {sorted(formats)}")
        self.format, self.down_format = formats.pop() if formats else ("f32", "f32")
        try:
            self.layer = native_kernels._native.MoELayer(self.format, self.down_format, H, I, refs, cpu.numpy(),
                                                         act, float(experts.act.alpha), float(experts.act.limit),
                                                         biases, interleave)
        except ValueError as err:
            raise Unsupported(str(err)) from None
        self._keep = keep  # the layer reads these tensors' memory: keep them alive with it

    @property
    def expert_bytes(self) -> int:
        """Stored bytes of one expert (gate, up, down): what a decode step reads per expert hit."""
        return self.layer.expert_bytes

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                regime: str = "auto", prefill_min_tokens: int = 0) -> torch.Tensor:
        """The float32 partial sum [T, H] (see the module docstring)."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        x = x.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty((x.shape[0], self.hidden), dtype=torch.float32)
        if x.shape[0]:
            self.layer.forward(x, ids, weights, out, REGIMES[regime], prefill_min_tokens)
        return out


def _describe(w: Any) -> str:
    if isinstance(w, QuantTensor):
        return f"{w.format} ({w.layout} layout)"
    return str(getattr(w, "dtype", type(w).__name__))


# One NativeExperts per HostExperts, built on first use; None remembers "not supported".
_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_reasons: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def native_for(experts: HostExperts) -> NativeExperts | None:
    """The native description of `experts`, or None when the kernels cannot read them."""
    if experts in _built:
        return _built[experts]
    native = None
    try:
        if not native_kernels.available():
            raise Unsupported(native_kernels.isa())
        native = NativeExperts(experts)
    except Unsupported as err:
        _reasons[experts] = str(err)
    _built[experts] = native
    return native


def prepare(experts: HostExperts) -> None:
    """Build the native layer now (at model load, under its progress) rather than on the
    first forward: for q4_0 / int4 experts that includes their interleaved copy."""
    if enabled() and len(experts):
        native_for(experts)


def unsupported_reason(experts: HostExperts) -> str | None:
    """Why `experts` run on the reference path (None when they run natively)."""
    if native_for(experts) is not None:
        return None
    return _reasons.get(experts, "unknown")


def try_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                experts: HostExperts) -> torch.Tensor | None:
    """The native partial sum, or None when the reference must run (disabled, not built,
    unsupported storage, tensors not on the CPU)."""
    if not enabled() or not len(experts) or x.device.type != "cpu" or x.dim() != 2:
        return None
    native = native_for(experts)
    if native is None:
        return None
    return native.forward(x, topk_ids, topk_weights, regime=native_kernels.expert_regime())


def cpu_experts_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        experts: HostExperts) -> torch.Tensor:
    """The reference contract, natively; raises when the experts cannot run natively."""
    if not len(experts):
        return torch.zeros(x.shape, dtype=torch.float32)
    native = native_for(experts)
    if native is None:
        raise RuntimeError(f"native CPU experts unavailable: {unsupported_reason(experts)}")
    return native.forward(x, topk_ids, topk_weights)
