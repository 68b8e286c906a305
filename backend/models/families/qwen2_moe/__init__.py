"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA attention with q/k/v biases, MoE
layers with one wide shared expert whose output is scaled by a sigmoid gate
(``shared_expert_gate``). GGUF arch ``qwen2moe``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from hybridmoe.backend.models.families.common import (
    DecoderConfig,
    GGUFKey,
    TensorShape,
    decoder_norms,
    dense,
    embeddings,
    gguf_to_config,
    gqa_attention,
    grouped_query,
    linear,
    mixture,
    qwen2_sliding_layers,
    rms_norms,
    rotation,
    routed_moe,
    softmax_topk,
    sparse_step_moe_layers,
    swiglu,
)
from hybridmoe.backend.models.layer_description import ExpertTensors, Layer, Loading
from hybridmoe.backend.models.spec import ModelSpec, Routing

FAMILY = "qwen2_moe"
DISPLAY_NAME = "Qwen2-MoE / Qwen1.5-MoE"
HF_ARCHITECTURES = ("Qwen2MoeForCausalLM",)
MODEL_TYPES = ("qwen2_moe",)
GGUF_ARCH = "qwen2moe"
GGUF_KEEPS_MTP = False
ROUTER_FLOAT32 = False
LLAMA_PRE_TOKENIZERS = ("qwen2",)
SPECIAL_TOKEN_ROLES: dict[str, tuple[str, ...]] = {}
RMS_EPS_DEFAULT = 1e-6
ROPE_THETA_DEFAULT = 10000.0
PARTIAL_ROTARY_DEFAULT = 1.0
GGUF_PARTIAL_ROTARY = False

# Qwen2-MoE has one shared expert, named in the singular.
GGUF_TENSOR_NAMES = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
GGUF_PERMUTES_QK = False
GGUF_SPLITS_FUSED_EXPERTS = False
GGUF_SPLITS_KV_B = False
HF_NAME_ALIASES: tuple = ()

# Config keys llama.cpp's converter stores for this family, beyond those every family has.
GGUF_KEYS = (
    GGUFKey("intermediate_size", "feed_forward_length", default=0),
    GGUFKey("moe_intermediate_size", "expert_feed_forward_length"),
    GGUFKey("shared_expert_intermediate_size", "expert_shared_feed_forward_length", default=0),
    GGUFKey("num_experts", "expert_count"),
)


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    # transformers 5 may write num_local_experts where the published configs say num_experts.
    c = DecoderConfig.read(config, source, expert_count=("num_experts", "num_local_experts"))
    f = c.fields
    moe_layers = sparse_step_moe_layers(f, c.num_layers, c.n_routed_experts)
    window, sliding = qwen2_sliding_layers(f, c.num_layers)
    shared = f.int("shared_expert_intermediate_size", default=0)
    return c.spec(
        name, FAMILY,
        moe_layers=moe_layers,
        moe_intermediate_size=f.int("moe_intermediate_size"),
        n_shared_experts=1 if shared else 0,
        shared_intermediate_size=shared,
        dense_intermediate_size=f.int("intermediate_size", default=0),
        sliding_window=window,
        sliding_layers=sliding,
        routing=Routing(normalize=bool(f.get("norm_topk_prob", default=False))),
    )


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    h = s.hidden_size
    yield from embeddings(s.vocab_size, h, s.tie_word_embeddings)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        yield from decoder_norms(p, h)
        yield from gqa_attention(f"{p}.self_attn", s, qkv_bias=bool(s.config.get("qkv_bias", True)))
        if i in s.moe_layers:
            yield from routed_moe(f"{p}.mlp", s)
            if s.shared_intermediate_size:
                yield from swiglu(f"{p}.mlp.shared_expert", h, s.shared_intermediate_size)
                yield from linear(f"{p}.mlp.shared_expert_gate", 1, h)
        else:
            yield from swiglu(f"{p}.mlp", h, s.dense_intermediate_size)


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    cfg, _ = gguf_to_config(metadata, source, tensor_shapes, GGUF_ARCH, GGUF_KEYS)
    # Not stored in the GGUF: llama.cpp's qwen2moe puts experts in every layer and does not
    # renormalise the top-k weights.
    cfg.update(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
               decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False)
    return cfg


def describe_layers(s: ModelSpec, loading: Loading) -> tuple[Layer, ...]:
    """Plain grouped-query attention; a softmax top-k router and a sigmoid-gated shared expert
    (``mlp.shared_expert``, its gate ``mlp.shared_expert_gate``)."""
    rotary, norms = rotation(s, ROPE_THETA_DEFAULT, PARTIAL_ROTARY_DEFAULT), rms_norms(s, RMS_EPS_DEFAULT)
    tensors = ExpertTensors(shared="shared_expert")
    return tuple(Layer(grouped_query(s, i, loading, rotary),
                       mixture(s, i, loading, softmax_topk(s, loading), shared=True, shared_gate=True, tensors=tensors)
                       if i in s.moe_layers else dense(s, loading),
                       norms)
                 for i in range(s.num_layers))
