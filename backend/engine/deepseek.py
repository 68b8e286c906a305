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

from hybridmoe.backend.engine.hf_config import HFConfig
from hybridmoe.backend.engine.kv_cache import LatentCache
from hybridmoe.backend.engine.mla import MLAttention
from hybridmoe.backend.engine.rope import softmax_scale_multiplier
from hybridmoe.backend.engine.routing import SigmoidGroupedTopK, SoftmaxGroupedGreedy

BUILD_OPTIONS = {"rms_eps_default": 1e-6}


def _is_v2(cfg: HFConfig) -> bool:
    return _scoring(cfg) == "softmax"


def _scoring(cfg: HFConfig) -> str:
    return str(cfg.get("scoring_func") or ("softmax" if cfg.model_type == "deepseek_v2" else "sigmoid"))



def moe_layers(cfg: HFConfig) -> list[int]:
    n = int(cfg.require("num_hidden_layers"))
    if not cfg.n_routed_experts():
        return []
    first_dense = int(cfg.get("first_k_dense_replace", 0 if cfg.model_type == "deepseek_v2" else 3))
    every = int(cfg.get("moe_layer_freq", 1))
    return [i for i in range(n) if i >= first_dense and i % every == 0]


def attention(b, i: int) -> MLAttention:
    cfg = b.config
    h = b.hidden
    n_heads = int(cfg.require("num_attention_heads"))
    q_lora = cfg.get("q_lora_rank")
    kv_lora = int(cfg.require("kv_lora_rank"))
    nope, rope, v_dim = int(cfg.require("qk_nope_head_dim")), int(cfg.require("qk_rope_head_dim")), int(cfg.require("v_head_dim"))
    p = f"model.layers.{i}.self_attn"
    if q_lora:
        q_proj = None
        q_a = b.load.linear(f"{p}.q_a_proj", q_lora, h)
        q_a_norm = b.norm(f"{p}.q_a_layernorm.weight", q_lora)
        q_b = b.load.linear(f"{p}.q_b_proj", n_heads * (nope + rope), q_lora)
    else:
        q_proj = b.load.linear(f"{p}.q_proj", n_heads * (nope + rope), h)
        q_a = q_a_norm = q_b = None
    v2 = _is_v2(cfg)
    # V2's reference always rotates interleaved pairs in float32; V3 follows rope_interleave.
    layout = "pairs" if v2 or cfg.get("rope_interleave", True) else "halves"
    rotary = b.rotary(rope, layout=layout, float32_math=v2)
    params = cfg.rope()
    return MLAttention(
        q_proj=q_proj, q_a=q_a, q_a_norm=q_a_norm, q_b=q_b,
        kv_a=b.load.linear(f"{p}.kv_a_proj_with_mqa", kv_lora + rope, h),
        kv_a_norm=b.norm(f"{p}.kv_a_layernorm.weight", kv_lora),
        kv_b_weight=b.load.tensor(f"{p}.kv_b_proj.weight", (n_heads * (nope + v_dim), kv_lora)),
        o=b.load.linear(f"{p}.o_proj", h, n_heads * v_dim),
        n_heads=n_heads, nope_dim=nope, rope_dim=rope, v_dim=v_dim, kv_lora_rank=kv_lora,
        rotary=rotary,
        cache=LatentCache(kv_lora, rope, b.max_context, b.dtype, b.device),
        scale=(nope + rope) ** -0.5 * softmax_scale_multiplier(params),
    )


def feed_forward(b, i: int):
    cfg = b.config
    p = f"model.layers.{i}.mlp"
    act = str(cfg.get("hidden_act", "silu"))
    if i not in b.moe_layers:
        return b.load.mlp(p, b.hidden, int(cfg.require("intermediate_size")), act)
    n_experts = cfg.n_routed_experts()
    k = int(cfg.require("num_experts_per_tok"))
    inter = int(cfg.require("moe_intermediate_size"))
    gate = b.load.tensor(f"{p}.gate.weight", (n_experts, b.hidden), dtype=torch.float32)
    n_group, topk_group = int(cfg.get("n_group", 1)), int(cfg.get("topk_group", 1))
    if _is_v2(cfg):
        router = SoftmaxGroupedGreedy(
            gate, k, method=str(cfg.get("topk_method", "greedy")), n_group=n_group, topk_group=topk_group,
            normalize=bool(cfg.get("norm_topk_prob", False)), scaling=float(cfg.get("routed_scaling_factor", 1.0)))
    else:
        router = SigmoidGroupedTopK(
            gate, b.load.optional(f"{p}.gate.e_score_correction_bias", (n_experts,), dtype=torch.float32), k,
            n_group=n_group, topk_group=topk_group, normalize=bool(cfg.get("norm_topk_prob", True)),
            scaling=float(cfg.get("routed_scaling_factor", 2.5)))
    n_shared = int(cfg.get("n_shared_experts", 0))
    shared = b.load.mlp(f"{p}.shared_experts", b.hidden, inter * n_shared, act) if n_shared else None
    return b.moe(i, p, router, n_experts, inter, shared=shared)

