"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): every layer MoE with fused expert tensors in MXFP4
plus per-expert biases, attention with biases and learned sinks, sliding-window (128) and
full attention alternating. GGUF arch ``gpt-oss``.

The published checkpoints hold ``mlp.experts.gate_up_proj_blocks``/``_scales``/``_bias`` and
``down_proj_*`` ([E, out, in/32, 16] uint8 blocks and [E, out, in/32] e8m0 scales); a bf16
checkpoint written by transformers holds ``mlp.experts.gate_up_proj`` [E, hidden, 2 x inter]
and ``down_proj`` [E, inter, hidden] instead.
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
    sliding_layers_from_types,
    storage_formats,
    text_config,
    torch_dtype_of,
)
from backend.models.spec import ModelSpec

FAMILY = "gpt_oss"
HF_ARCHITECTURES = ("GptOssForCausalLM",)
MODEL_TYPES = ("gpt_oss",)
GGUF_ARCHS = ("gpt-oss",)
GGUF_KEEPS_MTP = False


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    text, has_vision = text_config(config)
    f = Fields(text, source)
    n_layers = f.int("num_hidden_layers")
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    n_experts = f.int("num_local_experts", "num_experts")
    top_k = f.int("num_experts_per_tok", "experts_per_token")
    check_routing(n_experts, top_k, source)
    window = f.int("sliding_window", default=None)
    types = f.get("layer_types")
    if isinstance(types, list) and types:
        sliding = sliding_layers_from_types(types)
    else:
        # The published models alternate, starting with a sliding layer (as llama.cpp assumes).
        sliding = tuple(range(0, n_layers, 2))
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
        sliding_window=window if sliding else None,
        sliding_layers=sliding if window else (),
        has_vision=has_vision,
        expert_format=expert_format,
        other_format=other_format,
        torch_dtype=torch_dtype_of(text),
        config=text,
    )


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    h, e, inter = s.hidden_size, s.n_routed_experts, s.moe_intermediate_size
    yield from embeddings(s.vocab_size, h, s.tie_word_embeddings)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        yield from decoder_norms(p, h)
        yield from gqa_attention(f"{p}.self_attn", h, s.num_attention_heads, s.num_kv_heads, s.head_dim,
                                 qkv_bias=True, o_bias=True, sinks=True)
        yield TensorShape(f"{p}.mlp.router.weight", (e, h), "router")
        yield TensorShape(f"{p}.mlp.router.bias", (e,), "vector")
        # Fused experts, shapes in [E, out, in] order (the layout of the mxfp4 blocks).
        yield TensorShape(f"{p}.mlp.experts.gate_up_proj", (e, 2 * inter, h))
        yield TensorShape(f"{p}.mlp.experts.gate_up_proj_bias", (e, 2 * inter), "vector")
        yield TensorShape(f"{p}.mlp.experts.down_proj", (e, h, inter), "ffn_down")
        yield TensorShape(f"{p}.mlp.experts.down_proj_bias", (e, h), "vector")


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    arch = "gpt-oss"
    f = Fields(metadata, source, prefix=f"{arch}.", what="GGUF key")
    cfg = gguf_common_config(f, arch, metadata, tensor_shapes)
    n_layers = f.int("block_count")
    window = f.int("attention.sliding_window", default=None)
    cfg.update(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        num_hidden_layers=n_layers,
        head_dim=f.int("attention.key_length", default=cfg["hidden_size"] // cfg["num_attention_heads"]),
        intermediate_size=f.int("expert_feed_forward_length", "feed_forward_length"),
        num_local_experts=f.int("expert_count"),
        num_experts_per_tok=f.int("expert_used_count"),
        sliding_window=window,
        # llama.cpp hard-codes the alternation (swa pattern 2: even layers slide).
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
        attention_bias=True,
        # The clamp of the published models; llama.cpp builds it in rather than storing it.
        swiglu_limit=f.float("swiglu_limit", default=7.0),
    )
    return cfg


def spec_from_gguf(metadata: Mapping[str, Any], name: str, *, source: str,
                   tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> ModelSpec:
    return spec_from_config(config_from_gguf(metadata, source=source, tensor_shapes=tensor_shapes),
                            name, source=source)
