"""OLMoE (allenai/OLMoE-1B-7B): every layer MoE (64 experts, top-8), no shared expert,
RMSNorm on the whole q and k projections (not per head). GGUF arch ``olmoe``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hybridmoe.backend.models.families.common import (
    DecoderConfig,
    GGUFKey,
    TensorShape,
    decoder_norms,
    embeddings,
    gguf_to_config,
    gqa_attention,
    grouped_query,
    mixture,
    rms_norms,
    rotation,
    routed_moe,
    softmax_topk,
)
from hybridmoe.backend.models.layer_description import Layer, Loading
from hybridmoe.backend.models.spec import ModelSpec, Routing

FAMILY = "olmoe"
DISPLAY_NAME = "OLMoE"
HF_ARCHITECTURES = ("OlmoeForCausalLM",)
MODEL_TYPES = ("olmoe",)
GGUF_ARCH = "olmoe"
GGUF_KEEPS_MTP = False
ROUTER_FLOAT32 = False
LLAMA_PRE_TOKENIZERS = ("gpt-2", "olmo")
SPECIAL_TOKEN_ROLES: dict[str, tuple[str, ...]] = {}
RMS_EPS_DEFAULT = 1e-5
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
    # Every MLP is an expert, so the config's intermediate_size is the expert width.
    GGUFKey("intermediate_size", ("expert_feed_forward_length", "feed_forward_length")),
    GGUFKey("num_experts", "expert_count"),
)


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    # transformers 5 may write num_local_experts where the published configs say num_experts.
    c = DecoderConfig.read(config, source, expert_count=("num_experts", "num_local_experts"))
    return c.spec(name, FAMILY, moe_layers=tuple(range(c.num_layers)),
                  moe_intermediate_size=c.fields.int("intermediate_size"),
                  routing=Routing(normalize=bool(c.fields.get("norm_topk_prob", default=False))))


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    h = s.hidden_size
    yield from embeddings(s.vocab_size, h, s.tie_word_embeddings)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        yield from decoder_norms(p, h)
        yield from gqa_attention(f"{p}.self_attn", s, qkv_bias=bool(s.config.get("attention_bias", False)),
                                 q_norm=s.num_attention_heads * s.head_dim, k_norm=s.num_kv_heads * s.head_dim)
        yield from routed_moe(f"{p}.mlp", s)


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    cfg, _ = gguf_to_config(metadata, source, tensor_shapes, GGUF_ARCH, GGUF_KEYS)
    # Not stored in the GGUF: llama.cpp's olmoe does not renormalise the top-k weights.
    cfg.update(architectures=["OlmoeForCausalLM"], model_type="olmoe", norm_topk_prob=False)
    return cfg


def describe_layers(s: ModelSpec, loading: Loading) -> tuple[Layer, ...]:
    """q/k norm over all heads at once, q/k/v clipped where the config says; a softmax top-k router."""
    clip = s.config.get("clip_qkv")
    rotary, norms = rotation(s, ROPE_THETA_DEFAULT, PARTIAL_ROTARY_DEFAULT), rms_norms(s, RMS_EPS_DEFAULT)
    return tuple(Layer(grouped_query(s, i, loading, rotary, qk_norm="whole",
                                     clip_qkv=None if clip is None else float(clip)),
                       mixture(s, i, loading, softmax_topk(s, loading)), norms)
                 for i in range(s.num_layers))
