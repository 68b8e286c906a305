"""Weights to the bytes of a GGUF tensor type.

``encode(x, qtype)`` turns a float tensor (any torch float dtype, any leading shape, rows
along the last dimension) into the bytes llama.cpp stores for ``qtype``: F32, F16, BF16
(torch casts, which round to nearest-even as ggml does), Q8_0 or Q4_0 (gguf-py's numpy
encoders, a port of ggml-quants.c's reference: the same bytes llama.cpp's converter writes).
Each call is single-threaded; the converter runs several at once on a thread pool (numpy
releases the GIL), which scales with the cores where torch's own intra-op threads, on
32-weight blocks, mostly synchronise.

``int4_to_q4_0`` re-packs compressed-tensors symmetric int4 (Kimi K2.x experts) into Q4_0
without re-quantizing: both store a 4-bit code q in 0..15 for the value (q - 8) × scale,
with one scale per 32 weights (or per 64/128, which covers whole Q4_0 blocks), so only the
nibble order and the scale's float format change.

``mxfp4_to_gguf`` re-packs GPT-OSS's MXFP4 (safetensors ``_blocks`` / ``_scales``) into GGML's
MXFP4 blocks, also without re-quantizing: both store 32 e2m1 codes and one e8m0 exponent
byte per block, and GGML's decoder (doubled e2m1 values times half the scale) gives the same
numbers from the same exponent byte, so the byte is copied and only the nibble order changes.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from hybridmoe.backend.formats.quant import QuantTensor

Q = GGMLQuantizationType

ENCODABLE = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0})
# Written only by copying blocks that are already in that format (int4_to_q4_0, mxfp4_to_gguf).
COPIED = frozenset({Q.Q4_0, Q.MXFP4})


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    """Bytes of a row of `n` weights in `qtype` (n must be a whole number of blocks)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return n // block * size


def tensor_bytes(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * row_bytes(qtype, shape[-1])


def fits(qtype: GGMLQuantizationType, row: int) -> bool:
    """Whether rows of `row` weights are whole blocks of `qtype`."""
    return row % GGML_QUANT_SIZES[qtype][0] == 0


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as uint8 rows [..., row_bytes] (no copy)."""
    t = t.contiguous()
    return t.view(torch.uint8).numpy()


def encode(x: torch.Tensor, qtype: GGMLQuantizationType) -> np.ndarray:
    """`x` in `qtype`: uint8 array of shape [*x.shape[:-1], row_bytes]."""
    if qtype == Q.F32:
        return _bytes(x.to(torch.float32))
    if qtype == Q.F16:
        return _bytes(x.to(torch.float16))
    if qtype == Q.BF16:
        # torch rounds float32 to bfloat16 to nearest-even, as ggml_compute_fp32_to_bf16 does;
        # a bf16 source is copied bit for bit.
        return _bytes(x.to(torch.bfloat16))
    if qtype in (Q.Q8_0, Q.Q4_0):
        return quantize(x.to(torch.float32).numpy(), qtype)
    raise ValueError(f"cannot encode {qtype.name}")


def int4_to_q4_0(q: QuantTensor) -> np.ndarray:
    """compressed-tensors int4 (group size a multiple of 32) as Q4_0 bytes, bit-exact.

    Packed words hold eight codes each, the first in the lowest nibble, each code the value
    plus 8 (compressed-tensors pack_to_int32); a Q4_0 block is an fp16 scale and 16 bytes,
    byte j holding codes j (low nibble) and j+16 (high). The bf16 group scale becomes the fp16
    block scale; that is exact for every scale fp16 represents (magnitudes 6.1e-5 to 65504 —
    int4 weight scales are around 1e-3), smaller ones round to fp16's subnormal grid.
    """
    if not q.format.startswith("int4_g") or q.layout != "hf":
        raise ValueError(f"not a compressed-tensors int4 tensor: {q!r}")
    group = q.meta["group_size"]
    if group % 32:
        raise ValueError(f"int4 group size {group} does not cover whole Q4_0 blocks of 32")
    cols = q.shape[-1]
    lead = q.shape[:-1]
    packed = q.parts["weight_packed"]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((packed.unsqueeze(-1) >> shifts) & 0x0F).to(torch.uint8)
    codes = codes.reshape(-1, packed.shape[-1] * 8)[:, :cols].reshape(-1, 32)
    nibbles = codes[:, :16] | (codes[:, 16:] << 4)
    scale = q.parts["weight_scale"].to(torch.float32).reshape(-1, cols // group)
    scale = scale.repeat_interleave(group // 32, dim=1).reshape(-1, 1).to(torch.float16)
    out = torch.cat((scale.view(torch.uint8), nibbles), dim=1)
    return out.numpy().reshape(*lead, cols // 32 * 18)


def mxfp4_to_gguf(q: QuantTensor) -> np.ndarray:
    """GPT-OSS MXFP4 (HF layout) as GGML MXFP4 bytes, bit-exact: uint8 [..., rows, in/32 * 17].

    HF: ``blocks [..., G, 16]``, byte j holding elements 2j (low nibble) and 2j+1 (high);
    ``scales [..., G]``, the e8m0 exponent. GGML block: the exponent byte, then 16 bytes, byte
    j holding elements j (low nibble) and j+16 (high), as in every 32-weight GGML type.
    """
    if q.format != "mxfp4" or q.layout != "hf":
        raise ValueError(f"not a GPT-OSS MXFP4 tensor: {q!r}")
    blocks, scales = q.parts["blocks"], q.parts["scales"]
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((scales.unsqueeze(-1), nibbles), dim=-1)  # [..., G, 17]
    return out.reshape(*out.shape[:-2], out.shape[-2] * 17).numpy()
