"""Qwen1.5/Qwen2-MoE: attention with q/k/v biases (no q/k norm), softmax routing, and one
shared expert whose output is scaled by sigmoid(shared_expert_gate(x)). Dense and sliding
layers are the spec's decision (this family's ``__init__``)."""

from __future__ import annotations

from hybridmoe.backend.models.families.qwen3_moe import engine as qwen3_moe

BUILD_OPTIONS = {"rms_eps_default": 1e-6}


def attention(b, i: int):
    return b.gqa(i, rotary=b.rotary(b.spec.head_dim))


def feed_forward(b, i: int):
    if i not in b.moe_layers:
        return qwen3_moe.dense_mlp(b, i)
    spec = b.spec
    p = f"model.layers.{i}.mlp"
    shared = shared_gate = None
    if spec.shared_intermediate_size:
        shared = b.mlp(f"{p}.shared_expert", spec.shared_intermediate_size, str(b.config.get("hidden_act", "silu")))
        shared_gate = b.load.linear(f"{p}.shared_expert_gate", 1, b.hidden, bias=False)
    return b.moe(i, p, qwen3_moe.softmax_router(b, p), spec.n_routed_experts, spec.moe_intermediate_size,
                 shared=shared, shared_gate=shared_gate)
