"""The native one-token path on a CPU main device (backend/engine/cpu_decode.py) against the
layer-by-layer path of the same model."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.cpu_decode import DecodeStep
from hybridmoe.backend.engine.native_linear import NativeLinear
from tests.engine.conftest import FAMILY_NAMES, engine, relative_error, tokens

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")

# Which blocks run natively on the tiny fp32 checkpoints: grouped-query attention without
# sinks, clipping or whole-projection q/k norms, and latent attention (DeepSeek-V2/V3: with
# and without a q LoRA); every router but DeepSeek-V2's; GPT-OSS' experts in transformers'
# fp32 layout are not read natively (its GGUF/MXFP4 ones are).
NATIVE_ATTENTION = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "deepseek_v2"}
NO_NATIVE_STEP = {"gpt_oss"}


def _decode(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    model(ids[:, :prefill], 0)
    return torch.cat([model(ids[:, t : t + 1], t) for t in range(prefill, ids.shape[1])], dim=1)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_native_decode_matches_the_layer_path(family, checkpoints):
    model = engine(checkpoints(family), sliding_rewind=2)
    ids = tokens(24, seed=5)
    native = _decode(model, ids, 8)
    step = model._decode_step
    if family in NO_NATIVE_STEP:
        assert step is None
        return
    assert isinstance(step, DecodeStep)
    assert all((s.attn is not None) == (family in NATIVE_ATTENTION) for s in step.layers)
    counts = {layer: c.clone() for layer, c in model.stats.counts.items()}
    model.native_decode = False  # the layer-by-layer path from here on
    model.stats.reset()
    reference = _decode(model, ids, 8)
    assert relative_error(native, reference) < 1e-5
    # The same experts were counted.
    model.stats.reset()
    model.native_decode = True
    _decode(model, ids, 8)
    assert all(torch.equal(model.stats.counts[layer], counts[layer]) for layer in counts)


def test_not_used_with_the_kernels_switched_off(checkpoints, monkeypatch):
    model = engine(checkpoints("qwen3_moe"))
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    assert model._native_decode() is None
    monkeypatch.delenv("HYBRIDMOE_NATIVE")
    assert isinstance(model._native_decode(), DecodeStep)


def test_a_model_built_with_the_kernels_off_decodes_with_them_on(checkpoints, monkeypatch):
    """Its routers have no NativeLinear (``routing._keep_weight`` builds none with the kernels
    off), which the native MoE step computes the logits with: the plan, from the routers'
    descriptions, leaves those blocks to PyTorch instead of building a step that cannot run."""
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    off = engine(checkpoints("qwen3_moe"))
    ids = tokens(12, seed=9)
    reference = _decode(off, ids, 6)  # every token with the kernels off
    model = engine(checkpoints("qwen3_moe"))
    monkeypatch.delenv("HYBRIDMOE_NATIVE")
    decoded = _decode(model, ids, 6)  # once crashed: a native MoE step over router.native, None
    assert relative_error(decoded, reference) < 1e-5
    plan = model.decode_plan()
    assert all(path.ffn is not None for path in plan.layers)
    assert "a router matrix the native kernels do not read" in plan.summary()


def test_rewinding_overwrites_what_the_native_step_wrote(checkpoints):
    """A second continuation from an earlier position sees none of the first one."""
    model = engine(checkpoints("qwen3_moe"))
    ids = tokens(20, seed=7)
    first = _decode(model, ids, 10)
    other = ids.clone()
    other[:, 12:] = (other[:, 12:] + 1) % 256
    _decode(model, other, 10)  # positions 12.. now hold the other continuation
    again = torch.cat([model(ids[:, t : t + 1], t) for t in range(12, 20)], dim=1)
    assert relative_error(again, first[:, 2:]) < 1e-6


@pytest.mark.parametrize("family", sorted(set(FAMILY_NAMES) - NATIVE_ATTENTION - NO_NATIVE_STEP))
def test_layers_the_step_falls_back_to_see_decode_rows(family, checkpoints, monkeypatch):
    """The PyTorch modules a decode step runs (attention it does not cover) get what the layer
    path gives them: inference mode, and decode rows for the kernels they call (each row on
    the one-token paths however many share the step, as the batching tests require)."""
    model = engine(checkpoints(family))
    model(tokens(4, seed=1), 0)
    seen = []
    forward = NativeLinear.forward

    def spy(self, x):
        seen.append((native_kernels.dense_threshold(), torch.is_inference_mode_enabled()))
        return forward(self, x)

    monkeypatch.setattr(NativeLinear, "forward", spy)
    model.forward_batch([(model.sequence, [5], 4)])
    assert isinstance(model._decode_step, DecodeStep)
    assert seen and set(seen) == {(native_kernels.dense_threshold("decode"), True)}


def test_the_decode_step_reads_each_router_in_the_compute_dtype(checkpoints):
    """A bf16 model's router is read in bf16 (the router computes with it widened to float32,
    which holds it exactly): the bytes the plan counts for it, and the numbers of the same step
    reading it widened."""
    from hybridmoe.backend.models import inspect_model

    path = checkpoints("qwen3_moe", torch.bfloat16)
    model = engine(path)
    ids = tokens(16, seed=3)
    native = _decode(model, ids, 8)

    def router_bytes() -> int:
        return sum(s.ffn.logits.native.bytes for s in model._decode_step.layers if hasattr(s.ffn, "logits"))

    read = router_bytes()
    assert read == inspect_model(path).inventory.router_bytes_held(2)
    for layer in model.layers:
        if hasattr(layer.ffn, "router"):
            layer.ffn.router.native = NativeLinear(layer.ffn.router.weight)  # its float32 matrix
    model._decode_step = False  # rebuilt on the next step, reading the widened matrices
    widened = _decode(model, ids, 8)
    assert router_bytes() == 2 * read
    assert relative_error(native, widened) < 1e-6


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_native_latent_attention_in_bf16_is_as_accurate_as_pytorchs(family, checkpoints):
    """The native latent attention (absorbed) computes in fp32 on the bf16 weights and cache,
    where PyTorch's rounds to bf16 after each op. Against fp32 arithmetic on the same weights,
    step by step, its typical error is no larger than that of PyTorch's expanded form, the
    transformers reference's order of operations. The median, not the largest: one near-tie
    in routing, flipped by any rounding change, makes one step's error jump either way."""
    from hybridmoe.backend.engine.cpu_decode import _MLAStep

    path = checkpoints(family, torch.bfloat16)
    ids = tokens(44, seed=5)
    exact = engine(path, dtype=torch.float32)(ids)[0, 11:43]

    def decode(native: bool) -> torch.Tensor:
        model = engine(path)
        model.native_decode = native
        if not native:
            model.set_mla_absorb(False)
        steps = [model(ids[:, :12], 0, last_only=True)[0, -1]]
        steps += [model(ids[:, t : t + 1], t)[0, -1] for t in range(12, 43)]
        if native:
            assert all(isinstance(s.attn, _MLAStep) for s in model._decode_step.layers)
        return torch.stack(steps).float()

    def median_error(out: torch.Tensor) -> float:
        return float(((out - exact).abs().amax(-1) / exact.abs().max()).median())

    assert median_error(decode(True)) <= median_error(decode(False))
