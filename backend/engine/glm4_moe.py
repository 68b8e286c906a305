"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases,
optional per-head q/k norm, rotary on the first half of each head only
(partial_rotary_factor, 0.5 unless the config says otherwise); DeepSeek-V3 routing (sigmoid,
e_score_correction_bias, group-limited top-k, routed_scaling_factor) with shared experts;
the first ``first_k_dense_replace`` layers dense. The MTP layer after the last decoder layer
is not loaded."""

from __future__ import annotations

import torch

from hybridmoe.backend.engine import qwen3_moe
from hybridmoe.backend.engine.hf_config import HFConfig
from hybridmoe.backend.engine.routing import SigmoidGroupedTopK

BUILD_OPTIONS = {"rms_eps_default": 1e-5}



def moe_layers(cfg: HFConfig) -> list[int]:
    first_dense = int(cfg.get("first_k_dense_replace", 1))
    return list(range(first_dense, int(cfg.require("num_hidden_layers"))))


def attention(b, i: int):
    cfg = b.config
    hd = qwen3_moe.head_dim(cfg)
    partial = cfg.rope(default_partial=0.5).partial_rotary_factor
    return b.gqa(i, n_heads=int(cfg.require("num_attention_heads")), n_kv_heads=int(cfg.require("num_key_value_heads")),
                 head_dim=hd, rotary=b.rotary(int(hd * partial), default_partial=0.5),
                 qk_norm="head" if cfg.get("use_qk_norm", False) else None, o_bias=False)


def feed_forward(b, i: int):
    cfg = b.config
    p = f"model.layers.{i}.mlp"
    act = str(cfg.get("hidden_act", "silu"))
    if i not in b.moe_layers:
        return b.load.mlp(p, b.hidden, int(cfg.require("intermediate_size")), act)
    n = cfg.n_routed_experts()
    inter = int(cfg.require("moe_intermediate_size"))
    router = SigmoidGroupedTopK(
        b.load.tensor(f"{p}.gate.weight", (n, b.hidden), dtype=torch.float32),
        b.load.optional(f"{p}.gate.e_score_correction_bias", (n,), dtype=torch.float32),
        int(cfg.require("num_experts_per_tok")),
        n_group=int(cfg.get("n_group", 1)), topk_group=int(cfg.get("topk_group", 1)),
        normalize=bool(cfg.get("norm_topk_prob", True)), scaling=float(cfg.get("routed_scaling_factor", 1.0)))
    n_shared = int(cfg.get("n_shared_experts", 1))
    shared = b.load.mlp(f"{p}.shared_experts", b.hidden, inter * n_shared, act) if n_shared else None
    return b.moe(i, p, router, n, inter, shared=shared)
