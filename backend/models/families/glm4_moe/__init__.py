"""GLM-4.5 / GLM-4.5-Air (and GLM-4.6, same architecture): GQA attention with q/k/v biases
and optional per-head q/k norms, ``first_k_dense_replace`` dense layers, then MoE layers
with sigmoid routing, a correction bias and one shared expert; one NextN (MTP) layer after
the decoder stack. GGUF arch ``glm4moe`` (its block_count includes the NextN layer).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from hybridmoe.backend.models.families.common import (
    DEEPSEEK_STYLE_MOE_KEYS,
    HIDDEN_PER_HEAD,
    DecoderConfig,
    GGUFKey,
    TensorShape,
    decoder_norms,
    deepseek_style_mlp,
    dense,
    embeddings,
    gguf_to_config,
    gqa_attention,
    grouped_query,
    mixture,
    mtp_layer_extras,
    rms_norms,
    rotation,
)
from hybridmoe.backend.models.families import deepseek
from hybridmoe.backend.models.layer_description import Layer, Loading
from hybridmoe.backend.models.spec import ModelSpec, Routing

FAMILY = "glm4_moe"
DISPLAY_NAME = "GLM-4.5"
HF_ARCHITECTURES = ("Glm4MoeForCausalLM",)
MODEL_TYPES = ("glm4_moe",)
GGUF_ARCH = "glm4moe"
# llama.cpp's converter keeps GLM's NextN layer (as blk.N with nextn.* tensors).
GGUF_KEEPS_MTP = True
# The engine holds (and reads) the routers' matrices in float32, as the reference routes.
ROUTER_FLOAT32 = True

LLAMA_PRE_TOKENIZERS = ("glm4",)
# GLM-4.5 ends an assistant turn by starting the next one: <|user|> is its end of turn and
# <|observation|> (a tool result follows) its end of message; [gMASK] opens every prompt (the
# chat template writes it; no BOS is added).
SPECIAL_TOKEN_ROLES = {"eot": ("<|user|>",), "eom": ("<|observation|>",), "bos": ("[gMASK]",)}
RMS_EPS_DEFAULT = 1e-5
ROPE_THETA_DEFAULT = 10000.0
PARTIAL_ROTARY_DEFAULT = 0.5
GGUF_PARTIAL_ROTARY = True

GGUF_TENSOR_NAMES: dict[str, str] = {}
GGUF_PERMUTES_QK = False
GGUF_SPLITS_FUSED_EXPERTS = False
GGUF_SPLITS_KV_B = False
HF_NAME_ALIASES: tuple = ()

# Config keys llama.cpp's converter stores for this family, beyond those every family has.
GGUF_KEYS = DEEPSEEK_STYLE_MOE_KEYS + (
    GGUFKey("head_dim", "attention.key_length", default=HIDDEN_PER_HEAD),
    GGUFKey("norm_topk_prob", "expert_weights_norm", default=True, kind=bool),
)


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    c = DecoderConfig.read(config, source, expert_count=("n_routed_experts", "num_experts"))
    f = c.fields
    # transformers' Glm4MoeConfig defaults: one dense leading layer, one shared expert.
    first_dense = f.int("first_k_dense_replace", default=1)
    moe_inter = f.int("moe_intermediate_size")
    n_shared = f.int("n_shared_experts", default=1)
    return c.spec(
        name, FAMILY,
        moe_layers=tuple(range(first_dense, c.num_layers)),
        moe_intermediate_size=moe_inter,
        n_shared_experts=n_shared,
        shared_intermediate_size=n_shared * moe_inter,
        dense_intermediate_size=f.int("intermediate_size"),
        n_mtp_layers=f.int("num_nextn_predict_layers", default=0),
        # DeepSeek-V3's routing (sigmoid scores, correction bias, group-limited choice).
        routing=Routing(scoring="sigmoid", method="noaux_tc",
                        n_group=f.int("n_group", default=1), topk_group=f.int("topk_group", default=1),
                        normalize=bool(f.get("norm_topk_prob", default=True)),
                        scaling=f.float("routed_scaling_factor", default=1.0)),
    )


def _decoder_layer(p: str, s: ModelSpec, moe: bool) -> Iterator[TensorShape]:
    yield from decoder_norms(p, s.hidden_size)
    qk_norm = s.head_dim if s.config.get("use_qk_norm") else 0
    yield from gqa_attention(f"{p}.self_attn", s, qkv_bias=bool(s.config.get("attention_bias", False)),
                             q_norm=qk_norm, k_norm=qk_norm)
    yield from deepseek_style_mlp(f"{p}.mlp", s, moe, correction_bias=True)


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    yield from embeddings(s.vocab_size, s.hidden_size, s.tie_word_embeddings)
    for i in range(s.num_layers):
        yield from _decoder_layer(f"model.layers.{i}", s, i in s.moe_layers)
    for i in range(s.num_layers, s.num_layers + s.n_mtp_layers):
        # NextN layer: a MoE decoder layer and its extras (llama.cpp keeps the embedding and
        # head copies as nextn.embed_tokens / nextn.shared_head_head; with them the
        # GLM-4.5-Air Q8_0 GGUF comes to the published 109.38 GiB).
        p = f"model.layers.{i}"
        yield from _decoder_layer(p, s, True)
        yield from mtp_layer_extras(p, s)


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    cfg, f = gguf_to_config(metadata, source, tensor_shapes, GGUF_ARCH, GGUF_KEYS)
    head_dim = cfg["head_dim"]
    cfg.update(
        architectures=["Glm4MoeForCausalLM"],
        model_type="glm4_moe",
        # block_count includes the NextN layers; HF's num_hidden_layers does not.
        num_hidden_layers=cfg["num_hidden_layers"] - cfg["num_nextn_predict_layers"],
        partial_rotary_factor=f.int("rope.dimension_count", default=head_dim) / head_dim,
        attention_bias=True,
        # llama.cpp stores no flag for the optional q/k norms; their tensors tell.
        use_qk_norm=bool(tensor_shapes and any(n.endswith("attn_q_norm.weight") for n in tensor_shapes)),
    )
    return cfg


def describe_layers(s: ModelSpec, loading: Loading) -> tuple[Layer, ...]:
    """Grouped-query attention, per-head q/k norm where the config asks, rotary on the first
    partial_rotary_factor (0.5) of each head; DeepSeek-V3's router and shared experts; dense
    first layers."""
    qk_norm = "per_head" if s.config.get("use_qk_norm", False) else None
    rotary = rotation(s, ROPE_THETA_DEFAULT, PARTIAL_ROTARY_DEFAULT)
    rotary = replace(rotary, dim=int(s.head_dim * rotary.params.partial_rotary_factor))
    norms = rms_norms(s, RMS_EPS_DEFAULT)
    return tuple(Layer(grouped_query(s, i, loading, rotary, qk_norm=qk_norm),
                       mixture(s, i, loading, deepseek.router(s), shared=True) if i in s.moe_layers
                       else dense(s, loading),
                       norms)
                 for i in range(s.num_layers))
