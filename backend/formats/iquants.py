"""PyTorch dequantizers of GGUF's grid i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M), the routed experts of the community GGUFs of DeepSeek, Kimi, Qwen3 and GLM.

Each takes uint8 blocks [N, type_size] and returns float32 [N, 256] with ggml's float
operations in ggml's order (a grid value times a sign times a block scale made as ggml makes
it), so the values are bit for bit those of its dequantizers. The CPU kernels read these
types in place (native/src/kernels_iq.inl); these dequantizers serve the GPU and the reference.
The grids and sign table are the formats' published constants, taken from the gguf package.
The block layouts are described in native/src/formats.h.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants


@lru_cache(maxsize=None)
def _grid(name: str, device: torch.device) -> torch.Tensor:
    """The grid of type `name` as float32 [entries, values per entry]."""
    cls = getattr(quants, name)
    cls.init_grid()
    return torch.from_numpy(np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape).copy()).to(device)


@lru_cache(maxsize=None)
def _signs(device: torch.device) -> torch.Tensor:
    """Eight sign bits from seven (the eighth makes the count of ones even), as int64 [128]."""
    return torch.from_numpy(np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64)).to(device)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    return b[:, at : at + 2].contiguous().view(torch.float16).to(torch.float32)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2k] bytes -> [..., k] little-endian 16-bit words as int64."""
    w = b.to(torch.int64)
    return w[..., 0::2] | (w[..., 1::2] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    w = b.to(torch.int64)
    return w[..., 0::4] | (w[..., 1::4] << 8) | (w[..., 2::4] << 16) | (w[..., 3::4] << 24)


def _sign_of_bits(signs: torch.Tensor) -> torch.Tensor:
    """[...] sign bytes -> [..., 8] of +1 / -1 (bit j: value j negative)."""
    bits = (signs.unsqueeze(-1) >> torch.arange(8, device=signs.device)) & 1
    return 1.0 - 2.0 * bits.to(torch.float32)


def _scaled(db: torch.Tensor, values: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """ggml's y = db * grid * (sign ? -1 : 1), for [N, 8, 4] groups of 8 values."""
    return (db.unsqueeze(-1) * values * signs).reshape(values.shape[0], 256)


def _deq_iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    q = b[:, 2:66].reshape(n, 8, 8)
    w = _u32(q[:, :, 4:8]).reshape(n, 8)
    db = d * (0.5 + (w >> 28).to(torch.float32)) * 0.25
    values = _grid("IQ2_XXS", b.device)[q[:, :, 0:4].to(torch.int64)]  # [n, 8, 4, 8]
    fields = (w.unsqueeze(-1) >> (7 * torch.arange(4, device=b.device))) & 127
    return _scaled(db.unsqueeze(-1).expand(n, 8, 4), values, _sign_of_bits(_signs(b.device)[fields]))


def _deq_iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    q = _u16(b[:, 2:66]).reshape(n, 8, 4)
    sc = b[:, 66:74].to(torch.int64)
    db = d.unsqueeze(-1) * (0.5 + torch.stack((sc & 15, sc >> 4), dim=-1).to(torch.float32)) * 0.25  # [n, 8, 2]
    values = _grid("IQ2_XS", b.device)[q & 511]
    return _scaled(db.repeat_interleave(2, dim=-1), values, _sign_of_bits(_signs(b.device)[q >> 9]))


def _deq_iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs = b[:, 2:34].reshape(n, 8, 4).to(torch.int64)
    signs = b[:, 34:66].reshape(n, 8, 4).to(torch.int64)
    qh = b[:, 66:74].to(torch.int64).unsqueeze(-1)
    sc = b[:, 74:82].to(torch.int64)
    idx = qs | ((qh << (8 - 2 * torch.arange(4, device=b.device))) & 0x300)
    db = d.unsqueeze(-1) * (0.5 + torch.stack((sc & 15, sc >> 4), dim=-1).to(torch.float32)) * 0.25
    return _scaled(db.repeat_interleave(2, dim=-1), _grid("IQ2_S", b.device)[idx], _sign_of_bits(signs))


def _deq_iq3_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs = b[:, 2:66].reshape(n, 8, 8).to(torch.int64)
    w = _u32(b[:, 66:98]).reshape(n, 8)
    db = d * (0.5 + (w >> 28).to(torch.float32)) * 0.5
    values = _grid("IQ3_XXS", b.device)[qs].reshape(n, 8, 4, 8)  # two 4-value entries per 8
    fields = (w.unsqueeze(-1) >> (7 * torch.arange(4, device=b.device))) & 127
    return _scaled(db.unsqueeze(-1).expand(n, 8, 4), values, _sign_of_bits(_signs(b.device)[fields]))


def _deq_iq3_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs = b[:, 2:66].reshape(n, 8, 8).to(torch.int64)
    qh = b[:, 66:74].to(torch.int64).unsqueeze(-1)
    signs = b[:, 74:106].reshape(n, 8, 4).to(torch.int64)
    sc = b[:, 106:110].to(torch.int64)
    s = torch.stack((sc & 15, sc >> 4), dim=-1).reshape(n, 8)
    db = d * (1 + 2 * s).to(torch.float32)
    idx = qs | (((qh >> torch.arange(8, device=b.device)) & 1) << 8)
    values = _grid("IQ3_S", b.device)[idx].reshape(n, 8, 4, 8)
    return _scaled(db.unsqueeze(-1).expand(n, 8, 4), values, _sign_of_bits(signs))


def _iq1(dl: torch.Tensor, idx: torch.Tensor, negative_delta: torch.Tensor) -> torch.Tensor:
    """ggml's y = dl * (grid + delta) for [N, 8, 4] groups of 8, delta = -+1/8."""
    values = _grid("IQ1_S", idx.device)[idx]  # [n, 8, 4, 8]
    delta = torch.where(negative_delta, -0.125, 0.125).to(torch.float32).unsqueeze(-1)
    return (dl.unsqueeze(-1) * (values + delta)).reshape(idx.shape[0], 256)


def _deq_iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)
    qs = b[:, 2:34].reshape(n, 8, 4).to(torch.int64)
    qh = _u16(b[:, 34:50]).reshape(n, 8)
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)
    idx = qs | (((qh.unsqueeze(-1) >> (3 * torch.arange(4, device=b.device))) & 7) << 8)
    return _iq1(dl.unsqueeze(-1).expand(n, 8, 4), idx, (qh & 0x8000).bool().unsqueeze(-1).expand(n, 8, 4))


def _deq_iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qs = b[:, 0:32].reshape(n, 8, 4).to(torch.int64)
    qh = b[:, 32:48].reshape(n, 8, 2).to(torch.int64)
    sc = _u16(b[:, 48:56])  # [n, 4]
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0x00F0) | ((sc[:, 2] >> 4) & 0x0F00) | (sc[:, 3] & 0xF000)
    d = bits.to(torch.int16).view(torch.float16).to(torch.float32).unsqueeze(-1)
    per = sc.repeat_interleave(2, dim=-1) >> (6 * (torch.arange(8, device=b.device) % 2))  # [n, 8]
    dl = d.unsqueeze(-1) * (2 * torch.stack((per & 7, (per >> 3) & 7), dim=-1) + 1).to(torch.float32)  # [n, 8, 2]
    h = qh.repeat_interleave(2, dim=-1)  # h0, h0, h1, h1
    shift = torch.tensor([8, 4, 8, 4], device=b.device)
    idx = qs | ((h << shift) & 0x700)
    negative = (h & torch.tensor([0x08, 0x80, 0x08, 0x80], device=b.device)).bool()
    return _iq1(dl.repeat_interleave(2, dim=-1), idx, negative)


DEQUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLQuantizationType.IQ2_XXS: _deq_iq2_xxs,
    GGMLQuantizationType.IQ2_XS: _deq_iq2_xs,
    GGMLQuantizationType.IQ2_S: _deq_iq2_s,
    GGMLQuantizationType.IQ3_XXS: _deq_iq3_xxs,
    GGMLQuantizationType.IQ3_S: _deq_iq3_s,
    GGMLQuantizationType.IQ1_S: _deq_iq1_s,
    GGMLQuantizationType.IQ1_M: _deq_iq1_m,
}
