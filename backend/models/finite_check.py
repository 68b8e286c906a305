"""Which tensors of a GGUF hold values that are not numbers (NaN, plus or minus infinity): a
damaged download or a broken conversion, which makes every answer NaN.

Checked where it is cheap, without decoding weights: the tensors stored as floats (F32, F16,
BF16: norms, routers, often the embedding and the head) value by value, and the block scales
of the common quantized types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K), whose codes are
integers and cannot be NaN themselves. A value is not finite when its exponent bits are all
ones, so each dtype is read as unsigned integers and masked: no float conversion, no copy.
Other types (the i-quants, MXFP4) are counted as not checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hybridmoe.backend.models.gguf_reader import GGUFTensorInfo, open_gguf_set

# dtype read as unsigned integers -> the mask of its exponent bits
_EXPONENT = {
    "f32": (np.uint32, 0x7F800000),
    "f16": (np.uint16, 0x7C00),
    "bf16": (np.uint16, 0x7F80),
}
# quantized type -> (bytes per block, offsets of its fp16 scales in a block), from ggml's
# block layouts (ggml-common.h)
_BLOCK_SCALES = {
    "q8_0": (34, (0,)),
    "q4_0": (18, (0,)),
    "q4_1": (20, (0, 2)),
    "q5_0": (22, (0,)),
    "q5_1": (24, (0, 2)),
    "q2_k": (84, (80, 82)),
    "q3_k": (110, (108,)),
    "q4_k": (144, (0, 2)),
    "q5_k": (176, (0, 2)),
    "q6_k": (210, (208,)),
}
_CHUNK_BYTES = 64 * 1024 * 1024  # read in pieces: progress between them


@dataclass
class FiniteReport:
    """`bad`: tensor name -> how many of its checked values are not finite."""

    bad: dict[str, int] = field(default_factory=dict)
    checked: int = 0  # tensors
    not_checked: list[str] = field(default_factory=list)  # their types' names, one per tensor

    def to_dict(self) -> dict:
        return {"non_finite": self.bad, "tensors_checked": self.checked, "tensors_not_checked": len(self.not_checked)}


def check_finite(path: str | os.PathLike,
                 on_progress: Callable[[int, int, str], None] | None = None) -> FiniteReport:
    """Read the checkable tensors of the GGUF (set) at `path`. `on_progress(done, total, tensor)`
    counts bytes; the caller stops a long check by raising from it (or with Ctrl-C)."""
    files = open_gguf_set(path)
    try:
        tensors = [(g, t) for g in files for t in g.tensors]
        total = sum(t.nbytes or 0 for _, t in tensors if _checkable(t))
        report, done = FiniteReport(), 0
        for g, t in tensors:
            if not _checkable(t):
                report.not_checked.append(t.type_name)
                continue
            bad = 0
            for piece in _pieces(g.tensor_bytes(t), t):
                bad += _non_finite(piece, t.type_name)
                done += piece.nbytes
                if on_progress is not None:
                    on_progress(done, total, t.name)
            report.checked += 1
            if bad:
                report.bad[t.name] = bad
        return report
    finally:
        for g in files:
            g.close()


def _checkable(t: GGUFTensorInfo) -> bool:
    return t.nbytes is not None and (t.type_name in _EXPONENT or t.type_name in _BLOCK_SCALES)


def _pieces(data: np.ndarray, t: GGUFTensorInfo):
    """`data` in whole blocks (or elements) of about _CHUNK_BYTES."""
    unit = _BLOCK_SCALES[t.type_name][0] if t.type_name in _BLOCK_SCALES else np.dtype(_EXPONENT[t.type_name][0]).itemsize
    step = max(unit, _CHUNK_BYTES // unit * unit)
    for start in range(0, data.nbytes, step):
        yield data[start:start + step]


def _non_finite(piece: np.ndarray, type_name: str) -> int:
    if type_name in _EXPONENT:
        dtype, mask = _EXPONENT[type_name]
        values = piece.view(dtype)
    else:
        size, offsets = _BLOCK_SCALES[type_name]
        blocks = piece[: piece.nbytes // size * size].reshape(-1, size)
        values = np.concatenate([np.ascontiguousarray(blocks[:, o:o + 2]).view(np.uint16).ravel() for o in offsets])
        mask = _EXPONENT["f16"][1]
    return int(np.count_nonzero((values & mask) == mask))
