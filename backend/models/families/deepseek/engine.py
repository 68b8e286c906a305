"""DeepSeek-V2, DeepSeek-V3/R1 and Kimi K2.x (same architecture as V3).

What differs from the other families:
- multi-head latent attention (``mla``), with the rotary part of q/k interleaved in pairs
  (``rope_interleave``, true for every released checkpoint) and, under YaRN, the softmax
  sharpened by mscale(factor, mscale_all_dim)^2;
- the first ``first_k_dense_replace`` layers (and, for V2, layers off ``moe_layer_freq``)
  are dense MLPs;
- routing: V3/K2 sigmoid scores with e_score_correction_bias, group-limited top-k
  (n_group / topk_group), optional renormalisation and routed_scaling_factor; V2 softmax
  scores, "greedy" or "group_limited_greedy";
- n_shared_experts shared experts, one MLP of n_shared_experts x moe_intermediate_size.
"""

from __future__ import annotations

import torch

from hybridmoe.backend.engine.kv_cache import PagedLatent
from hybridmoe.backend.engine.latent_maps import stored_maps
from hybridmoe.backend.engine.mla import MLAttention
from hybridmoe.backend.engine.rope import softmax_scale_multiplier
from hybridmoe.backend.engine.routing import SigmoidGroupedTopK, SoftmaxGroupedGreedy
from hybridmoe.backend.models.families.qwen3_moe import engine as qwen3_moe

BUILD_OPTIONS = {"rms_eps_default": 1e-6}


def attention(b, i: int) -> MLAttention:
    cfg, spec = b.config, b.spec
    h = b.hidden
    n_heads, q_lora, kv_lora = spec.num_attention_heads, spec.q_lora_rank, spec.kv_lora_rank
    nope, rope, v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    p = f"model.layers.{i}.self_attn"
    # Under tensor parallelism a card holds its heads' rows of q_b (or q), kv_b and their
    # columns of o; the latent projections, and the latent cache every head reads, whole.
    heads = b.part(n_heads) or (0, n_heads)
    q_rows = (heads[0] * (nope + rope), heads[1] * (nope + rope))
    if q_lora:
        q_proj = None
        q_a = b.load.linear(f"{p}.q_a_proj", q_lora, h)
        q_a_norm = b.norm(f"{p}.q_a_layernorm.weight", q_lora)
        q_b = b.load.linear(f"{p}.q_b_proj", n_heads * (nope + rope), q_lora, rows=q_rows)
    else:
        q_proj = b.load.linear(f"{p}.q_proj", n_heads * (nope + rope), h, rows=q_rows)
        q_a = q_a_norm = q_b = None
    v2 = spec.routing.scoring == "softmax"
    # V2's reference always rotates interleaved pairs in float32; V3 follows rope_interleave.
    layout = "pairs" if v2 or cfg.get("rope_interleave", True) else "halves"
    rotary = b.rotary(rope, layout=layout, float32_math=v2)
    params = cfg.rope()
    kv_b = f"{p}.kv_b_proj.weight"
    # On the CPU a GGUF's split kv_b is read as stored (engine/latent_maps.py).
    maps = stored_maps(b.load.weights, kv_b, heads, nope, v_dim, kv_lora, b.device, b.dtype)
    return MLAttention(
        q_proj=q_proj, q_a=q_a, q_a_norm=q_a_norm, q_b=q_b,
        kv_a=b.load.linear(f"{p}.kv_a_proj_with_mqa", kv_lora + rope, h),
        kv_a_norm=b.norm(f"{p}.kv_a_layernorm.weight", kv_lora),
        kv_b_weight=None if maps else b.load.tensor(kv_b, (n_heads * (nope + v_dim), kv_lora),
                                                    rows=(heads[0] * (nope + v_dim), heads[1] * (nope + v_dim))),
        stored_maps=maps,
        o=b.load.linear(f"{p}.o_proj", h, n_heads * v_dim,
                        cols=None if b.card is None else (heads[0] * v_dim, heads[1] * v_dim)),
        n_heads=heads[1] - heads[0], nope_dim=nope, rope_dim=rope, v_dim=v_dim, kv_lora_rank=kv_lora,
        rotary=rotary,
        cache=PagedLatent(b.cache_group(i), kv_lora, rope, b.dtype, b.device),
        scale=(nope + rope) ** -0.5 * softmax_scale_multiplier(params),
    )


def router(b, prefix: str):
    """The router the spec's routing names: V2's softmax (greedy or group-limited), or
    V3's sigmoid with its correction bias (GLM-4.5 routes the same way)."""
    spec, r = b.spec, b.spec.routing
    n_experts = spec.n_routed_experts
    gate = b.load.tensor(f"{prefix}.gate.weight", (n_experts, b.hidden), dtype=torch.float32)
    if r.scoring == "softmax":
        return SoftmaxGroupedGreedy(gate, spec.experts_per_token, method=r.method, n_group=r.n_group,
                                    topk_group=r.topk_group, normalize=r.normalize, scaling=r.scaling)
    bias = b.load.optional(f"{prefix}.gate.e_score_correction_bias", (n_experts,), dtype=torch.float32)
    return SigmoidGroupedTopK(gate, bias, spec.experts_per_token, n_group=r.n_group, topk_group=r.topk_group,
                              normalize=r.normalize, scaling=r.scaling)


def moe_with_shared_experts(b, i: int):
    """A DeepSeek-style MoE block: the router, the routed experts and the shared experts
    (one MLP as wide as all of them together)."""
    spec = b.spec
    p = f"model.layers.{i}.mlp"
    shared = None
    if spec.shared_intermediate_size:
        shared = b.mlp(f"{p}.shared_experts", spec.shared_intermediate_size, str(b.config.get("hidden_act", "silu")))
    return b.moe(i, p, router(b, p), spec.n_routed_experts, spec.moe_intermediate_size, shared=shared)


def feed_forward(b, i: int):
    if i not in b.moe_layers:
        return qwen3_moe.dense_mlp(b, i)
    return moe_with_shared_experts(b, i)
