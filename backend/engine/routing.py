"""Routers: for each token, which k experts and with what weights.

Every router returns ``(topk_ids [T, k] int64, topk_weights [T, k])``. On a CPU main device
the logits are the native kernels' float32 sums and everything after them float32, as in
llama.cpp (``_keep_weight``). Elsewhere the weights keep the dtype the reference keeps
(float32 for DeepSeek/GLM/Mixtral, the model dtype for Qwen/OLMoE/GPT-OSS), because the
expert outputs are multiplied by them before rounding, and logits in the model dtype are
computed in float32 and rounded once, which is what a reduced-precision matmul does too (on
a CPU without the kernels that avoids PyTorch's bf16 GEMV, a fraction of the fp32 one's
speed there: see ``native_linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.backend.engine.native_linear import native_linear
from hybridmoe.backend.models.layer_description import Router


def _cpu_float(t: torch.Tensor) -> torch.Tensor:
    """A router weight as the router computes with it: float32 on the CPU (small: experts x hidden)."""
    return t.float() if t.device.type == "cpu" else t


def _keep_weight(router: nn.Module, weight: torch.Tensor, computed: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
    """The router's matrix as it computes with it, and the dtype the model holds it in (the
    compute dtype the loader gave it): the native kernels read it in that dtype (``native``,
    also the decode step's), the bytes the plan counts for it."""
    router.register_buffer("weight", computed, persistent=False)
    router.held_dtype = weight.dtype
    # On a CPU main device the logits are the native kernels' float32 sums, as llama.cpp's
    # are: row by row the same numbers at any row count (a prompt's however it is chunked),
    # which PyTorch's float32 GEMM does not promise (its GEMV and GEMM differ).
    # The matrix in its 16-bit held dtype where it is one (widened to float32 in the kernels,
    # which is exact): half the bytes for the same products, and what the plan counts.
    held = weight if weight.dtype in (torch.bfloat16, torch.float16) else computed
    router.native = native_linear(held.contiguous(), None if bias is None else bias.float(), weight.device)


def _matrix(router: nn.Module) -> dict:
    """What a router's description says of its matrix: the dtype it computes with, and whether
    the native kernels read it (a model built with them off has no ``native``, whichever way
    the switch is when it decodes)."""
    return dict(matrix_float32=router.weight.dtype == torch.float32, matrix_native=router.native is not None)


def _logits(router: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """x W^T (+ bias): float32 from the native kernels; else PyTorch's, rounded to `dtype`
    (None: left in float32)."""
    if router.native is not None and x.device.type == "cpu":
        return router.native(x, float32=True)
    logits = F.linear(x.to(router.weight.dtype), router.weight, bias)
    return logits if dtype is None else logits.to(dtype)


class SoftmaxTopK(nn.Module):
    """softmax over all experts, top k, optionally renormalised (Qwen2/3-MoE, OLMoE, Mixtral)."""

    def __init__(self, weight: torch.Tensor, k: int, *, normalize: bool, float32_weights: bool = False):
        super().__init__()
        _keep_weight(self, weight, _cpu_float(weight))
        self.k = k
        self.normalize = normalize
        # Mixtral keeps its routing weights in float32; the others round to the logits' dtype.
        self.float32_weights = float32_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _logits(self, x, dtype=self.held_dtype)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights if self.float32_weights else weights.to(logits.dtype)

    def describe(self) -> Router:
        return Router("softmax_topk", self.k, normalize=self.normalize,
                      **_matrix(self), weights_float32=self.float32_weights)


class SigmoidGroupedTopK(nn.Module):
    """DeepSeek-V3 / Kimi K2 / GLM-4.5 routing ("noaux_tc").

    Sigmoid scores; the choice adds a learned per-expert bias (e_score_correction_bias) that
    balances load but does not enter the weights. Experts are split into n_group groups, a
    group scores the sum of its two best biased scores, only the topk_group best groups are
    eligible, and the k best eligible experts are chosen. Weights are the unbiased sigmoid
    scores, optionally renormalised, times routed_scaling_factor. All in float32.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        correction_bias: torch.Tensor | None,
        k: int,
        *,
        n_group: int,
        topk_group: int,
        normalize: bool,
        scaling: float,
    ):
        super().__init__()
        _keep_weight(self, weight, weight.float())
        self.register_buffer("correction_bias", None if correction_bias is None else correction_bias.float(), persistent=False)
        self.k, self.n_group, self.topk_group = k, n_group, topk_group
        self.normalize, self.scaling = normalize, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = _logits(self, x).sigmoid()
        choice = scores if self.correction_bias is None else scores + self.correction_bias
        if self.n_group > 1 and self.topk_group < self.n_group:
            n_tokens, n_experts = choice.shape
            grouped = choice.view(n_tokens, self.n_group, n_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            eligible = eligible.unsqueeze(-1).expand_as(grouped).reshape(n_tokens, n_experts)
            choice = choice.masked_fill(~eligible, float("-inf"))
        ids = choice.topk(self.k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def describe(self) -> Router:
        return Router("sigmoid_group_topk", self.k, normalize=self.normalize, n_group=self.n_group,
                      topk_group=self.topk_group, scaling=float(self.scaling),
                      choice_bias=self.correction_bias is not None, **_matrix(self))


class SoftmaxGroupedGreedy(nn.Module):
    """DeepSeek-V2 routing: softmax scores, top k over the topk_group of n_group groups with the
    best single expert ("group_limited_greedy"; one group: over all experts, "greedy")."""

    def __init__(
        self,
        weight: torch.Tensor,
        k: int,
        *,
        n_group: int,
        topk_group: int,
        normalize: bool,
        scaling: float,
    ):
        super().__init__()
        _keep_weight(self, weight, weight.float())
        self.k, self.n_group, self.topk_group = k, n_group, topk_group
        self.normalize, self.scaling = normalize, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = _logits(self, x).softmax(dim=-1, dtype=torch.float32)
        if self.n_group > 1:
            n_tokens, n_experts = scores.shape
            grouped = scores.view(n_tokens, self.n_group, n_experts // self.n_group)
            best_groups = grouped.max(dim=-1).values.topk(self.topk_group, dim=-1, sorted=False).indices
            eligible = torch.zeros(n_tokens, self.n_group, dtype=torch.bool, device=x.device).scatter_(1, best_groups, True)
            scores = scores.masked_fill(~eligible.unsqueeze(-1).expand_as(grouped).reshape(n_tokens, n_experts), 0.0)
        weights, ids = scores.topk(self.k, dim=-1, sorted=False)
        # As DeepSeek's own code: either renormalise or scale, not both.
        if self.normalize and self.k > 1:
            return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling

    def describe(self) -> Router:
        return Router("softmax_group_greedy", self.k, normalize=self.normalize, n_group=self.n_group,
                      topk_group=self.topk_group, scaling=float(self.scaling),
                      **_matrix(self))


class TopKSoftmax(nn.Module):
    """GPT-OSS: top k of the biased logits, softmax over those k only (in the model dtype)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, k: int):
        super().__init__()
        _keep_weight(self, weight, _cpu_float(weight), bias)
        self.register_buffer("bias", _cpu_float(bias), persistent=False)
        self.k = k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _logits(self, x, self.bias, self.held_dtype)
        top, ids = torch.topk(logits, self.k, dim=-1)
        return ids, F.softmax(top, dim=-1, dtype=top.dtype)

    def describe(self) -> Router:
        return Router("topk_softmax", self.k, logit_bias=True, **_matrix(self))
