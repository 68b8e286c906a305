"""Which executor decodes each layer, and why (backend/plan/decode_path.py): a pure function
of the layers' descriptions and the machine, asked here without a model."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest

from hybridmoe.backend.models import layer_description
from hybridmoe.backend.models.hf_config import RopeParams
from hybridmoe.backend.models.layer_description import (
    CLAMPED_SWIGLU,
    DenseFeedForward,
    GroupedQueryAttention,
    LatentAttention,
    MixtureOfExperts,
    Norm,
    Rotation,
    Router,
)
from hybridmoe.backend.plan.decode_path import Machine, chain_covers, cuda_covers, decode_plan, native_covers

CPU = Machine(main_device="cpu", native_off=None, split=None)
GPU = Machine(main_device="cuda:0", native_off=None, split="experts streamed by a scheduler")
ROPE = RopeParams("default", 10000.0, 1.0, {})
GQA = GroupedQueryAttention(heads=32, kv_heads=4, head_dim=128, value_dim=128, qk_norm="per_head", window=None,
                            sinks=False, clip_qkv=None, rotary=Rotation(ROPE, 128), projections_native=True,
                            cache_dtype="bfloat16")
MLA = LatentAttention(heads=16, nope_dim=128, rope_dim=64, value_dim=128, kv_lora_rank=512, q_lora_rank=1536,
                      absorbed_allowed=True, rotary=Rotation(ROPE, 64, "pairs"), projections_native=True,
                      kv_b_native=True, cache_dtype="bfloat16")
DENSE = DenseFeedForward(activation="silu", projections_native=True)
MOE = MixtureOfExperts(router=Router("softmax_topk", 8, normalize=True), shared=None, shared_gate=False,
                       shared_gate_native=False, experts_on_main=0, experts_on_host=128, experts_native=None,
                       streamed=False)
Layer = partial(layer_description.Layer, norm=Norm(1e-6))  # the norms take no part in the choice


def test_a_model_of_one_covered_shape_runs_in_the_chain():
    plan = decode_plan([Layer(GQA, MOE)] * 48, CPU, 48)
    assert plan.chain and plan.native
    assert plan.summary() == "decode: native chain, all 48 layers"
    assert decode_plan([Layer(MLA, DENSE)] + [Layer(MLA, MOE)] * 3, CPU, 4).chain


def test_sliding_layers_take_the_per_call_path_and_say_so():
    sliding = Layer(replace(GQA, window=4096), MOE)
    layers = [sliding] * 4 + [Layer(GQA, MOE)] * 44
    assert native_covers(sliding, CPU) == "sliding window"
    plan = decode_plan(layers, CPU, 48)
    assert not plan.chain and plan.native
    assert plan.summary() == ("decode: per-call path, attention in PyTorch for layers 0-3: attention: sliding window; "
                              "per-call path for layers 4-47; not the native chain: layer 0: sliding window")


@pytest.mark.parametrize("change, reason", [
    (dict(sinks=True), "attention sinks"),
    (dict(clip_qkv=8.0), "q/k/v clipping"),
    (dict(qk_norm="whole"), "q/k norm over all heads"),
    (dict(cache_dtype="float64"), "a float64 cache"),
    (dict(projections_native=False), "projections in a format the native kernels do not read"),
])
def test_each_attention_the_native_step_does_not_cover_names_its_reason(change, reason):
    assert native_covers(Layer(replace(GQA, **change), MOE), CPU) == reason


@pytest.mark.parametrize("change, reason", [
    (dict(router=Router("softmax_group_greedy", 6)), "the softmax_group_greedy router"),
    (dict(experts_on_main=3), "experts resident on the main device"),
    (dict(streamed=True), "experts streamed to the main device"),
    (dict(experts_native="Q2_K experts"), "Q2_K experts"),
    (dict(shared=DenseFeedForward("other", True)), "shared experts: other activation"),
])
def test_each_feed_forward_the_native_step_does_not_cover_names_its_reason(change, reason):
    assert native_covers(Layer(GQA, replace(MOE, **change)), CPU) == reason


def test_the_chain_needs_one_attention_shape_and_one_k():
    other_k = replace(MOE, router=replace(MOE.router, k=4))
    assert chain_covers([Layer(GQA, MOE), Layer(GQA, other_k)], CPU) == "the MoE layers choose different numbers of experts"
    assert chain_covers([Layer(GQA, MOE), Layer(replace(GQA, heads=16), MOE)], CPU) == "the layers' attention shapes differ"


def test_the_machine_alone_can_decide():
    off = decode_plan([Layer(GQA, MOE)] * 2, replace(CPU, native_off="the native kernels are turned off"), 2)
    assert off.summary() == "decode: PyTorch modules, all 2 layers: the native kernels are turned off"
    assert native_covers(Layer(GQA, MOE), GPU) == "the main device is cuda:0"
    assert cuda_covers(Layer(GQA, MOE), CPU) == "the main device is cpu"
    sharded = decode_plan(None, replace(GPU, split="layers split across cards"), 48)
    assert sharded.summary() == "decode: PyTorch modules, all 48 layers: layers split across cards"
    no_triton = decode_plan([Layer(GQA, MOE)] * 2, replace(GPU, gpu_kernels_off="Triton is not installed"), 2)
    assert no_triton.summary() == "decode: PyTorch modules, all 2 layers: Triton is not installed"


def test_on_a_gpu_the_cuda_kernels_decode_what_they_cover():
    on_card = replace(MOE, experts_on_main=64, experts_on_host=64, streamed=True)
    plan = decode_plan([Layer(GQA, on_card)] * 48, GPU, 48)
    assert not plan.native and plan.summary() == "decode: GPU kernels, all 48 layers"
    assert cuda_covers(Layer(MLA, DENSE), GPU) is None


@pytest.mark.parametrize("block, reason", [
    (replace(GQA, window=4096), "sliding window"),
    (replace(GQA, sinks=True), "attention sinks"),
    (replace(GQA, head_dim=512, value_dim=512), "heads over 256 features"),
    (replace(MLA, kv_lora_rank=384), "a latent rank of 384 (the kernels' tiles take powers of two from 16)"),
    (replace(MLA, rope_dim=8), "a rotary size of 8 (the kernels' tiles take powers of two from 16)"),
    (replace(MLA, kv_lora_rank=2048), "a latent rank over 1024"),
    (replace(MLA, absorbed_allowed=False), "latent attention's expanded form is forced"),
])
def test_each_attention_the_cuda_kernels_do_not_cover_names_its_reason(block, reason):
    assert cuda_covers(Layer(block, DENSE), GPU) == reason


def test_experts_on_the_card_need_an_activation_the_cuda_kernels_have():
    gelu = replace(MOE, experts_on_main=8, activation="gelu")
    assert cuda_covers(Layer(GQA, gelu), GPU) == "gelu experts"
    assert cuda_covers(Layer(GQA, replace(gelu, experts_on_main=0)), GPU) is None  # all on the CPU
    assert cuda_covers(Layer(GQA, replace(gelu, activation=CLAMPED_SWIGLU)), GPU) is None


def test_alternating_layers_are_said_as_two_groups():
    sliding, full = Layer(replace(GQA, window=128, sinks=True), MOE), Layer(replace(GQA, sinks=True), MOE)
    plan = decode_plan([sliding, full] * 12, GPU, 24)
    assert plan.summary() == ("decode: GPU kernels, attention in PyTorch for layers 0, 2, ..., 22: attention: sliding "
                              "window; GPU kernels, attention in PyTorch for layers 1, 3, ..., 23: attention: attention "
                              "sinks")
    groups = plan.to_dict()["groups"]
    assert [g["layers"] for g in groups] == [list(range(0, 24, 2)), list(range(1, 24, 2))]
