"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA attention with q/k/v biases, MoE
layers with one wide shared expert whose output is scaled by a sigmoid gate
(``shared_expert_gate``). GGUF arch ``qwen2moe``.
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
    linear,
    qwen_sliding_layers,
    routed_experts,
    sparse_step_moe_layers,
    storage_formats,
    swiglu,
    text_config,
    torch_dtype_of,
)
from backend.models.spec import ModelSpec

FAMILY = "qwen2_moe"
HF_ARCHITECTURES = ("Qwen2MoeForCausalLM",)
MODEL_TYPES = ("qwen2_moe",)
GGUF_ARCHS = ("qwen2moe",)
GGUF_KEEPS_MTP = False


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    text, has_vision = text_config(config)
    f = Fields(text, source)
    n_layers = f.int("num_hidden_layers")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    n_experts = f.int("num_experts", "num_local_experts")
    top_k = f.int("num_experts_per_tok")
    check_routing(n_experts, top_k, source)
    moe_layers = sparse_step_moe_layers(f, n_layers, n_experts)
    window, sliding = qwen_sliding_layers(f, n_layers)
    shared = f.int("shared_expert_intermediate_size", default=0)
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
        dense_layers=tuple(i for i in range(n_layers) if i not in moe_layers),
        n_routed_experts=n_experts,
        experts_per_token=top_k,
        moe_intermediate_size=f.int("moe_intermediate_size"),
        n_shared_experts=1 if shared else 0,
        shared_intermediate_size=shared,
        dense_intermediate_size=f.int("intermediate_size", default=0),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        sliding_window=window,
        sliding_layers=sliding,
        has_vision=has_vision,
        expert_format=expert_format,
        other_format=other_format,
        torch_dtype=torch_dtype_of(text),
        config=text,
    )


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    h = s.hidden_size
    yield from embeddings(s.vocab_size, h, s.tie_word_embeddings)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        yield from decoder_norms(p, h)
        yield from gqa_attention(f"{p}.self_attn", h, s.num_attention_heads, s.num_kv_heads, s.head_dim,
                                 qkv_bias=bool(s.config.get("qkv_bias", True)))
        if i in s.moe_layers:
            yield TensorShape(f"{p}.mlp.gate.weight", (s.n_routed_experts, h), "router")
            yield from routed_experts(f"{p}.mlp.experts", s.n_routed_experts, h, s.moe_intermediate_size)
            if s.shared_intermediate_size:
                yield from swiglu(f"{p}.mlp.shared_expert", h, s.shared_intermediate_size)
                yield from linear(f"{p}.mlp.shared_expert_gate", 1, h)
        else:
            yield from swiglu(f"{p}.mlp", h, s.dense_intermediate_size)


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    arch = "qwen2moe"
    f = Fields(metadata, source, prefix=f"{arch}.", what="GGUF key")
    cfg = gguf_common_config(f, arch, metadata, tensor_shapes)
    cfg.update(
        architectures=["Qwen2MoeForCausalLM"],
        model_type="qwen2_moe",
        num_hidden_layers=f.int("block_count"),
        intermediate_size=f.int("feed_forward_length", default=0),
        moe_intermediate_size=f.int("expert_feed_forward_length"),
        shared_expert_intermediate_size=f.int("expert_shared_feed_forward_length", default=0),
        num_experts=f.int("expert_count"),
        num_experts_per_tok=f.int("expert_used_count"),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=False,
    )
    return cfg


def spec_from_gguf(metadata: Mapping[str, Any], name: str, *, source: str,
                   tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelSpec:
    return spec_from_config(config_from_gguf(metadata, source=source, tensor_shapes=tensor_shapes),
                            name, source=source)
