"""Small layers every family shares: linear projections, RMSNorm, the gated MLP.

Weights arrive already materialised on the main device in the compute dtype (see
``loader``); these modules hold them as buffers (inference only, no autograd state).
Numerics follow transformers: RMSNorm in float32, rounding where the reference rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.backend.models import layer_description
from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.native_linear import NativeLinear
from hybridmoe.backend.errors import UnsupportedModelError

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

    runs_native: ClassVar[bool] = False  # every projection says whether the native kernels run it

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)  # (a float32 norm's output: see RMSNorm)


class RMSNorm(nn.Module):
    """x / rms(x) * w, normalised in float32.

    `round_before_weight`: Llama-style models round the normalised value to the input dtype
    and then multiply by the weight; GPT-OSS multiplies in float32 and rounds once.
    `float32`: return the weighted value unrounded, for blocks whose projections read float32
    rows (the native kernels on a CPU main device: ``model._norms_in_float32``), as
    llama.cpp's do; the projections round their outputs to the compute dtype.
    """

    float32: bool = False

    def __init__(self, weight: torch.Tensor, eps: float, *, round_before_weight: bool = True):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps
        self.round_before_weight = round_before_weight

    def describe(self) -> layer_description.Norm:
        return layer_description.Norm(self.eps, weight_before_rounding=not self.round_before_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.weight.dtype  # the compute dtype, also for the float32 residual stream
        if x.device.type == "cpu" and native_kernels.enabled():
            # The native norm on a CPU: the decode step's bits, and llama.cpp's (its mean in
            # double), which the Q8 codes of the next block's rows round on to the last bit.
            if self.float32:
                return native_kernels.rms_norm(x, self.weight, self.eps)
            h = native_kernels.rms_norm(x, None, self.eps)
        else:
            # One fused op for x * rsqrt(mean(x^2) + eps) (bit-equal to the four-op form,
            # measured): at decode the per-op overhead is most of a norm's cost.
            h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.float32:
            return self.weight.float() * h
        if self.round_before_weight:
            return self.weight * h.to(dtype)
        return (self.weight * h).to(dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): dense layers, shared experts."""

    def __init__(self, gate: nn.Module, up: nn.Module, down: nn.Module, act: str = "silu"):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.act = activation(act)
        self.act_name = layer_description.activation_name(act)
        # On a CPU main device gate and up run as one native call.
        self.gate_up = NativeLinear.fused(gate, up)

    def describe(self) -> layer_description.DenseFeedForward:
        return layer_description.DenseFeedForward(
            activation=self.act_name,
            projections_native=self.gate_up is not None and self.down.runs_native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(self.act(gate) * up)
        return self.down(self.act(self.gate(x)) * self.up(x))
