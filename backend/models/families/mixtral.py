"""Mixtral (8x7B, 8x22B): Llama/Mistral attention, every layer MoE with 8 experts, top-2,
no shared expert. Checkpoint names are ``block_sparse_moe.experts.E.w1/w2/w3`` (gate, down,
up). In GGUF it is arch ``llama`` with ``llama.expert_count`` > 0.
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
    routed_experts,
    storage_formats,
    text_config,
    torch_dtype_of,
)
from backend.models.spec import ModelSpec

FAMILY = "mixtral"
HF_ARCHITECTURES = ("MixtralForCausalLM",)
MODEL_TYPES = ("mixtral",)
GGUF_ARCHS = ("llama",)  # only with expert_count > 0: see the registry
GGUF_KEEPS_MTP = False


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    text, has_vision = text_config(config)
    f = Fields(text, source)
    n_layers = f.int("num_hidden_layers")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    n_experts = f.int("num_local_experts", "num_experts")
    top_k = f.int("num_experts_per_tok")
    check_routing(n_experts, top_k, source)
    # Mistral's sliding window, when set, applies to every layer.
    window = f.int("sliding_window", default=None)
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
        moe_layers=tuple(range(n_layers)),
        dense_layers=(),
        n_routed_experts=n_experts,
        experts_per_token=top_k,
        moe_intermediate_size=f.int("intermediate_size"),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
        sliding_window=window,
        sliding_layers=tuple(range(n_layers)) if window else (),
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
        yield from gqa_attention(f"{p}.self_attn", h, s.num_attention_heads, s.num_kv_heads, s.head_dim)
        yield TensorShape(f"{p}.block_sparse_moe.gate.weight", (s.n_routed_experts, h), "router")
        yield from routed_experts(f"{p}.block_sparse_moe.experts", s.n_routed_experts, h,
                                  s.moe_intermediate_size, names=("w1", "w3", "w2"))


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    arch = "llama"
    f = Fields(metadata, source, prefix=f"{arch}.", what="GGUF key")
    cfg = gguf_common_config(f, arch, metadata, tensor_shapes)
    head_dim = f.int("attention.key_length", "rope.dimension_count",
                     default=cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_hidden_layers=f.int("block_count"),
        head_dim=head_dim,
        # Mixtral GGUFs carry the expert width as the plain feed_forward_length.
        intermediate_size=f.int("expert_feed_forward_length", "feed_forward_length"),
        num_local_experts=f.int("expert_count"),
        num_experts_per_tok=f.int("expert_used_count"),
        sliding_window=None,
    )
    return cfg


def spec_from_gguf(metadata: Mapping[str, Any], name: str, *, source: str,
                   tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelSpec:
    return spec_from_config(config_from_gguf(metadata, source=source, tensor_shapes=tensor_shapes),
                            name, source=source)
