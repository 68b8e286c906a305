"""Rotary position embeddings: frequency schedules and the two rotation layouts.

Frequencies follow transformers' ``modeling_rope_utils`` exactly (same float32 formulas),
so cos/sin match the reference bit for bit: ``default``, ``linear``, ``llama3`` and
``yarn`` (DeepSeek-V3/Kimi K2 with mscale, GPT-OSS without truncation).

Layouts: "halves" rotates (x[:d/2], x[d/2:]) pairs (Llama/NeoX style); "pairs" rotates
(x[0], x[1]), (x[2], x[3]), ... (DeepSeek's interleaved weights) and writes the result
de-interleaved, as transformers does; attention scores only see q·k, which is the same
under any permutation applied to both, so the cached keys may keep that order.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hybridmoe.backend.models.hf_config import RopeParams
from hybridmoe.backend.models.layer_description import Rotation


def inverse_frequencies(params: RopeParams, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention_factor scaling cos and sin)."""
    base = params.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if params.kind == "default":
        return inv_freq, 1.0
    if params.kind == "linear":
        return inv_freq / params.get("factor"), 1.0
    if params.kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    return _yarn(params, dim, max_position_embeddings)


def _llama3(inv_freq: torch.Tensor, params: RopeParams) -> torch.Tensor:
    factor = params.get("factor")
    low, high = params.get("low_freq_factor"), params.get("high_freq_factor")
    old_context = params.get("original_max_position_embeddings")
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: RopeParams, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = params.theta
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, float(attention_factor)


def softmax_scale_multiplier(params: RopeParams) -> float:
    """DeepSeek's YaRN also sharpens the softmax by mscale(factor, mscale_all_dim)^2."""
    if params.kind == "default":
        return 1.0
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return 1.0
    m = yarn_mscale(params.get("factor"), mscale_all_dim)
    return m * m


class Rotary(nn.Module):
    """cos/sin tables for positions [0, max_context) and the rotation itself.

    `rotary_dim` may be smaller than the head (partial rotary, GLM-4.5): the remaining
    features pass through unrotated.
    """

    def __init__(
        self,
        params: RopeParams,
        rotary_dim: int,
        max_context: int,
        max_position_embeddings: int,
        *,
        layout: str = "halves",
        float32_math: bool = False,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        if layout not in ("halves", "pairs"):
            raise ValueError(f"unknown rotary layout {layout!r}")
        self.params = params
        self.rotary_dim = rotary_dim
        self.layout = layout
        # DeepSeek-V2's reference rotates in float32 (complex multiply) and rounds once.
        self.float32_math = float32_math
        inv_freq, attention_factor = inverse_frequencies(params, rotary_dim, max_position_embeddings)
        freqs = torch.arange(max_context, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        self.register_buffer("cos", (freqs.cos() * attention_factor).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * attention_factor).to(device), persistent=False)

    def describe(self) -> Rotation:
        return Rotation(self.params, self.rotary_dim, self.layout, self.float32_math)

    def tables(self, start: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, rotary_dim/2] for positions start..start+n-1, in the math dtype."""
        math_dtype = torch.float32 if self.float32_math else dtype
        return self.cos[start : start + n].to(math_dtype), self.sin[start : start + n].to(math_dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [..., n, head_dim] whose second-to-last axis runs over the n positions."""
        d = self.rotary_dim
        dtype = x.dtype
        rot, rest = (x, None) if x.shape[-1] == d else (x[..., :d], x[..., d:])
        if self.float32_math:
            rot = rot.float()
        if self.layout == "halves":
            x1, x2 = rot[..., : d // 2], rot[..., d // 2 :]
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)
        return out if rest is None else torch.cat((out, rest), dim=-1)
