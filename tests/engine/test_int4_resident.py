"""Routed experts stored in a 4-bit format, held on the main device in that form."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.backend.engine.experts import experts_forward
from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.formats.int4_weights import Int4Weight
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan.budget import resident_expert_bytes
from tests.convert.conftest import checkpoints, converted  # noqa: F401 - fixtures: tiny checkpoints and GGUFs
from tests.engine.conftest import Dequantized, greedy, tokens


def _moes(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
def test_4bit_experts_stay_4bit_on_the_main_device(family, converted):  # noqa: F811 - the fixture
    """A Q4_0 GGUF (GPT-OSS: its MXFP4 experts, gate and up interleaved, with biases): the main
    device holds the stored codes and scales, the bytes the Plan counts, and computes what the
    dequantized matrices compute; the model's tokens are those of the same experts held dense
    (dequantized to bf16, which rounds Q4_0's values as int4's own product does)."""
    path = converted(family, "q4_0")
    spec = inspect_model(path).spec
    placement = {layer: [1, 4, 6] for layer in spec.moe_layers}
    model = build_model(spec, open_weights(path), max_context=64, placement=placement, resident_form="int4")
    moe = _moes(model)[0]
    assert moe.main.nbytes == 3 * resident_expert_bytes(spec, "int4"), family
    m = moe.main.weights_of(4)
    assert isinstance(m.gate_up, Int4Weight) and isinstance(m.down, Int4Weight)
    x = torch.randn(6, spec.hidden_size, generator=torch.Generator().manual_seed(2)).to(model.dtype)
    ids, weights = moe.router(x)

    assert torch.equal(experts_forward(x, ids, weights, moe.main), experts_forward(x, ids, weights, Dequantized(moe.main, x.dtype)))
    dense = build_model(spec, open_weights(path), max_context=64, placement=placement, resident_form="dense")
    prompt = tokens(8, seed=5)
    assert greedy(model, prompt, 6) == greedy(dense, prompt, 6)
