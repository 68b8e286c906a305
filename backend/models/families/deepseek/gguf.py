"""DeepSeek's llama.cpp metadata (architecture ``deepseek2``): multi-head latent attention in
llama.cpp's absorbed form, the leading dense layers, shared experts and the routing keys."""

from __future__ import annotations

import gguf

from hybridmoe.backend.convert.gguf_keys import ArchWriter, GGUFKeys
from hybridmoe.backend.models.hf_config import HFConfig


def write(w: GGUFKeys, c: HFConfig) -> None:
    wr = w.writer
    if int(c.get("moe_layer_freq", 1)) != 1:
        raise w.refuse(f"moe_layer_freq {c.get('moe_layer_freq')} (MoE only every few layers) has no "
                       "llama.cpp deepseek2 equivalent.")
    kv_lora, rope_dim = int(c.require("kv_lora_rank")), int(c.require("qk_rope_head_dim"))
    nope, v = int(c.require("qk_nope_head_dim")), int(c.require("v_head_dim"))
    # MLA in llama.cpp's absorbed form: the one shared "KV head" is the compressed latent
    # plus the rope part; the per-head sizes go to the *_mla keys.
    wr.add_key_length(kv_lora + rope_dim)
    wr.add_value_length(kv_lora)
    wr.add_key_length_mla(nope + rope_dim)
    wr.add_value_length_mla(v)
    wr.add_q_lora_rank(int(c.get("q_lora_rank") or 0))
    wr.add_kv_lora_rank(kv_lora)
    wr.add_rope_dimension_count(rope_dim)
    wr.add_leading_dense_block_count(int(c.get("first_k_dense_replace", 0)))
    wr.add_expert_feed_forward_length(int(c.require("moe_intermediate_size")))
    n_shared = int(c.get("n_shared_experts") or 0)
    if n_shared < 1:
        raise w.refuse("llama.cpp's deepseek2 graph needs shared experts; this model has none.")
    wr.add_expert_shared_count(n_shared)
    wr.add_expert_weights_scale(float(c.get("routed_scaling_factor", 1.0)))
    wr.add_expert_weights_norm(bool(c.get("norm_topk_prob", False)))
    v3 = c.model_type in ("deepseek_v3", "kimi_k2", "kimi_k25")
    scoring = c.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring not in ("sigmoid", "softmax"):
        raise w.refuse(f"scoring_func {scoring!r} is not supported.")
    wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if scoring == "sigmoid"
                              else gguf.ExpertGatingFuncType.SOFTMAX)
    n_group, topk_group = int(c.get("n_group", 1)), int(c.get("topk_group", 1))
    # A GGUF has no routing method: a group count > 1 is read as group-limited routing (by
    # llama.cpp and the engine), so it is written only for the routers that limit groups; a
    # V2 with topk_method "greedy" ignores its n_group.
    limits_groups = c.get("topk_method", "noaux_tc" if v3 else "greedy") in ("group_limited_greedy", "noaux_tc")
    if n_group > 1 and limits_groups:
        wr.add_expert_group_count(n_group)
        wr.add_expert_group_used_count(topk_group)
    rope = w.rope_params()
    if rope.kind == "yarn":
        # llama.cpp's deepseek2 graph rebuilds the softmax scale (mscale^2) from this; the
        # 0.1 factor is llama.cpp's convention for the key (it divides it out again).
        wr.add_rope_scaling_yarn_log_mul(0.1 * float(rope.get("mscale_all_dim", 0.0)))


WRITER = ArchWriter(write, one_kv_head=True)
