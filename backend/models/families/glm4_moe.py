"""GLM-4.5 / GLM-4.5-Air (and GLM-4.6, same architecture): GQA attention with q/k/v biases
and optional per-head q/k norms, ``first_k_dense_replace`` dense layers, then MoE layers
with sigmoid routing, a correction bias and one shared expert; one NextN (MTP) layer after
the decoder stack. GGUF arch ``glm4moe`` (its block_count includes the NextN layer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from backend.models.families.common import (
    Fields,
    TensorShape,
    architecture_of,
    check_routing,
    decoder_norms,
    embeddings,
    gguf_common_config,
    gqa_attention,
    norm,
    routed_experts,
    storage_formats,
    swiglu,
    text_config,
    torch_dtype_of,
)
from backend.models.spec import ModelSpec

FAMILY = "glm4_moe"
HF_ARCHITECTURES = ("Glm4MoeForCausalLM",)
MODEL_TYPES = ("glm4_moe",)
GGUF_ARCHS = ("glm4moe",)
# llama.cpp's converter keeps GLM's NextN layer (as blk.N with nextn.* tensors).
GGUF_KEEPS_MTP = True


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    text, has_vision = text_config(config)
    f = Fields(text, source)
    n_layers = f.int("num_hidden_layers")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    n_experts = f.int("n_routed_experts", "num_experts")
    top_k = f.int("num_experts_per_tok")
    check_routing(n_experts, top_k, source)
    first_dense = f.int("first_k_dense_replace", default=0)
    moe_layers = tuple(range(first_dense, n_layers))
    moe_inter = f.int("moe_intermediate_size")
    n_shared = f.int("n_shared_experts", default=0)
    expert_format, other_format = storage_formats(text, source)
    return ModelSpec(
        name=name,
        family=FAMILY,
        architecture=architecture_of(config),
        hidden_size=hidden,
        num_layers=n_layers,
        vocab_size=f.int("vocab_size"),
        num_attention_heads=heads,
        num_kv_heads=f.int("num_key_value_heads", default=heads),
        head_dim=f.int("head_dim", default=hidden // heads),
        attention="gqa",
        max_context=f.int("max_position_embeddings"),
        moe_layers=moe_layers,
        dense_layers=tuple(range(min(first_dense, n_layers))),
        n_routed_experts=n_experts,
        experts_per_token=top_k,
        moe_intermediate_size=moe_inter,
        n_shared_experts=n_shared,
        shared_intermediate_size=n_shared * moe_inter,
        dense_intermediate_size=f.int("intermediate_size"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        n_mtp_layers=f.int("num_nextn_predict_layers", default=0),
        has_vision=has_vision,
        expert_format=expert_format,
        other_format=other_format,
        torch_dtype=torch_dtype_of(text),
        config=text,
    )


def _decoder_layer(p: str, s: ModelSpec, moe: bool) -> Iterator[TensorShape]:
    h = s.hidden_size
    yield from decoder_norms(p, h)
    qk_norm = s.head_dim if s.config.get("use_qk_norm") else 0
    yield from gqa_attention(f"{p}.self_attn", h, s.num_attention_heads, s.num_kv_heads, s.head_dim,
                             qkv_bias=bool(s.config.get("attention_bias", False)),
                             q_norm=qk_norm, k_norm=qk_norm)
    if not moe:
        yield from swiglu(f"{p}.mlp", h, s.dense_intermediate_size)
        return
    yield TensorShape(f"{p}.mlp.gate.weight", (s.n_routed_experts, h), "router")
    yield TensorShape(f"{p}.mlp.gate.e_score_correction_bias", (s.n_routed_experts,), "fp32")
    yield from routed_experts(f"{p}.mlp.experts", s.n_routed_experts, h, s.moe_intermediate_size)
    if s.n_shared_experts:
        yield from swiglu(f"{p}.mlp.shared_experts", h, s.shared_intermediate_size)


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    h = s.hidden_size
    yield from embeddings(s.vocab_size, h, s.tie_word_embeddings)
    for i in range(s.num_layers):
        yield from _decoder_layer(f"model.layers.{i}", s, i in s.moe_layers)
    for i in range(s.num_layers, s.num_layers + s.n_mtp_layers):
        # NextN layer: a MoE decoder layer, the projection merging embedding and hidden
        # state, and copies of the embedding and head (llama.cpp keeps them as
        # nextn.embed_tokens / nextn.shared_head_head; with them the GLM-4.5-Air Q8_0 GGUF
        # comes to the published 109.38 GiB).
        p = f"model.layers.{i}"
        yield from _decoder_layer(p, s, True)
        yield TensorShape(f"{p}.embed_tokens.weight", (s.vocab_size, h), "token_embd")
        yield norm(f"{p}.enorm.weight", h)
        yield norm(f"{p}.hnorm.weight", h)
        yield TensorShape(f"{p}.eh_proj.weight", (h, 2 * h), "mtp")
        yield norm(f"{p}.shared_head.norm.weight", h)
        yield TensorShape(f"{p}.shared_head.head.weight", (s.vocab_size, h), "output")


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    arch = "glm4moe"
    f = Fields(metadata, source, prefix=f"{arch}.", what="GGUF key")
    cfg = gguf_common_config(f, arch, metadata, tensor_shapes)
    n_mtp = f.int("nextn_predict_layers", default=0)
    head_dim = f.int("attention.key_length", default=cfg["hidden_size"] // cfg["num_attention_heads"])
    rope_dims = f.int("rope.dimension_count", default=head_dim)
    cfg.update(
        architectures=["Glm4MoeForCausalLM"],
        model_type="glm4_moe",
        num_hidden_layers=f.int("block_count") - n_mtp,
        num_nextn_predict_layers=n_mtp,
        head_dim=head_dim,
        partial_rotary_factor=rope_dims / head_dim,
        intermediate_size=f.int("feed_forward_length"),
        moe_intermediate_size=f.int("expert_feed_forward_length"),
        n_routed_experts=f.int("expert_count"),
        n_shared_experts=f.int("expert_shared_count", default=0),
        num_experts_per_tok=f.int("expert_used_count"),
        first_k_dense_replace=f.int("leading_dense_block_count", default=0),
        routed_scaling_factor=f.float("expert_weights_scale", default=1.0),
        norm_topk_prob=bool(f.get("expert_weights_norm", default=True)),
        attention_bias=True,
        use_qk_norm=bool(tensor_shapes and any(n.endswith("attn_q_norm.weight") for n in tensor_shapes)),
    )
    return cfg


def spec_from_gguf(metadata: Mapping[str, Any], name: str, *, source: str,
                   tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelSpec:
    return spec_from_config(config_from_gguf(metadata, source=source, tensor_shapes=tensor_shapes),
                            name, source=source)
