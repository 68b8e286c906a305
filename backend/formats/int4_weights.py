"""4-bit matrices for experts kept on a GPU: the stored 4-bit codes, repacked exactly.

A routed expert stored in a 4-bit format (Kimi's compressed-tensors int4 with groups of 32,
GGUF Q4_0/Q4_1/Q4_K/IQ4_NL/IQ4_XS, MXFP4) is held on the card with the same codes and group
scales it has on disk, so it takes the bytes it takes in host RAM (Kimi: 24.77 MB an expert,
against 44.06 MB widened to int8 per row). Every one of those formats dequantizes a weight as

    w = table[code] · scale[group] (+ min[group])

with a 4-bit `code`, a 16-entry `table` fixed by the format (the integers −8..7 for the
symmetric int4 formats, 0..15 with a `min` for Q4_1 and Q4_K, IQ4's non-linear grid, MXFP4's
e2m1 values) and one scale (and min) per group of 32 weights (Kimi: `group_size`). ``Int4Weight``
keeps exactly that: codes two to a byte [out, in/2] (the even column in the low nibble),
scales and mins [out, in/group] in the narrowest float type that holds them exactly (fp16 for
the GGUF types' fp16 scales, bf16 for compressed-tensors' and for MXFP4's powers of two). Two
formats derive a group's scale as a product (Q4_K: d·sc and dmin·m; IQ4_XS: d·(sc − 32)) that
neither 16-bit type holds exactly: those are rounded to fp16, a relative error of at most 2⁻¹¹
on a group's scale (the 4-bit step itself is 2⁻⁴ of the group's range).

PyTorch's int4 weight-only matmul (``torch._weight_int4pack_mm``) was the first candidate and
is not used: it takes a bf16 scale *and* zero point for every group, 5 bits a weight at groups
of 32 (27.53 MB a Kimi expert, 11 % more than stored, so 11 % fewer experts on the cards), its
CUDA build has no fp16 scales (Q4_0's would be rounded), and no table (IQ4 and MXFP4 would be
requantized). A decode step's experts are read as stored by the project's own Triton kernels
(``engine.decode_experts``); a longer call widens the matrix once for cuBLAS (``linear``), as
does the CPU (tests, and a main device that is the CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.backend.formats import quant
from hybridmoe.backend.formats.quant import QuantTensor
from hybridmoe.backend.models.formats import int4_resident_layout

_INT = tuple(float(v) for v in range(-8, 8))  # symmetric int4: code − 8
_UINT = tuple(float(v) for v in range(16))  # with a min: code as is
# The 16 values of the non-linear 4-bit formats, as quant.py dequantizes them.
TABLES = {
    "int": _INT,
    "uint": _UINT,
    "iq4": tuple(float(v) for v in quant._IQ4_GRID),
    "e2m1": quant._E2M1,
    "e2m1x2": tuple(float(v) for v in quant._MXFP4_GRID_X2),  # GGUF MXFP4: doubled, with half scales
}


class Int4Weight:
    """W[n, k] = table[code[n, k]] · scale[n, k // group] (+ min[n, k // group]).

    codes uint8 [out, in/2] (column 2j in the low nibble of byte j, 2j+1 in the high one);
    scale, min [out, in/group] in a 16-bit float type; `table` names a row of ``TABLES``.
    """

    __slots__ = ("codes", "scale", "min", "table", "group", "_table_t")

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None, table: str, group: int):
        out, half = codes.shape
        if codes.dtype != torch.uint8 or codes.dim() != 2 or table not in TABLES:
            raise ValueError(f"expected uint8 codes [out, in/2] and a table of {sorted(TABLES)}, "
                             f"got {codes.dtype} {tuple(codes.shape)} and {table!r}")
        if (2 * half) % group or scale.shape != (out, 2 * half // group) or (min is not None and min.shape != scale.shape):
            raise ValueError(f"scales {tuple(scale.shape)} do not give groups of {group} over {out}x{2 * half}")
        self.codes, self.scale, self.min, self.table, self.group = codes, scale, min, table, group
        self._table_t = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], 2 * self.codes.shape[1]))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.min) if t is not None)

    def table_tensor(self) -> torch.Tensor:
        """The 16 values as float32 on the codes' device (made once)."""
        if self._table_t is None or self._table_t.device != self.codes.device:
            self._table_t = torch.tensor(TABLES[self.table], dtype=torch.float32, device=self.codes.device)
        return self._table_t

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The matrix these bytes stand for, computed in float32 and rounded once to `dtype`."""
        out, k = self.shape
        codes = torch.stack((self.codes & 0x0F, self.codes >> 4), dim=-1).reshape(out, k // self.group, self.group)
        w = self.table_tensor()[codes.long()] * self.scale.float().unsqueeze(-1)
        if self.min is not None:
            w = w + self.min.float().unsqueeze(-1)
        return w.reshape(out, k).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T for x [..., in] through the widened matrix; the result has x's dtype. (A decode
        step's experts on a GPU are read as stored by ``engine.decode_experts``.)"""
        out, k = self.shape
        y = F.linear(x.reshape(-1, k), self.dequantize(x.dtype))
        return y.reshape(*x.shape[:-1], out)


def cat_rows(parts: list[Int4Weight], *, interleave: bool = False) -> Int4Weight | None:
    """The matrices stacked by rows (gate then up), or with their rows interleaved (GPT-OSS'
    gate_up: gate in even rows, up in odd ones); None when they differ in layout."""
    first = parts[0]
    if any(p.table != first.table or p.group != first.group or (p.min is None) != (first.min is None)
           or p.scale.dtype != first.scale.dtype or p.shape[1] != first.shape[1] for p in parts):
        return None

    def join(ts):
        return torch.stack(ts, dim=1).reshape(-1, ts[0].shape[1]) if interleave else torch.cat(ts)

    mins = None if first.min is None else join([p.min for p in parts])
    return Int4Weight(join([p.codes for p in parts]), join([p.scale for p in parts]), mins, first.table, first.group)


# ---- from the stored formats -------------------------------------------------------------


def from_quant(q: QuantTensor | torch.Tensor, device: torch.device | str | None = None) -> Int4Weight | None:
    """A 2-D 4-bit QuantTensor's codes and scales, exactly (Q4_K/IQ4_XS: scales rounded to fp16,
    see the module note), on `device`; None for anything else (a float tensor, a format
    without a 4-bit form)."""
    if not isinstance(q, QuantTensor) or q.ndim != 2 or int4_resident_layout(q.format) is None:
        return None
    q = q if device is None else q.to(device)
    out, k = q.shape
    if q.layout == "gguf":
        type_size = quant.GGML_QUANT_SIZES[q.meta["ggml_type"]][1]
        codes, scale, mins, table = _gguf_parts(q.format, q.parts["data"].reshape(-1, type_size))
    elif q.format == "mxfp4":
        blocks, e = q.parts["blocks"], q.parts["scales"]
        codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(out, k)
        scale, mins, table = quant._e8m0(e), None, "e2m1"
    else:  # compressed-tensors int4: value + 8 in nibbles of int32 words, first in the lowest
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.parts["weight_packed"].device)
        codes = ((q.parts["weight_packed"].unsqueeze(-1) >> shifts) & 0x0F).reshape(out, -1)[:, :k]
        scale, mins, table = q.parts["weight_scale"], None, "int"
    group = int4_resident_layout(q.format)[0]
    codes = codes.reshape(out, k).to(torch.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scale = _narrow(scale.reshape(out, k // group))
    mins = None if mins is None else _narrow(mins.reshape(out, k // group))
    return Int4Weight(packed, scale, mins, table, group)


def _gguf_parts(fmt: str, b: torch.Tensor):
    """(codes [blocks, block], scale, min or None, table) of GGUF blocks b [blocks, type_size],
    in the element order quant.py's dequantizers give (a row's blocks one after another)."""
    n = b.shape[0]
    if fmt in ("q4_0", "iq4_nl"):
        return quant._nibbles_split(b[:, 2:18]), quant._f16(b, 0), None, "int" if fmt == "q4_0" else "iq4"
    if fmt == "q4_1":
        return quant._nibbles_split(b[:, 4:20]), quant._f16(b, 0), quant._f16(b, 2), "uint"
    if fmt == "mxfp4":
        return quant._nibbles_split(b[:, 1:17]), quant._e8m0_half(b[:, 0:1]), None, "e2m1x2"
    shifts = quant._shifts([0, 4], (1, 1, 2, 1), b.device)
    if fmt == "q4_k":
        sc, mn = quant._k_scale_min(b[:, 4:16])
        codes = (b[:, 16:144].reshape(n, 4, 1, 32) >> shifts) & 0x0F
        return codes.reshape(n, 256), quant._f16(b, 0) * sc.float(), -(quant._f16(b, 2) * mn.float()), "uint"
    if fmt == "iq4_xs":
        scales_h = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
        sl = (b[:, 4:8].reshape(n, 4, 1) >> quant._shifts([0, 4], (1, 1, 2), b.device)).reshape(n, 8) & 0x0F
        sh = (scales_h.reshape(n, 1) >> torch.arange(0, 16, 2, device=b.device, dtype=torch.int32)) & 0x03
        sc = (sl.to(torch.int32) | (sh << 4)) - 32
        codes = (b[:, 8:136].reshape(n, 8, 1, 16) >> shifts) & 0x0F
        return codes.reshape(n, 256), quant._f16(b, 0) * sc.float(), None, "iq4"
    raise ValueError(f"{fmt} has no 4-bit form")


def _narrow(s: torch.Tensor) -> torch.Tensor:
    """`s` in fp16 or bf16, whichever holds every value exactly; else fp16 (rounded) where its
    range holds them, else bf16."""
    s32 = s.float()
    for dtype in (torch.float16, torch.bfloat16):
        if torch.equal(s32.to(dtype).float(), s32):
            return s32.to(dtype).contiguous()
    half = s32.to(torch.float16)
    if torch.isfinite(half).all() and not ((half == 0) & (s32 != 0)).any():
        return half.contiguous()
    return s32.to(torch.bfloat16).contiguous()
