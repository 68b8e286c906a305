"""Mixtral: Llama attention (optionally one sliding window for all layers), every layer
MoE under ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down);
softmax routing, always renormalised, weights kept in float32."""

from __future__ import annotations

from hybridmoe.backend.models.families.qwen3_moe import engine as qwen3_moe

BUILD_OPTIONS = {"rms_eps_default": 1e-5}


def attention(b, i: int):
    return b.gqa(i, rotary=b.rotary(b.spec.head_dim, default_theta=1e6))


def feed_forward(b, i: int):
    # Hub checkpoints name the block block_sparse_moe; transformers' fused layout names it mlp.
    p = f"model.layers.{i}.block_sparse_moe"
    if f"{p}.gate.weight" not in b.weights and f"model.layers.{i}.mlp.gate.weight" in b.weights:
        p = f"model.layers.{i}.mlp"
    router = qwen3_moe.softmax_router(b, p, float32_weights=True)
    return b.moe(i, p, router, b.spec.n_routed_experts, b.spec.moe_intermediate_size, names=("w1", "w3", "w2"))
