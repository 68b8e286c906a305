"""OLMoE: q and k RMSNorm over the whole projection (not per head), optional clipping of
q/k/v to +-clip_qkv, softmax routing without renormalisation by default, all layers MoE."""

from __future__ import annotations

from hybridmoe.backend.models.families.qwen3_moe import engine as qwen3_moe

BUILD_OPTIONS = {"rms_eps_default": 1e-5}


def attention(b, i: int):
    return b.gqa(i, rotary=b.rotary(b.spec.head_dim), qk_norm="full", clip_qkv=b.config.get("clip_qkv"))


def feed_forward(b, i: int):
    p = f"model.layers.{i}.mlp"
    return b.moe(i, p, qwen3_moe.softmax_router(b, p), b.spec.n_routed_experts, b.spec.moe_intermediate_size)
