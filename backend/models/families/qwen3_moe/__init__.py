"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-480B-A35B): GQA attention with
per-head q/k RMSNorm, every layer MoE (unless ``mlp_only_layers``), no shared expert.
GGUF arch ``qwen3moe``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hybridmoe.backend.models.families.common import (
    HIDDEN_PER_HEAD,
    DecoderConfig,
    GGUFKey,
    TensorShape,
    decoder_norms,
    dense,
    embeddings,
    gguf_to_config,
    gqa_attention,
    grouped_query,
    mixture,
    qwen3_sliding_layers,
    rms_norms,
    rotation,
    routed_moe,
    softmax_topk,
    sparse_step_moe_layers,
    swiglu,
)
from hybridmoe.backend.models.layer_description import Layer, Loading
from hybridmoe.backend.models.spec import ModelSpec, Routing

FAMILY = "qwen3_moe"
DISPLAY_NAME = "Qwen3-MoE"
HF_ARCHITECTURES = ("Qwen3MoeForCausalLM",)
MODEL_TYPES = ("qwen3_moe",)
GGUF_ARCH = "qwen3moe"
GGUF_KEEPS_MTP = False
ROUTER_FLOAT32 = False
LLAMA_PRE_TOKENIZERS = ("qwen2",)
SPECIAL_TOKEN_ROLES: dict[str, tuple[str, ...]] = {}
RMS_EPS_DEFAULT = 1e-6
ROPE_THETA_DEFAULT = 10000.0
PARTIAL_ROTARY_DEFAULT = 1.0
GGUF_PARTIAL_ROTARY = False

GGUF_TENSOR_NAMES: dict[str, str] = {}
GGUF_PERMUTES_QK = False
GGUF_SPLITS_FUSED_EXPERTS = False
GGUF_SPLITS_KV_B = False
HF_NAME_ALIASES: tuple = ()

# Config keys llama.cpp's converter stores for this family, beyond those every family has.
GGUF_KEYS = (
    GGUFKey("head_dim", "attention.key_length", default=HIDDEN_PER_HEAD),
    GGUFKey("intermediate_size", "feed_forward_length", default=0),
    GGUFKey("moe_intermediate_size", "expert_feed_forward_length"),
    GGUFKey("num_experts", "expert_count"),
)


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    # transformers 5 writes num_local_experts where the published configs say num_experts.
    c = DecoderConfig.read(config, source, expert_count=("num_experts", "num_local_experts"))
    f = c.fields
    moe_layers = sparse_step_moe_layers(f, c.num_layers, c.n_routed_experts)
    window, sliding = qwen3_sliding_layers(f, c.num_layers)
    return c.spec(
        name, FAMILY,
        moe_layers=moe_layers,
        moe_intermediate_size=f.int("moe_intermediate_size"),
        dense_intermediate_size=f.int("intermediate_size", default=0),
        sliding_window=window,
        sliding_layers=sliding,
        routing=Routing(normalize=bool(f.get("norm_topk_prob", default=False))),
    )


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    h = s.hidden_size
    bias = bool(s.config.get("attention_bias", False))
    yield from embeddings(s.vocab_size, h, s.tie_word_embeddings)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        yield from decoder_norms(p, h)
        yield from gqa_attention(f"{p}.self_attn", s, qkv_bias=bias, o_bias=bias,
                                 q_norm=s.head_dim, k_norm=s.head_dim)
        if i in s.moe_layers:
            yield from routed_moe(f"{p}.mlp", s)
        else:
            yield from swiglu(f"{p}.mlp", h, s.dense_intermediate_size)


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    cfg, _ = gguf_to_config(metadata, source, tensor_shapes, GGUF_ARCH, GGUF_KEYS)
    # Not stored in the GGUF: llama.cpp's qwen3moe puts experts in every layer and
    # renormalises the top-k weights.
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    return cfg


def describe_layers(s: ModelSpec, loading: Loading) -> tuple[Layer, ...]:
    """Per-head q/k norm; a softmax top-k router; dense layers where the spec has them."""
    rotary, norms = rotation(s, ROPE_THETA_DEFAULT, PARTIAL_ROTARY_DEFAULT), rms_norms(s, RMS_EPS_DEFAULT)
    return tuple(Layer(grouped_query(s, i, loading, rotary, qk_norm="per_head"),
                       mixture(s, i, loading, softmax_topk(s, loading)) if i in s.moe_layers else dense(s, loading),
                       norms)
                 for i in range(s.num_layers))
