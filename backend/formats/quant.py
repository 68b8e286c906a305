"""Quantized weight formats, kept as stored and dequantized on demand.

Routed experts of a giant MoE stay in host memory in the form the checkpoint stores them
(GGUF blocks, DeepSeek fp8 blocks, compressed-tensors int4, GPT-OSS MXFP4). ``QuantTensor``
holds those bytes without copying them (views of the file's mmap where the source allows)
together with the logical float shape, and knows how to turn itself into floats. Native CPU
kernels read the same bytes directly later; ``dequantize`` and ``linear`` here are the
reference they are tested against.

Shapes are in PyTorch order: ``[out, in]`` for a matrix, ``[E, out, in]`` for merged experts.
Quantization always runs along the last dimension (GGUF ``ne[0]``, int4 groups, MXFP4
blocks; fp8 blocks span 128 rows as well), so every leading index selects whole blocks and
``q[i]`` / ``q[a:b]`` are views, not copies.

Format names follow ``hybridmoe.backend.models.formats`` (named for what they store, llama.cpp style):
the GGML types lower-cased (``q8_0``, ``q4_k``, ``mxfp4``, ...), ``fp8_block``, ``int4_g32``
and ``mxfp4`` for GPT-OSS' safetensors experts. MXFP4 exists in two byte layouts with the same
numbers, so ``QuantTensor.layout`` says which one: ``"gguf"`` (17-byte blocks, scale first,
elements 0-15 in the low nibbles) or ``"hf"`` (separate ``blocks``/``scales``, element pairs
interleaved in each byte). A kernel must dispatch on both.

All arithmetic is vectorised torch on the device the bytes are on, so the same code
dequantizes on a GPU. Results are computed in float32 and rounded once to the requested
dtype; for the GGUF types they are bit-identical to ``gguf.quants.dequantize`` (the order
of the float operations mirrors ggml's reference so no rounding differs).
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridmoe.backend.errors import UnsupportedModelError
from hybridmoe.backend.formats.iquants import DEQUANTIZERS as IQ_DEQUANTIZERS

__all__ = [
    "GGUF_FLOAT_TYPES",
    "GGUF_SUPPORTED_TYPES",
    "QuantTensor",
    "dequantize",
    "from_compressed_int4",
    "from_fp8_block",
    "from_gguf",
    "from_mxfp4",
    "linear",
]

QK_K = 256  # weights per GGUF K-quant super-block

# GGUF float types come back as plain torch tensors (views of the mmap): nothing to dequantize.
GGUF_FLOAT_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}


def _torch_view(arr: np.ndarray) -> torch.Tensor:
    """A torch tensor sharing `arr`'s memory, also when `arr` is a read-only mmap.

    GGUF files are mapped read-only (a private writable mapping would be charged against
    the commit limit for the whole file, which fails for models larger than RAM). torch
    warns about non-writable arrays because writing through the tensor would fault; the
    engine never writes to weights, so the warning is silenced here, once, on purpose.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        return torch.from_numpy(np.asarray(arr))


# --------------------------------------------------------------------------------------
# GGUF block dequantizers. Each takes uint8 blocks [N, type_size] and returns float32
# [N, block_size]. They mirror gguf-py's numpy reference (gguf/quants.py, itself a port of
# ggml-quants.c) operation for operation, so the float32 results are bit-identical.
# --------------------------------------------------------------------------------------


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 stored at byte `offset` of each block, as float32 [N, 1]."""
    # .contiguous() makes the two-byte column viewable as float16 whatever the block stride.
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def _shifts(values: Sequence[int], shape: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def _nibbles_split(qs: torch.Tensor) -> torch.Tensor:
    """[N, 16] bytes -> [N, 32] values: low nibbles are elements 0-15, high nibbles 16-31.

    This is the ggml order for all 32-weight types (Q4_0, Q4_1, Q5_x, IQ4_NL, MXFP4).
    """
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    x = b[:, 2:34].view(torch.int8).to(torch.float32)
    return x * d


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles_split(b[:, 2:18]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    m = _f16(b, 2)
    q = _nibbles_split(b[:, 4:20]).to(torch.float32)
    return d * q + m


def _q5_high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[N, 4] bytes holding a little-endian uint32 -> [N, 32] bits (bit j is element j)."""
    bits = qh.unsqueeze(-1) >> _shifts(range(8), (1, 1, 8), qh.device)  # [N, 4, 8]
    return (bits & 1).reshape(qh.shape[0], 32)


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    qh = _q5_high_bits(b[:, 2:6])
    ql = _nibbles_split(b[:, 6:22])
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def _deq_q5_1(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    m = _f16(b, 2)
    qh = _q5_high_bits(b[:, 4:8])
    ql = _nibbles_split(b[:, 8:24])
    q = (ql | (qh << 4)).to(torch.float32)
    return d * q + m


def _deq_q2_k(b: torch.Tensor) -> torch.Tensor:
    # scales[16] | qs[64] | d | dmin. Sixteen 16-weight sub-blocks, 4-bit scale and min each.
    n = b.shape[0]
    scales = b[:, 0:16]
    qs = b[:, 16:80]
    d = _f16(b, 80)
    dmin = _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q3_k(b: torch.Tensor) -> torch.Tensor:
    # hmask[32] | qs[64] | scales[12] | d. Sixteen 16-weight sub-blocks with 6-bit signed
    # scales: the low 4 bits in bytes 0-7 (two per byte), the high 2 bits in bytes 8-11.
    n = b.shape[0]
    hmask = b[:, 0:32]
    qs = b[:, 32:96]
    scales = b[:, 96:108]
    d = _f16(b, 108)
    lscales = (scales[:, 0:8].reshape(n, 1, 8) >> _shifts([0, 4], (1, 2, 1), b.device)).reshape(n, 16)
    hscales = (scales[:, 8:12].reshape(n, 1, 4) >> _shifts([0, 2, 4, 6], (1, 4, 1), b.device)).reshape(n, 16)
    sc = ((lscales & 0x0F) | ((hscales & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> _shifts(range(8), (1, 1, 8, 1), b.device)).reshape(n, 16, 16) & 1
    qh = qh ^ 1  # ggml subtracts 4 where the mask bit is *clear*
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins (ggml get_scale_min_k4)."""
    d = scales[:, 0:4]
    m = scales[:, 4:8]
    md = scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qs[128]. Eight 32-weight sub-blocks; each 32-byte chunk of qs
    # holds two sub-blocks: the first in the low nibbles, the next in the high nibbles.
    n = b.shape[0]
    d = _f16(b, 0)
    dmin = _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = (b[:, 16:144].reshape(n, 4, 1, 32) >> _shifts([0, 4], (1, 1, 2, 1), b.device)) & 0x0F
    q = q.reshape(n, 8, 32).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:
    # d | dmin | scales[12] | qh[32] | qs[128]; bit j of qh[l] is the fifth bit of element l
    # of sub-block j.
    n = b.shape[0]
    d = _f16(b, 0)
    dmin = _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    qh = (b[:, 16:48].reshape(n, 1, 32) >> _shifts(range(8), (1, 8, 1), b.device)) & 1
    ql = (b[:, 48:176].reshape(n, 4, 1, 32) >> _shifts([0, 4], (1, 1, 2, 1), b.device)) & 0x0F
    q = (ql.reshape(n, 8, 32) | (qh << 4)).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql[128] | qh[64] | scales[16] (int8) | d. Two halves of 128 weights; in each half,
    # weights 0-63 take the low nibbles of ql[0:64], 64-127 the high nibbles, and the two
    # high bits come from qh[0:32] at shifts 0, 2, 4, 6 for the four 32-weight quarters.
    n = b.shape[0]
    ql = b[:, 0:128]
    qh = b[:, 128:192]
    scales = b[:, 192:208].view(torch.int8).to(torch.float32)
    d = _f16(b, 208)
    dl = (d * scales).reshape(n, 16, 1)
    lo = (ql.reshape(n, 2, 1, 64) >> _shifts([0, 4], (1, 1, 2, 1), b.device)) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)) & 0x03
    q = (lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    return (dl * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, QK_K)


# IQ4_NL's non-linear 4-bit grid (ggml kvalues_iq4nl), also used by IQ4_XS.
_IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _lut(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _deq_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _nibbles_split(b[:, 2:18]).to(torch.long)
    return d * _lut(_IQ4_GRID, b.device)[q]


def _deq_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # d | scales_h (uint16) | scales_l[4] | qs[128]. Eight 32-weight sub-blocks with 6-bit
    # signed scales: low 4 bits two per byte in scales_l, high 2 bits in scales_h.
    n = b.shape[0]
    d = _f16(b, 0)
    scales_h = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    sl = (b[:, 4:8].reshape(n, 4, 1) >> _shifts([0, 4], (1, 1, 2), b.device)).reshape(n, 8) & 0x0F
    sh = (scales_h.reshape(n, 1) >> torch.arange(0, 16, 2, device=b.device, dtype=torch.int32)) & 0x03
    sc = (sl.to(torch.int32) | (sh << 4)) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    q = (b[:, 8:136].reshape(n, 8, 1, 16) >> _shifts([0, 4], (1, 1, 2, 1), b.device)) & 0x0F
    vals = _lut(_IQ4_GRID, b.device)[q.reshape(n, 8, 32).to(torch.long)]
    return (dl * vals).reshape(n, QK_K)


# e2m1 values, doubled so they are integers; ggml pairs them with half the e8m0 scale.
_MXFP4_GRID_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml_e8m0_to_fp32_half: 2**(e-128) built from bits (exact; denormal for e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _deq_mxfp4(b: torch.Tensor) -> torch.Tensor:
    # e (uint8) | qs[16]
    d = _e8m0_half(b[:, 0:1])
    q = _nibbles_split(b[:, 1:17]).to(torch.long)
    return d * _lut(_MXFP4_GRID_X2, b.device)[q]


_GGUF_DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.Q8_0: _deq_q8_0,
    GGMLQuantizationType.Q4_0: _deq_q4_0,
    GGMLQuantizationType.Q4_1: _deq_q4_1,
    GGMLQuantizationType.Q5_0: _deq_q5_0,
    GGMLQuantizationType.Q5_1: _deq_q5_1,
    GGMLQuantizationType.Q2_K: _deq_q2_k,
    GGMLQuantizationType.Q3_K: _deq_q3_k,
    GGMLQuantizationType.Q4_K: _deq_q4_k,
    GGMLQuantizationType.Q5_K: _deq_q5_k,
    GGMLQuantizationType.Q6_K: _deq_q6_k,
    GGMLQuantizationType.IQ4_NL: _deq_iq4_nl,
    GGMLQuantizationType.IQ4_XS: _deq_iq4_xs,
    GGMLQuantizationType.MXFP4: _deq_mxfp4,
    **IQ_DEQUANTIZERS,
}

# Every GGML type a GGUF weight may have for the embedded engine to read it.
GGUF_SUPPORTED_TYPES = frozenset(_GGUF_DEQUANTIZERS) | frozenset(GGUF_FLOAT_TYPES)


# --------------------------------------------------------------------------------------
# The tensor type
# --------------------------------------------------------------------------------------


class QuantTensor:
    """Quantized weights as stored, with the logical float shape and a way back to floats.

    ``parts`` holds the stored tensors (uint8 GGUF rows, fp8 weight + scales, int32 words +
    bf16 scales, MXFP4 blocks + scales); they share storage with the source (mmap) unless
    the source itself had to copy. Indexing the leading dimension returns another
    QuantTensor viewing the same bytes: ``experts[e]`` is expert e of a merged
    ``[E, out, in]`` tensor, ``w[a:b]`` a block of rows, ``embed[token_ids]`` gathers rows
    (a copy, as torch indexing with a tensor always is).
    """

    __slots__ = ("format", "layout", "meta", "parts", "shape")

    def __init__(
        self,
        format: str,
        layout: str,
        shape: Sequence[int],
        parts: dict[str, torch.Tensor],
        meta: dict[str, Any] | None = None,
    ):
        self.format = format
        self.layout = layout  # "gguf" (ggml blocks) or "hf" (safetensors checkpoint layout)
        self.shape = torch.Size(int(s) for s in shape)
        self.parts = parts
        self.meta = dict(meta or {})

    # ---- tensor-like properties -------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the stored representation (scales included) this tensor covers."""
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / max(1, self.numel())

    @property
    def device(self) -> torch.device:
        return next(iter(self.parts.values())).device

    @property
    def ggml_type(self) -> GGMLQuantizationType | None:
        return self.meta.get("ggml_type")

    def to(self, device: torch.device | str, non_blocking: bool = False) -> QuantTensor:
        """The same stored bytes on another device (a copy unless already there)."""
        parts = {k: v.to(device, non_blocking=non_blocking) for k, v in self.parts.items()}
        return QuantTensor(self.format, self.layout, self.shape, parts, self.meta)

    def __repr__(self) -> str:
        return (
            f"QuantTensor(format={self.format!r}, layout={self.layout!r}, shape={tuple(self.shape)}, "
            f"nbytes={self.nbytes}, device={self.device})"
        )

    # ---- indexing along the leading dimension ----------------------------------------

    def _batch_dims(self) -> int:
        """Leading dimensions every part shares with the logical shape (indexable freely)."""
        if self.format == "fp8_block":
            return self.ndim - 2  # scales cover 128 rows: only dims above [out, in] are free
        return self.ndim - 1  # everything above the quantized row

    def __getitem__(self, key: Any) -> QuantTensor:
        if isinstance(key, tuple):
            if len(key) != 1:
                raise IndexError("QuantTensor can only be indexed along its leading dimension")
            key = key[0]
        if isinstance(key, (list, np.ndarray)):
            key = torch.as_tensor(key)
        elif not isinstance(key, (slice, torch.Tensor)):
            key = operator.index(key)  # ints, numpy ints; anything else is a TypeError
        if isinstance(key, torch.Tensor) and key.is_floating_point():
            raise TypeError("tensor indices must be integers or booleans")

        if self._batch_dims() >= 1:
            # Every part has the logical leading dims first; the trailing (stored) dims of
            # each part are untouched by indexing the first one.
            parts = {}
            trailing = {}
            for name, p in self.parts.items():
                trailing[name] = p.dim() - self._batch_dims()
                parts[name] = p[key]
            first = next(iter(parts))
            new_batch = parts[first].shape[: parts[first].dim() - trailing[first]]
            tail = self.shape[self._batch_dims() :]
            return QuantTensor(self.format, self.layout, (*new_batch, *tail), parts, self.meta)

        if self.format == "fp8_block" and self.ndim == 2:
            return self._fp8_rows(key)
        raise IndexError(
            f"cannot index a {self.ndim}-D {self.format} tensor: its only dimension is the quantized one"
        )

    def _fp8_rows(self, key: Any) -> QuantTensor:
        """Rows a:b of a 2-D fp8 block tensor: the scale rows covering them, plus an offset."""
        if not isinstance(key, slice):
            raise IndexError("a 2-D fp8_block tensor can only be sliced by rows (w[a:b])")
        start, stop, step = key.indices(self.shape[0])
        if step != 1:
            raise IndexError("a 2-D fp8_block tensor can only be sliced with step 1")
        stop = max(stop, start)
        bo = self.meta["block"][0]
        r0 = self.meta.get("row_offset", 0)
        a, b = r0 + start, r0 + stop  # rows within the stored weight's first scale block
        weight = self.parts["weight"][start:stop]
        scale = self.parts["scale_inv"][a // bo : max(a // bo, (b - 1) // bo + 1)]
        meta = dict(self.meta, row_offset=a % bo)
        return QuantTensor(self.format, self.layout, (stop - start, self.shape[1]),
                           {"weight": weight, "scale_inv": scale}, meta)

    # ---- back to floats ---------------------------------------------------------------

    def dequantize(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
        """The float tensor these bytes stand for, computed on `device` (default: where the bytes are).

        Computed in float32 and rounded once to `dtype`.
        """
        q = self if device is None else self.to(device)
        return _dequantize(q).to(dtype)


def _dequant_gguf(q: QuantTensor) -> torch.Tensor:
    qtype: GGMLQuantizationType = q.meta["ggml_type"]
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = q.parts["data"].reshape(-1, type_size)
    return _GGUF_DEQUANTIZERS[qtype](blocks).reshape(q.shape)


def _dequant_fp8_block(q: QuantTensor) -> torch.Tensor:
    w = q.parts["weight"]
    s = q.parts["scale_inv"].to(torch.float32)
    bo, bi = q.meta["block"]
    r0 = q.meta.get("row_offset", 0)
    out_rows, in_cols = w.shape[-2], w.shape[-1]
    # Expand each scale over its bo x bi block, then cut to the weight (the last block of a
    # dimension that is not a multiple of 128 is partial; DeepSeek's weight_dequant does the same).
    s = s.repeat_interleave(bo, dim=-2).repeat_interleave(bi, dim=-1)
    s = s[..., r0 : r0 + out_rows, :in_cols]
    return w.to(torch.float32) * s


def _dequant_int4(q: QuantTensor) -> torch.Tensor:
    packed = q.parts["weight_packed"]
    scale = q.parts["weight_scale"].to(torch.float32)
    group = q.meta["group_size"]
    cols = q.shape[-1]
    # compressed-tensors pack_to_int32: element i of a word sits at bits 4i..4i+3 (the first
    # element in the least significant nibble), stored as q + 8 (unsigned offset).
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nib = (packed.unsqueeze(-1) >> shifts) & 0x0F  # arithmetic shift is fine: masked after
    vals = (nib.reshape(*packed.shape[:-1], -1)[..., :cols] - 8).to(torch.float32)
    vals = vals.reshape(*vals.shape[:-1], cols // group, group)
    return (vals * scale.unsqueeze(-1)).reshape(q.shape)


# OCP MX e2m1 values (transformers' FP4_VALUES): index = sign bit << 3 | exponent << 1 | mantissa.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _e8m0(e: torch.Tensor) -> torch.Tensor:
    """2**(e-127) exactly from bits: e=0 is the denormal 2**-127, e=255 is NaN (OCP MX spec)."""
    e = e.to(torch.int32)
    bits = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    scale = bits.view(torch.float32)
    return torch.where(e == 255, torch.full_like(scale, float("nan")), scale)


def _dequant_mxfp4_hf(q: QuantTensor) -> torch.Tensor:
    blocks = q.parts["blocks"]  # [..., out, G, 16]
    scales = q.parts["scales"]  # [..., out, G]
    # GPT-OSS / transformers (_convert_moe_packed_tensors): the low nibble is the even
    # element, the high nibble the odd one.
    idx = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = _lut(_E2M1, blocks.device)[idx.to(torch.long)]
    return (vals * _e8m0(scales).unsqueeze(-1)).reshape(q.shape)


def _dequantize(q: QuantTensor) -> torch.Tensor:
    """float32 values of `q`, on the device its parts are on."""
    if q.layout == "gguf":
        return _dequant_gguf(q)
    if q.format == "fp8_block":
        return _dequant_fp8_block(q)
    if q.format.startswith("int4_g"):
        return _dequant_int4(q)
    if q.format == "mxfp4":
        return _dequant_mxfp4_hf(q)
    raise ValueError(f"no dequantizer for {q.format} ({q.layout} layout)")


# --------------------------------------------------------------------------------------
# Constructors
# --------------------------------------------------------------------------------------


def _ggml_type(ggml_type: GGMLQuantizationType | int | str) -> GGMLQuantizationType:
    if isinstance(ggml_type, str):
        try:
            return GGMLQuantizationType[ggml_type.upper()]
        except KeyError:
            raise ValueError(f"unknown GGML type {ggml_type!r}") from None
    return GGMLQuantizationType(int(ggml_type))


def from_gguf(
    data: np.ndarray | torch.Tensor,
    ggml_type: GGMLQuantizationType | int | str,
    shape: Sequence[int] | None = None,
    *,
    name: str | None = None,
) -> QuantTensor | torch.Tensor:
    """A GGUF tensor's bytes as a QuantTensor (or a plain torch tensor for F32/F16/BF16).

    `data` is the tensor's bytes as stored (uint8, any shape: ``GGUFFile.tensor_bytes`` of
    hybridmoe.backend.models.gguf_reader gives them as a view of the file's mapping) or what gguf-py's
    ``GGUFReader`` gives (``ReaderTensor.data``: for block types uint8 of shape
    ``[..., bytes_per_row]``, for F32/F16 the float array); nothing is copied.
    `shape` is the logical shape in torch order (outermost first, i.e. the reverse of the
    GGUF ``ne``); by default it follows from `data`'s shape. `name` goes into errors.
    """
    qtype = _ggml_type(ggml_type)
    what = f"GGUF tensor '{name}'" if name else "GGUF tensor"
    if qtype not in GGUF_SUPPORTED_TYPES:
        raise UnsupportedModelError(
            f"{what} is stored as {qtype.name}, which the embedded engine cannot read.",
            "Supported GGUF types: "
            + ", ".join(sorted(t.name for t in GGUF_SUPPORTED_TYPES))
            + ". Use a GGUF quantized with those, or run this model with the llama.cpp backend.",
        )
    t = data if isinstance(data, torch.Tensor) else _torch_view(data)
    block_size, type_size = GGML_QUANT_SIZES[qtype]

    if qtype in GGUF_FLOAT_TYPES:
        dtype = GGUF_FLOAT_TYPES[qtype]
        if t.dtype != dtype:
            if t.dtype != torch.uint8:
                raise ValueError(f"{what}: {qtype.name} data must be uint8 bytes or {dtype}, got {t.dtype}")
            t = t.view(dtype)  # bytes -> elements along the last (contiguous) dim
        if shape is not None and tuple(t.shape) != tuple(shape):
            t = t.reshape(tuple(shape))
        return t

    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    if shape is None:
        if t.shape[-1] % type_size:
            raise ValueError(f"{what}: {t.shape[-1]} bytes per row is not a whole number of {qtype.name} blocks")
        shape = (*t.shape[:-1], t.shape[-1] // type_size * block_size)
    shape = tuple(int(s) for s in shape)
    if shape[-1] % block_size:
        raise ValueError(f"{what}: rows of {shape[-1]} weights are not whole {qtype.name} blocks of {block_size}")
    byte_shape = (*shape[:-1], shape[-1] // block_size * type_size)
    if tuple(t.shape) != byte_shape:
        if t.numel() != math.prod(byte_shape):
            raise ValueError(f"{what}: {t.numel()} bytes do not hold a {qtype.name} tensor of shape {shape}")
        t = t.reshape(byte_shape)
    return QuantTensor(qtype.name.lower(), "gguf", shape, {"data": t}, {"ggml_type": qtype})


def from_fp8_block(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: Sequence[int] = (128, 128),
) -> QuantTensor:
    """DeepSeek-V3 fp8: float8_e4m3fn ``weight [..., out, in]`` and fp32 ``weight_scale_inv
    [..., ceil(out/128), ceil(in/128)]``; a weight's value is weight × the scale of its block.
    """
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"fp8_block weight must be float8, got {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError("fp8_block weight must have at least 2 dimensions")
    bo, bi = (int(b) for b in block_size)
    out, cols = weight.shape[-2:]
    expect = (*weight.shape[:-2], math.ceil(out / bo), math.ceil(cols / bi))
    if tuple(scale_inv.shape) != expect:
        raise ValueError(f"fp8_block scale_inv has shape {tuple(scale_inv.shape)}, expected {expect}")
    return QuantTensor("fp8_block", "hf", weight.shape, {"weight": weight, "scale_inv": scale_inv},
                       {"block": (bo, bi)})


def from_compressed_int4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: Sequence[int] | torch.Tensor,
    group_size: int | None = None,
) -> QuantTensor:
    """compressed-tensors ``pack-quantized`` symmetric int4 (Kimi K2 Thinking / K2.5 / K2.6).

    ``weight_packed`` int32 ``[..., out, ceil(in/8)]`` (eight values per word, the first in
    the lowest nibble, each stored as value + 8), ``weight_scale`` bf16/fp16
    ``[..., out, in/group]``, ``weight_shape`` the logical ``[..., out, in]`` (the checkpoint
    stores it as a small int tensor). Value = (nibble - 8) × scale of its group.
    """
    if isinstance(weight_shape, torch.Tensor):
        weight_shape = weight_shape.tolist()
    shape = tuple(int(s) for s in weight_shape)
    if weight_packed.dtype != torch.int32:
        raise ValueError(f"weight_packed must be int32, got {weight_packed.dtype}")
    if len(shape) != weight_packed.dim() or tuple(weight_packed.shape[:-1]) != shape[:-1]:
        raise ValueError(f"weight_packed {tuple(weight_packed.shape)} does not match weight_shape {shape}")
    cols = shape[-1]
    if weight_packed.shape[-1] != math.ceil(cols / 8):
        raise ValueError(f"weight_packed has {weight_packed.shape[-1]} words per row, expected {math.ceil(cols / 8)}")
    n_groups = weight_scale.shape[-1]
    group = group_size or cols // max(1, n_groups)
    if group * n_groups != cols or tuple(weight_scale.shape[:-1]) != shape[:-1]:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} does not give whole groups of {shape}")
    return QuantTensor(f"int4_g{group}", "hf", shape,
                       {"weight_packed": weight_packed, "weight_scale": weight_scale},
                       {"group_size": group})


def from_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> QuantTensor:
    """GPT-OSS MXFP4 experts as the HF checkpoint stores them.

    ``blocks`` uint8 ``[..., out, in/32, 16]`` (two e2m1 values per byte, the even element
    in the low nibble), ``scales`` uint8 ``[..., out, in/32]`` (e8m0: 2**(s-127)). The
    logical shape is ``[..., out, in]`` in torch linear order; note that transformers'
    GptOss experts use the transpose (``x @ W``) and interleave gate/up rows in gate_up_proj.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"mxfp4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    shape = (*scales.shape[:-1], scales.shape[-1] * 32)
    return QuantTensor("mxfp4", "hf", shape, {"blocks": blocks, "scales": scales})


# --------------------------------------------------------------------------------------
# Using them
# --------------------------------------------------------------------------------------


def dequantize(w: torch.Tensor | QuantTensor, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
    """Floats of `w`, whether it is a QuantTensor or already a torch tensor."""
    if isinstance(w, QuantTensor):
        return w.dequantize(dtype=dtype, device=device)
    return w.to(device=device if device is not None else w.device, dtype=dtype)


def linear(x: torch.Tensor, w: torch.Tensor | QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for a float or quantized `w`, in x's dtype on x's device.

    Reference path: dequantizes the whole weight, then one matmul. Native kernels replace
    it for the CPU experts and are tested against it.
    """
    wf = dequantize(w, dtype=x.dtype, device=x.device)
    if bias is not None:
        bias = bias.to(device=x.device, dtype=x.dtype)
    return torch.nn.functional.linear(x, wf, bias)
