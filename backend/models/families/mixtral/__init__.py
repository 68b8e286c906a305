"""Mixtral (8x7B, 8x22B): Llama/Mistral attention, every layer MoE with 8 experts, top-2,
no shared expert. Checkpoint names are ``block_sparse_moe.experts.E.w1/w2/w3`` (gate, down,
up). In GGUF it is arch ``llama`` with ``llama.expert_count`` > 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from hybridmoe.backend.models.families.common import (
    HIDDEN_PER_HEAD,
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
from hybridmoe.backend.models.layer_description import ExpertTensors, Layer, Loading
from hybridmoe.backend.models.spec import ModelSpec, Routing

FAMILY = "mixtral"
DISPLAY_NAME = "Mixtral"
HF_ARCHITECTURES = ("MixtralForCausalLM",)
MODEL_TYPES = ("mixtral",)
GGUF_ARCH = "llama"  # only with expert_count > 0: see the registry
GGUF_KEEPS_MTP = False
ROUTER_FLOAT32 = False
LLAMA_PRE_TOKENIZERS = ("llama-bpe", "tekken")
SPECIAL_TOKEN_ROLES: dict[str, tuple[str, ...]] = {}
RMS_EPS_DEFAULT = 1e-5
ROPE_THETA_DEFAULT = 1e6
PARTIAL_ROTARY_DEFAULT = 1.0
GGUF_PARTIAL_ROTARY = False

GGUF_TENSOR_NAMES: dict[str, str] = {}
# llama.cpp's converter permutes the rows of Q and K so that ggml's interleaved ("normal")
# RoPE computes what transformers' rotate-half RoPE does.
GGUF_PERMUTES_QK = True
GGUF_SPLITS_FUSED_EXPERTS = False
GGUF_SPLITS_KV_B = False
# Mixtral's checkpoint names (block_sparse_moe, w1/w3/w2) as the common ones a GGUF's tensors
# map to, so that the engine finds either.
HF_NAME_ALIASES = (
    (re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight"), r"\1.mlp.gate.weight"),
    (re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight"),
     r"\1.mlp.experts.\2.gate_proj.weight"),
    (re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight"),
     r"\1.mlp.experts.\2.up_proj.weight"),
    (re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight"),
     r"\1.mlp.experts.\2.down_proj.weight"),
)

# Config keys llama.cpp's converter stores for this family, beyond those every family has.
GGUF_KEYS = (
    GGUFKey("head_dim", ("attention.key_length", "rope.dimension_count"), default=HIDDEN_PER_HEAD),
    # Mixtral GGUFs carry the expert width as the plain feed_forward_length.
    GGUFKey("intermediate_size", ("expert_feed_forward_length", "feed_forward_length")),
    GGUFKey("num_local_experts", "expert_count"),
)


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    c = DecoderConfig.read(config, source, expert_count=("num_local_experts", "num_experts"))
    # Mistral's sliding window, when set, applies to every layer.
    window = c.fields.int("sliding_window", default=None)
    all_layers = tuple(range(c.num_layers))
    return c.spec(name, FAMILY, moe_layers=all_layers,
                  moe_intermediate_size=c.fields.int("intermediate_size"),
                  sliding_window=window, sliding_layers=all_layers if window else (),
                  # Mixtral always renormalises its top-k weights.
                  routing=Routing(normalize=True))


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    h = s.hidden_size
    yield from embeddings(s.vocab_size, h, s.tie_word_embeddings)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        yield from decoder_norms(p, h)
        yield from gqa_attention(f"{p}.self_attn", s)
        yield from routed_moe(f"{p}.block_sparse_moe", s, names=("w1", "w3", "w2"))


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    cfg, _ = gguf_to_config(metadata, source, tensor_shapes, GGUF_ARCH, GGUF_KEYS)
    # Not stored in the GGUF: llama.cpp's llama arch has no sliding window.
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", sliding_window=None)
    return cfg


def describe_layers(s: ModelSpec, loading: Loading) -> tuple[Layer, ...]:
    """Plain grouped-query attention; routed experts under a softmax top-k router, its weights
    kept in float32, in every layer. Hub checkpoints name the block block_sparse_moe and the
    experts w1 (gate), w3 (up), w2 (down); transformers' fused layout names it mlp."""
    rotary, norms = rotation(s, ROPE_THETA_DEFAULT, PARTIAL_ROTARY_DEFAULT), rms_norms(s, RMS_EPS_DEFAULT)
    router = softmax_topk(s, loading, weights_float32=True)
    tensors = ExpertTensors(blocks=("block_sparse_moe", "mlp"), experts=("w1", "w3", "w2"))
    return tuple(Layer(grouped_query(s, i, loading, rotary), mixture(s, i, loading, router, tensors=tensors), norms)
                 for i in range(s.num_layers))
