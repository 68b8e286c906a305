"""DeepSeek-V2/V3/R1 and Kimi K2.x: multi-head latent attention (MLA), a few dense leading
layers, then MoE layers with shared experts.

Kimi K2 is DeepSeek-V3 with 384 experts and 64 heads; Kimi K2.5/K2.6 wrap it with a vision
tower (``KimiK25ForConditionalGeneration``): the language model's config is under
``text_config`` and its tensors under ``language_model.``. GGUF arch ``deepseek2`` covers all
of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from backend.errors import ModelError
from backend.models.families.common import (
    Fields,
    TensorShape,
    architecture_of,
    check_routing,
    decoder_norms,
    embeddings,
    gguf_common_config,
    linear,
    norm,
    routed_experts,
    storage_formats,
    swiglu,
    text_config,
    torch_dtype_of,
)
from backend.models.spec import ModelSpec

FAMILY = "deepseek"
HF_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "KimiK2ForCausalLM",
)
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")
GGUF_ARCHS = ("deepseek2",)
# llama.cpp's converter drops DeepSeek's MTP layer, so a GGUF estimate leaves it out.
GGUF_KEEPS_MTP = False


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    text, has_vision = text_config(config)
    f = Fields(text, source)
    n_layers = f.int("num_hidden_layers")
    heads = f.int("num_attention_heads")
    n_experts = f.int("n_routed_experts")
    top_k = f.int("num_experts_per_tok")
    first_dense = f.int("first_k_dense_replace", default=0)
    freq = f.int("moe_layer_freq", default=1)
    if freq < 1:
        raise ModelError(f"'moe_layer_freq' in {source} must be at least 1, not {freq}.",
                         "Restore the original config.json from the model repository.")
    moe_layers = tuple(i for i in range(n_layers) if i >= first_dense and i % freq == 0)
    moe_inter = f.int("moe_intermediate_size")
    n_shared = f.int("n_shared_experts", default=0)
    rope, nope = f.int("qk_rope_head_dim"), f.int("qk_nope_head_dim")
    q_lora = f.int("q_lora_rank", default=0) or None
    expert_format, other_format = storage_formats(text, source)
    check_routing(n_experts, top_k, source)
    return ModelSpec(
        name=name,
        family=FAMILY,
        architecture=architecture_of(config),
        hidden_size=f.int("hidden_size"),
        num_layers=n_layers,
        vocab_size=f.int("vocab_size"),
        num_attention_heads=heads,
        num_kv_heads=f.int("num_key_value_heads", default=heads),
        head_dim=nope + rope,
        attention="mla",
        max_context=f.int("max_position_embeddings"),
        moe_layers=moe_layers,
        dense_layers=tuple(i for i in range(n_layers) if i not in moe_layers),
        n_routed_experts=n_experts,
        experts_per_token=top_k,
        moe_intermediate_size=moe_inter,
        n_shared_experts=n_shared,
        shared_intermediate_size=n_shared * moe_inter,
        dense_intermediate_size=f.int("intermediate_size"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        kv_lora_rank=f.int("kv_lora_rank"),
        q_lora_rank=q_lora,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=f.int("v_head_dim"),
        n_mtp_layers=f.int("num_nextn_predict_layers", default=0),
        has_vision=has_vision,
        vision_params=vision_params_estimate(config.get("vision_config") or {}) if has_vision else 0,
        expert_format=expert_format,
        other_format=other_format,
        torch_dtype=torch_dtype_of(text),
        config=text,
    )


def _mla_attention(prefix: str, s: ModelSpec) -> Iterator[TensorShape]:
    h, heads = s.hidden_size, s.num_attention_heads
    if s.q_lora_rank:
        yield from linear(f"{prefix}.q_a_proj", s.q_lora_rank, h)
        yield norm(f"{prefix}.q_a_layernorm.weight", s.q_lora_rank)
        yield from linear(f"{prefix}.q_b_proj", heads * s.head_dim, s.q_lora_rank)
    else:
        yield from linear(f"{prefix}.q_proj", heads * s.head_dim, h)
    yield from linear(f"{prefix}.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, h)
    yield norm(f"{prefix}.kv_a_layernorm.weight", s.kv_lora_rank)
    yield from linear(f"{prefix}.kv_b_proj", heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
    yield from linear(f"{prefix}.o_proj", h, heads * s.v_head_dim, "attn_output")


def _decoder_layer(prefix: str, s: ModelSpec, moe: bool) -> Iterator[TensorShape]:
    h = s.hidden_size
    yield from decoder_norms(prefix, h)
    yield from _mla_attention(f"{prefix}.self_attn", s)
    if not moe:
        yield from swiglu(f"{prefix}.mlp", h, s.dense_intermediate_size)
        return
    yield TensorShape(f"{prefix}.mlp.gate.weight", (s.n_routed_experts, h), "router")
    if _has_correction_bias(s.config):
        yield TensorShape(f"{prefix}.mlp.gate.e_score_correction_bias", (s.n_routed_experts,), "fp32")
    yield from routed_experts(f"{prefix}.mlp.experts", s.n_routed_experts, h, s.moe_intermediate_size)
    if s.n_shared_experts:
        yield from swiglu(f"{prefix}.mlp.shared_experts", h, s.shared_intermediate_size)


def _has_correction_bias(config: Mapping[str, Any]) -> bool:
    """DeepSeek-V3-style routing (``noaux_tc``) keeps a per-expert ``e_score_correction_bias``;
    transformers' own V3 configs omit topk_method because V3 always routes that way."""
    method = config.get("topk_method")
    if method is None:
        return config.get("model_type") in ("deepseek_v3", "kimi_k2")
    return method == "noaux_tc"


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    """The tensors of the published checkpoint, MTP layers included (they count as other)."""
    model = "language_model.model" if s.has_vision else "model"
    yield from embeddings(s.vocab_size, s.hidden_size, s.tie_word_embeddings, model)
    for i in range(s.num_layers):
        yield from _decoder_layer(f"{model}.layers.{i}", s, i in s.moe_layers)
    h = s.hidden_size
    for i in range(s.num_layers, s.num_layers + s.n_mtp_layers):
        # DeepSeek-V3's MTP module: a full MoE decoder layer plus its own copies of the
        # embedding and the head, and the projection that merges the two streams.
        p = f"{model}.layers.{i}"
        yield from _decoder_layer(p, s, True)
        yield TensorShape(f"{p}.embed_tokens.weight", (s.vocab_size, h), "token_embd")
        yield norm(f"{p}.enorm.weight", h)
        yield norm(f"{p}.hnorm.weight", h)
        yield TensorShape(f"{p}.eh_proj.weight", (h, 2 * h), "mtp")
        yield norm(f"{p}.shared_head.norm.weight", h)
        yield TensorShape(f"{p}.shared_head.head.weight", (s.vocab_size, h), "output")
    if s.vision_params:
        yield TensorShape("vision_tower.(estimated from vision_config)", (s.vision_params,), "vision")


def vision_params_estimate(vc: Mapping[str, Any]) -> int:
    """Weights of the Kimi K2.5/K2.6 MoonViT tower and patch-merger projector.

    An estimate from ``vision_config`` (ViT blocks with qkv/o and a two-layer MLP, patch and
    position embeddings, the projector); it is under 1 GiB of a 554 GiB checkpoint and only
    counts as "other".
    """
    h = int(vc.get("vt_hidden_size") or 0)
    if not h:
        return 0
    inter = int(vc.get("vt_intermediate_size") or 4 * h)
    layers = int(vc.get("vt_num_hidden_layers") or 0)
    patch = int(vc.get("patch_size") or 14)
    per_layer = 4 * h * h + 2 * h * inter + 4 * h + inter + 5 * h
    pos = int(vc.get("init_pos_emb_height") or 0) * int(vc.get("init_pos_emb_width") or 0) * h
    tower = layers * per_layer + 3 * patch * patch * h + pos + 2 * h
    merge = math.prod(vc.get("merge_kernel_size") or [2, 2])
    mm = int(vc.get("mm_hidden_size") or h) * merge
    text_h = int(vc.get("text_hidden_size") or 0)
    projector = mm * mm + mm + mm * text_h + text_h + 2 * mm
    return tower + projector


# --- GGUF -------------------------------------------------------------------------------


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    arch = "deepseek2"
    f = Fields(metadata, source, prefix=f"{arch}.", what="GGUF key")
    cfg = gguf_common_config(f, arch, metadata, tensor_shapes)
    n_mtp = f.int("nextn_predict_layers", default=0)
    rope = f.int("rope.dimension_count")
    # Recent llama.cpp converts MLA for the absorbed form (attn_k_b/attn_v_b, head_count_kv 1)
    # and keeps the per-head sizes in *_mla keys; older files have them in key/value_length.
    key_len = f.int("attention.key_length_mla", "attention.key_length")
    value_len = f.int("attention.value_length_mla", "attention.value_length")
    if f.has("attention.key_length_mla"):
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    gating = f.int("expert_gating_func", default=1)
    sigmoid = gating == 2
    cfg.update(
        architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if sigmoid else "deepseek_v2",
        num_hidden_layers=f.int("block_count") - n_mtp,
        num_nextn_predict_layers=n_mtp,
        intermediate_size=f.int("feed_forward_length"),
        moe_intermediate_size=f.int("expert_feed_forward_length"),
        n_routed_experts=f.int("expert_count"),
        num_experts_per_tok=f.int("expert_used_count"),
        n_shared_experts=f.int("expert_shared_count", default=0),
        first_k_dense_replace=f.int("leading_dense_block_count", default=0),
        moe_layer_freq=1,
        kv_lora_rank=f.int("attention.kv_lora_rank"),
        q_lora_rank=f.int("attention.q_lora_rank", default=0) or None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key_len - rope,
        v_head_dim=value_len,
        routed_scaling_factor=f.float("expert_weights_scale", default=1.0),
        norm_topk_prob=bool(f.get("expert_weights_norm", default=False)),
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if sigmoid else "greedy",
        n_group=f.int("expert_group_count", default=1),
        topk_group=f.int("expert_group_used_count", default=1),
    )
    if "rope_scaling" in cfg and f.has("rope.scaling.yarn_log_multiplier"):
        # llama.cpp stores 0.1 * mscale_all_dim as the YaRN log multiplier.
        mscale = f.float("rope.scaling.yarn_log_multiplier") / 0.1
        cfg["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)
    return cfg


def spec_from_gguf(metadata: Mapping[str, Any], name: str, *, source: str,
                   tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelSpec:
    return spec_from_config(config_from_gguf(metadata, source=source, tensor_shapes=tensor_shapes),
                            name, source=source)
