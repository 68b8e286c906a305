"""GLM-4.5 / 4.6's llama.cpp metadata (architecture ``glm4moe``)."""

from __future__ import annotations

import gguf

from hybridmoe.backend.convert.gguf_keys import ArchWriter, GGUFKeys, head_dim
from hybridmoe.backend.models.hf_config import HFConfig


def write(w: GGUFKeys, c: HFConfig) -> None:
    """GLM-4.5 / 4.6: DeepSeek-V3-style routing (sigmoid scores, correction bias, scaled and
    normalised top-k) with one shared expert, the first layers dense, NEOX rotary on part of
    each head (llama.cpp's glm4moe rope type rotates dims i and i + n_rot/2 of the first
    n_rot, which is transformers' rotate-half on the partial slice: no Q/K permutation)."""
    wr = w.writer
    if str(c.get("hidden_act", "silu")) != "silu":
        raise w.refuse(f"hidden_act {c.get('hidden_act')!r}: llama.cpp's glm4moe graph uses SiLU.")
    n_group, topk_group = int(c.get("n_group", 1)), int(c.get("topk_group", 1))
    if n_group > 1 and topk_group < n_group:
        raise w.refuse(f"group-limited routing (n_group {n_group}, topk_group {topk_group}): llama.cpp's "
                       "glm4moe graph picks the top-k experts among all of them.")
    n_shared = int(c.get("n_shared_experts", 1))
    if n_shared < 1:
        raise w.refuse("llama.cpp's glm4moe graph always adds a shared expert; this model has none.")
    size = head_dim(c)
    partial = w.rope_params().partial_rotary_factor
    wr.add_key_length(size)
    wr.add_value_length(size)
    wr.add_rope_dimension_count(int(size * partial))
    wr.add_leading_dense_block_count(int(c.get("first_k_dense_replace", 1)))
    wr.add_expert_feed_forward_length(int(c.require("moe_intermediate_size")))
    wr.add_expert_shared_count(n_shared)
    wr.add_expert_weights_scale(float(c.get("routed_scaling_factor", 1.0)))
    wr.add_expert_weights_norm(bool(c.get("norm_topk_prob", True)))
    wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    # The NextN layers kept as the last blocks (llama.cpp skips them when generating; a
    # checkpoint without them is written with 0, whatever its config announces).
    wr.add_nextn_predict_layers(w.n_mtp)


WRITER = ArchWriter(write)
