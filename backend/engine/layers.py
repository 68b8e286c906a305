"""Small layers every family shares: linear projections, RMSNorm, the gated MLP.

Weights arrive already materialised on the main device in the compute dtype (see
``loader``); these modules hold them as buffers (inference only, no autograd state).
Numerics follow transformers: RMSNorm in float32, rounding where the reference rounds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backend.errors import UnsupportedModelError

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedModelError(
            f"activation {name!r} is not supported by the embedded engine",
            "Run this model with `--backend llamacpp`.",
        ) from None


class Linear(nn.Module):
    """y = x W^T (+ b) with W [out, in] as the checkpoint stores it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """x / rms(x) * w, normalised in float32.

    `round_before_weight`: Llama-style models round the normalised value to the input dtype
    and then multiply by the weight; GPT-OSS multiplies in float32 and rounds once.
    """

    def __init__(self, weight: torch.Tensor, eps: float, *, round_before_weight: bool = True):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps
        self.round_before_weight = round_before_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.round_before_weight:
            return self.weight * h.to(dtype)
        return (self.weight * h).to(dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): dense layers, shared experts."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, act: str = "silu"):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))
