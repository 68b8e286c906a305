"""A Hugging Face text config as llama.cpp's ``{arch}.*`` metadata keys.

This is the inverse of the families' ``config_from_gguf`` (``backend.models.families``):
what those read, this writes, under the key names llama.cpp's model loaders look up. A
config that llama.cpp's graph for the architecture cannot represent (a routing variant it
hard-codes differently, dense layers where it expects experts, sliding windows it does not
implement) is refused here, before anything is written, rather than converted into a file
that loads and then computes something else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gguf

from backend.engine.hf_config import HFConfig
from backend.errors import UnsupportedModelError

# hybridmoe family -> llama.cpp architecture name.
ARCHITECTURES = {
    "deepseek": "deepseek2",
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "mixtral": "llama",
    "olmoe": "olmoe",
}

_USE_GGUF = "Use a GGUF published for this model, or run the checkpoint with the embedded engine."


def gguf_arch(family: str, source: str) -> str:
    arch = ARCHITECTURES.get(family)
    if arch is None:
        raise UnsupportedModelError(
            f"{source}: converting {family} checkpoints to GGUF is not supported yet "
            f"(supported: {', '.join(sorted(ARCHITECTURES))}).",
            _USE_GGUF,
        )
    return arch


def write_hparams(writer: gguf.GGUFWriter, family: str, config: Mapping[str, Any], n_layers: int,
                  source: str) -> None:
    """Write the architecture keys of `config` (a text config) for `family`."""
    cfg = HFConfig(dict(config), source)
    w = _Keys(writer, cfg, source)
    # MLA in llama.cpp's absorbed form has one shared "KV head" (see _deepseek2).
    w.common(n_layers, head_count_kv=1 if family == "deepseek" else None)
    {
        "deepseek": _deepseek2,
        "qwen3_moe": _qwen3moe,
        "qwen2_moe": _qwen2moe,
        "mixtral": _mixtral,
        "olmoe": _olmoe,
    }[family](w, cfg)


class _Keys:
    def __init__(self, writer: gguf.GGUFWriter, cfg: HFConfig, source: str):
        self.writer = writer
        self.cfg = cfg
        self.source = source

    def refuse(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.source}: {what}", _USE_GGUF)

    def common(self, n_layers: int, head_count_kv: int | None) -> None:
        c, wr = self.cfg, self.writer
        wr.add_context_length(int(c.require("max_position_embeddings")))
        wr.add_embedding_length(int(c.require("hidden_size")))
        wr.add_block_count(n_layers)
        if c.get("intermediate_size"):
            wr.add_feed_forward_length(int(c.get("intermediate_size")))
        wr.add_head_count(int(c.require("num_attention_heads")))
        wr.add_head_count_kv(head_count_kv or int(c.get("num_key_value_heads") or c.require("num_attention_heads")))
        wr.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", 1e-6)))
        wr.add_vocab_size(int(c.require("vocab_size")))
        n_experts = c.n_routed_experts()
        wr.add_expert_count(n_experts)
        wr.add_expert_used_count(int(c.require("num_experts_per_tok")))
        self.rope()

    def rope(self) -> None:
        rope = self.cfg.rope()
        wr = self.writer
        wr.add_rope_freq_base(rope.theta)
        if rope.partial_rotary_factor != 1.0:
            raise self.refuse(f"partial rotary embeddings (factor {rope.partial_rotary_factor}) are not "
                              "supported by this converter.")
        if rope.kind == "default":
            return
        factor = float(rope.get("factor", 1.0))
        if rope.kind == "linear":
            wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            wr.add_rope_scaling_factor(factor)
        elif rope.kind == "yarn":
            wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            wr.add_rope_scaling_factor(factor)
            wr.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")))
            if rope.get("beta_fast") is not None:
                wr.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast")))
            if rope.get("beta_slow") is not None:
                wr.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow")))
        else:
            raise self.refuse(f"rope scaling {rope.kind!r} is not supported by this converter.")


def _deepseek2(w: _Keys, c: HFConfig) -> None:
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
    if n_group > 1:
        wr.add_expert_group_count(n_group)
        wr.add_expert_group_used_count(topk_group)
    rope = c.rope()
    if rope.kind == "yarn":
        # llama.cpp's deepseek2 graph rebuilds the softmax scale (mscale^2) from this; the
        # 0.1 factor is llama.cpp's convention for the key (it divides it out again).
        wr.add_rope_scaling_yarn_log_mul(0.1 * float(rope.get("mscale_all_dim", 0.0)))


def _qwen_common(w: _Keys, c: HFConfig) -> None:
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


def _qwen3moe(w: _Keys, c: HFConfig) -> None:
    # llama.cpp's qwen3moe graph always renormalises the top-k weights.
    if not c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob false: llama.cpp's qwen3moe graph always normalises the "
                       "top-k expert weights, so the converted model would compute differently.")
    _qwen_common(w, c)


def _qwen2moe(w: _Keys, c: HFConfig) -> None:
    # ... and its qwen2moe graph never does.
    if c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob true: llama.cpp's qwen2moe graph never normalises the "
                       "top-k expert weights, so the converted model would compute differently.")
    _qwen_common(w, c)
    w.writer.add_expert_shared_feed_forward_length(int(c.require("shared_expert_intermediate_size")))


def _mixtral(w: _Keys, c: HFConfig) -> None:
    wr = w.writer
    if c.get("sliding_window"):
        raise w.refuse("sliding-window attention is not supported by llama.cpp's llama graph.")
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    wr.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)


def _olmoe(w: _Keys, c: HFConfig) -> None:
    wr = w.writer
    if c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob true: llama.cpp's olmoe graph never normalises the top-k "
                       "expert weights.")
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    wr.add_rope_dimension_count(hidden // heads)
    if c.get("clip_qkv"):
        wr.add_clamp_kqv(float(c.get("clip_qkv")))
