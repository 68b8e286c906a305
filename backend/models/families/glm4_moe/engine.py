"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM): grouped-query attention with q/k/v biases,
optional per-head q/k norm, rotary on the first half of each head only
(partial_rotary_factor, 0.5 unless the config says otherwise); DeepSeek-V3 routing (sigmoid,
e_score_correction_bias, group-limited top-k, routed_scaling_factor) with shared experts;
the dense leading layers and the routing settings are the spec's decision
(this family's ``__init__``). The MTP layer after the last decoder layer is not loaded."""

from __future__ import annotations

from hybridmoe.backend.models.families.deepseek import engine as deepseek
from hybridmoe.backend.models.families.qwen3_moe import engine as qwen3_moe

BUILD_OPTIONS = {"rms_eps_default": 1e-5}


def attention(b, i: int):
    hd = b.spec.head_dim
    partial = b.config.rope(default_partial=0.5).partial_rotary_factor
    return b.gqa(i, rotary=b.rotary(int(hd * partial), default_partial=0.5),
                 qk_norm="head" if b.config.get("use_qk_norm", False) else None, o_bias=False)


def feed_forward(b, i: int):
    if i not in b.moe_layers:
        return qwen3_moe.dense_mlp(b, i)
    return deepseek.moe_with_shared_experts(b, i)
