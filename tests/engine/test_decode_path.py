"""Which path decodes each layer, and why (backend/engine/decode_path.py): a pure function of
the layers' descriptions and the machine, asked here without a model; and, on the tiny models
of every family, the path the model names is the one its decode step runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.decode_path import (
    DenseFeedForward,
    GroupedQueryAttention,
    LatentAttention,
    Layer,
    Machine,
    MixtureOfExperts,
    Router,
    chain_covers,
    decode_plan,
    native_covers,
)
from tests.engine.conftest import FAMILY_NAMES, engine

CPU = Machine(main_device="cpu", native_off=None, split=None)
GQA = GroupedQueryAttention(heads=32, kv_heads=4, head_dim=128, value_dim=128, qk_norm="per_head", window=None,
                            sinks=False, clip_qkv=None, projections_native=True, cache_dtype="bfloat16")
MLA = LatentAttention(heads=16, nope_dim=128, rope_dim=64, value_dim=128, kv_lora_rank=512, q_lora_rank=1536,
                      absorbed_allowed=True, rotary_whole=True, projections_native=True, kv_b_native=True,
                      cache_dtype="bfloat16")
DENSE = DenseFeedForward(activation="silu", projections_native=True)
MOE = MixtureOfExperts(router=Router("softmax_topk", 8, normalize=True), shared=None, shared_gate=False,
                       shared_gate_native=False, experts_on_main=0, experts_on_host=128, experts_native=None,
                       streamed=False)


def test_a_model_of_one_covered_shape_runs_in_the_chain():
    plan = decode_plan([Layer(GQA, MOE)] * 48, CPU, 48)
    assert plan.chain and plan.native
    assert plan.summary() == "decode: native chain, all 48 layers"
    assert decode_plan([Layer(MLA, DENSE)] + [Layer(MLA, MOE)] * 3, CPU, 4).chain


def test_sliding_layers_take_the_per_call_path_and_say_so():
    sliding = Layer(replace(GQA, window=4096), MOE)
    layers = [sliding] * 4 + [Layer(GQA, MOE)] * 44
    assert native_covers(sliding) == "sliding window"
    plan = decode_plan(layers, CPU, 48)
    assert not plan.chain and plan.native
    assert plan.summary() == ("decode: per-call path, attention in PyTorch for layers 0-3: attention: sliding window; "
                              "per-call path for layers 4-47; not the native chain: layer 0: sliding window")


@pytest.mark.parametrize("change, reason", [
    (dict(sinks=True), "attention sinks"),
    (dict(clip_qkv=8.0), "q/k/v clipping"),
    (dict(qk_norm="whole"), "q/k norm over all heads"),
    (dict(cache_dtype="float16"), "a float16 cache"),
    (dict(projections_native=False), "projections in a format the native kernels do not read"),
])
def test_each_attention_the_native_step_does_not_cover_names_its_reason(change, reason):
    assert native_covers(Layer(replace(GQA, **change), MOE)) == reason


@pytest.mark.parametrize("change, reason", [
    (dict(router=Router("softmax_group_greedy", 6)), "the softmax_group_greedy router"),
    (dict(experts_on_main=3), "experts resident on the main device"),
    (dict(streamed=True), "experts streamed to the main device"),
    (dict(experts_native="Q2_K experts"), "Q2_K experts"),
    (dict(shared=DenseFeedForward("other", True)), "shared experts: other activation"),
])
def test_each_feed_forward_the_native_step_does_not_cover_names_its_reason(change, reason):
    assert native_covers(Layer(GQA, replace(MOE, **change))) == reason


def test_the_chain_needs_one_attention_shape_and_one_k():
    other_k = replace(MOE, router=replace(MOE.router, k=4))
    assert chain_covers([Layer(GQA, MOE), Layer(GQA, other_k)]) == "the MoE layers choose different numbers of experts"
    assert chain_covers([Layer(GQA, MOE), Layer(replace(GQA, heads=16), MOE)]) == "the layers' attention shapes differ"


def test_the_machine_alone_can_decide():
    gpu = decode_plan(None, replace(CPU, main_device="cuda:0"), 48)
    assert not gpu.native and gpu.summary() == "decode: PyTorch modules, all 48 layers: the main device is cuda:0"
    off = decode_plan([Layer(GQA, MOE)] * 2, replace(CPU, native_off="the native kernels are turned off"), 2)
    assert off.summary() == "decode: PyTorch modules, all 2 layers: the native kernels are turned off"


# What each family's tiny fp32 checkpoint decodes with (tests/engine/conftest.py): OLMoE clips
# q/k/v, DeepSeek-V2 routes with a router the native kernels do not have, GPT-OSS has sliding
# windows and sinks and its float experts in transformers' layout are not read natively.
EXPECTED = {
    "qwen3_moe": "decode: native chain, all 3 layers",
    "qwen2_moe": "decode: native chain, all 3 layers",
    "mixtral": "decode: native chain, all 3 layers",
    "glm4_moe": "decode: native chain, all 3 layers",
    "deepseek_v3": "decode: native chain, all 3 layers",
    "deepseek_v2": ("decode: per-call path for layer 0; per-call path, feed-forward in PyTorch for layers 1-2: "
                    "feed-forward: the softmax_group_greedy router; not the native chain: layer 1: the "
                    "softmax_group_greedy router"),
    "olmoe": ("decode: per-call path, attention in PyTorch, all 3 layers: attention: q/k/v clipping; not the native "
              "chain: layer 0: q/k/v clipping"),
    "gpt_oss": ("decode: PyTorch modules, all 3 layers: attention: sliding window, attention sinks; feed-forward: "
                "float GPT-OSS experts"),
}


@pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_family_names_the_path_its_decode_step_runs(family, checkpoints):
    model = engine(checkpoints(family), sliding_rewind=2)
    plan = model.decode_plan()
    assert plan.summary().startswith(EXPECTED[family])
    step = model._native_decode()
    if not plan.native:
        assert step is None
        return
    assert (step.chain is not None) == plan.chain
    for s, path in zip(step.layers, plan.layers):
        assert (s.attn is None) == (path.attention is not None) and (s.ffn is None) == (path.ffn is not None)
