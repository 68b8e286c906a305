"""Qwen3-MoE: grouped-query attention with RMSNorm on each head's q and k before the
rotation, softmax routing (norm_topk_prob renormalises the top k), no shared experts.
Which layers are dense (`mlp_only_layers`, `decoder_sparse_step`) and which slide is the
spec's decision (this family's ``__init__``)."""

from __future__ import annotations

from hybridmoe.backend.engine.routing import SoftmaxTopK

BUILD_OPTIONS = {"rms_eps_default": 1e-6}


def attention(b, i: int):
    return b.gqa(i, rotary=b.rotary(b.spec.head_dim), qk_norm="head")


def softmax_router(b, prefix: str, *, float32_weights: bool = False) -> SoftmaxTopK:
    spec = b.spec
    weight = b.load.tensor(f"{prefix}.gate.weight", (spec.n_routed_experts, b.hidden))
    return SoftmaxTopK(weight, spec.experts_per_token, normalize=spec.routing.normalize,
                       float32_weights=float32_weights)


def dense_mlp(b, i: int):
    return b.mlp(f"model.layers.{i}.mlp", b.spec.dense_intermediate_size,
                      str(b.config.get("hidden_act", "silu")))


def feed_forward(b, i: int):
    if i not in b.moe_layers:
        return dense_mlp(b, i)
    p = f"model.layers.{i}.mlp"
    return b.moe(i, p, softmax_router(b, p), b.spec.n_routed_experts, b.spec.moe_intermediate_size)
