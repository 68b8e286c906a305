"""Qwen3-MoE's llama.cpp metadata (architecture ``qwen3moe``); ``write_qwen_moe_keys`` is
shared with Qwen2-MoE."""

from __future__ import annotations

from hybridmoe.backend.convert.gguf_keys import ArchWriter, GGUFKeys
from hybridmoe.backend.models.hf_config import HFConfig


def write_qwen_moe_keys(w: GGUFKeys, c: HFConfig) -> None:
    """What llama.cpp's two Qwen MoE graphs share: every layer MoE, no sliding windows."""
    wr = w.writer
    if c.get("use_sliding_window", False):
        raise w.refuse("sliding-window attention is not supported by llama.cpp's Qwen MoE graphs.")
    if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1:
        raise w.refuse("dense layers among the MoE layers (mlp_only_layers / decoder_sparse_step) "
                       "have no llama.cpp equivalent for this architecture.")
    wr.add_expert_feed_forward_length(int(c.require("moe_intermediate_size")))
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_rope_dimension_count(head_dim)


def write(w: GGUFKeys, c: HFConfig) -> None:
    # llama.cpp's qwen3moe graph always renormalises the top-k weights.
    if not c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob false: llama.cpp's qwen3moe graph always normalises the "
                       "top-k expert weights, so the converted model would compute differently.")
    write_qwen_moe_keys(w, c)


WRITER = ArchWriter(write)
