"""A new router is a module and its description: the decode plan and the executors follow.

What a new router touches: its module with ``forward`` and ``describe`` (backend/engine/routing.py,
here this test), its branch in the builder's ``_router`` (backend/engine/build_layers.py: the
module of a description's kind, here the swap below) and the family's ``describe_layers`` that
names the kind (its ``__init__.py``, which tests/engine/test_decode_path.py holds to the built
modules' descriptions): three files. Nothing in cpu_decode.py or plan/decode_path.py learns its class; the
plan sends its blocks to PyTorch and says why. A router whose description is one the native
kernels have (``decode_path.NATIVE_ROUTERS``) runs natively, in the chain, without a line
more. (Giving the native kernels a new routing kind: ``NATIVE_ROUTERS`` in plan/decode_path.py,
the native router (native/src/decode_ops.h and .cpp) and its name and call in
native/src/decode_chain.h's ``kRouteNames`` / ``route_token``, which the binding's chain layers
and per-call ``route`` both parse through and the chain's step calls: four files, and the
description's fields reach the native route unchanged.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.models.layer_description import Router
from hybridmoe.backend.engine.routing import TopKSoftmax
from tests.engine.conftest import engine, relative_error, tokens

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")


class ScaledTopKSoftmax(nn.Module):
    """The small variant: top k of the biased logits, softmax over those k, times a scale (no
    native kernel has the scale)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, k: int, scaling: float):
        super().__init__()
        self.register_buffer("weight", weight.float(), persistent=False)
        self.register_buffer("bias", bias.float(), persistent=False)
        self.k, self.scaling = k, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(F.linear(x.float(), self.weight, self.bias), self.k, dim=-1)
        return ids, (F.softmax(top, dim=-1) * self.scaling).to(x.dtype)

    def describe(self) -> Router:
        return Router("topk_softmax_scaled", self.k, scaling=self.scaling, logit_bias=True)


def _routed(model):
    return [layer.ffn for layer in model.layers if hasattr(layer.ffn, "router")]


def _swap_routers(model, make) -> None:
    """The builder's part: every MoE layer gets the new router (its bias drawn here)."""
    gen = torch.Generator().manual_seed(3)
    for moe in _routed(model):
        bias = torch.randn(moe.router.weight.shape[0], generator=gen)
        moe.router = make(moe.router.weight, bias, moe.router.k)
    model._decode_step = False  # built again from the new descriptions


def _decode(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    model(ids[:, :prefill], 0)
    return torch.cat([model(ids[:, t : t + 1], t) for t in range(prefill, ids.shape[1])], dim=1)


def _native_against_layers(model) -> None:
    ids = tokens(20, seed=11)
    native = _decode(model, ids, 8)
    model.native_decode = False
    reference = _decode(model, ids, 8)
    model.native_decode = True
    assert relative_error(native, reference) < 1e-5


def test_a_router_no_native_kernel_has_runs_in_pytorch_and_the_plan_says_why(checkpoints):
    model = engine(checkpoints("qwen3_moe"))
    _swap_routers(model, lambda w, b, k: ScaledTopKSoftmax(w, b, k, scaling=2.5))
    plan = model.decode_plan()
    assert not plan.chain
    assert "feed-forward in PyTorch" in plan.summary() and "the topk_softmax_scaled router" in plan.summary()
    _native_against_layers(model)
    assert model._decode_step is not None and all(s.ffn is None for s in model._decode_step.layers
                                                   if hasattr(s.layer.ffn, "router"))


def test_a_router_the_kernels_have_runs_in_the_chain_in_a_family_that_never_used_it(checkpoints):
    """Qwen3-MoE's layers with GPT-OSS' biased top-k-then-softmax router: the chain runs it."""
    model = engine(checkpoints("qwen3_moe"))
    _swap_routers(model, TopKSoftmax)
    assert model.decode_plan().chain
    _native_against_layers(model)
    assert model._decode_step.chain is not None


def test_the_native_routes_are_named_as_the_descriptions_name_them():
    """One mapping: the kinds the native route parses are the planner's NATIVE_ROUTERS."""
    from hybridmoe.backend.plan.decode_path import NATIVE_ROUTERS

    assert tuple(native_kernels._native.ROUTE_KINDS) == NATIVE_ROUTERS
