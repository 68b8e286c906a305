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
    sliding_layers_from_types,
)
from hybridmoe.backend.models.formats import get_format
from hybridmoe.backend.models.hf_config import HFConfig
from hybridmoe.backend.models.layer_description import CLAMPED_SWIGLU, ExpertTensors, Layer, Loading, Router
from hybridmoe.backend.models.spec import ModelSpec, Routing

FAMILY = "gpt_oss"
DISPLAY_NAME = "GPT-OSS"
HF_ARCHITECTURES = ("GptOssForCausalLM",)
MODEL_TYPES = ("gpt_oss",)
GGUF_ARCH = "gpt-oss"
GGUF_KEEPS_MTP = False
ROUTER_FLOAT32 = False
LLAMA_PRE_TOKENIZERS = ("gpt-4o",)
# Harmony ends every message with <|end|>, including the reasoning ("analysis") ones the
# answer follows; only <|return|> (the EOS) and <|call|> end the turn, so no EOT is named, and
# <|end|> must not become one.
SPECIAL_TOKEN_ROLES = {"eot": ()}
RMS_EPS_DEFAULT = 1e-5
ROPE_THETA_DEFAULT = 150000.0
PARTIAL_ROTARY_DEFAULT = 1.0
GGUF_PARTIAL_ROTARY = False

# GPT-OSS calls its router `router` and gives it a bias.
GGUF_TENSOR_NAMES = {"ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias"}
GGUF_PERMUTES_QK = False
# The checkpoint's fused experts (gate and up interleaved row by row, with biases; floats for
# x @ W) are written as llama.cpp's ffn_{gate,up,down}_exps and their biases.
GGUF_SPLITS_FUSED_EXPERTS = True
GGUF_SPLITS_KV_B = False
HF_NAME_ALIASES: tuple = ()

# Config keys llama.cpp's converter stores for this family, beyond those every family has.
GGUF_KEYS = (
    GGUFKey("head_dim", "attention.key_length", default=HIDDEN_PER_HEAD),
    GGUFKey("intermediate_size", ("expert_feed_forward_length", "feed_forward_length")),
    GGUFKey("num_local_experts", "expert_count"),
    GGUFKey("sliding_window", "attention.sliding_window", default=None),
    # The clamp of the published models; llama.cpp builds it in rather than storing it.
    GGUFKey("swiglu_limit", "swiglu_limit", default=7.0, kind=float),
)


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    c = DecoderConfig.read(config, source, expert_count=("num_local_experts", "num_experts"),
                           experts_per_token=("num_experts_per_tok", "experts_per_token"))
    # transformers' GptOssConfig defaults: a window of 128, head_dim 64 (not hidden / heads).
    window = c.fields.int("sliding_window", default=128)
    types = c.fields.get("layer_types")
    if isinstance(types, list) and types:
        sliding = sliding_layers_from_types(types)
    else:
        # The published models alternate, starting with a sliding layer (as transformers and
        # llama.cpp assume).
        sliding = tuple(range(0, c.num_layers, 2))
    return c.spec(name, FAMILY, moe_layers=tuple(range(c.num_layers)),
                  head_dim=c.fields.int("head_dim", default=64),
                  moe_intermediate_size=c.fields.int("intermediate_size"),
                  sliding_window=window if sliding else None, sliding_layers=sliding if window else (),
                  routing=Routing(scoring="topk_softmax"))


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    h, e, inter = s.hidden_size, s.n_routed_experts, s.moe_intermediate_size
    yield from embeddings(s.vocab_size, h, s.tie_word_embeddings)
    for i in range(s.num_layers):
        p = f"model.layers.{i}"
        yield from decoder_norms(p, h)
        yield from gqa_attention(f"{p}.self_attn", s, qkv_bias=True, o_bias=True, sinks=True)
        yield TensorShape(f"{p}.mlp.router.weight", (e, h), "router")
        yield TensorShape(f"{p}.mlp.router.bias", (e,), "vector")
        # Fused experts, shapes in [E, out, in] order (the layout of the mxfp4 blocks).
        yield TensorShape(f"{p}.mlp.experts.gate_up_proj", (e, 2 * inter, h))
        yield TensorShape(f"{p}.mlp.experts.gate_up_proj_bias", (e, 2 * inter), "vector")
        yield TensorShape(f"{p}.mlp.experts.down_proj", (e, h, inter), "ffn_down")
        yield TensorShape(f"{p}.mlp.experts.down_proj_bias", (e, h), "vector")


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    cfg, f = gguf_to_config(metadata, source, tensor_shapes, GGUF_ARCH, GGUF_KEYS)
    # llama.cpp's rule: layer i slides when i % p < p - 1, with p the sliding_window_pattern
    # key (newer files) or 2 (the published models alternate, even layers sliding).
    period = f.int("attention.sliding_window_pattern", default=2)
    cfg.update(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        layer_types=["sliding_attention" if period == 0 or i % period < period - 1 else "full_attention"
                     for i in range(cfg["num_hidden_layers"])],
        attention_bias=True,
    )
    return cfg


def describe_layers(s: ModelSpec, loading: Loading) -> tuple[Layer, ...]:
    """Sinks in every layer, windows in the sliding ones; RMSNorm multiplies by its weight
    before rounding; the router ``mlp.router``, with a bias: top k of the biased logits,
    softmax over those; clamped SwiGLU experts (alpha 1.702, limit 7), fused with biases, gate
    and up rows interleaved. Float experts in a safetensors checkpoint are stored for x @ W, a
    layout the native kernels do not read."""
    rotary = rotation(s, ROPE_THETA_DEFAULT, PARTIAL_ROTARY_DEFAULT)
    norms = rms_norms(s, RMS_EPS_DEFAULT, weight_before_rounding=True)
    router = Router("topk_softmax", s.experts_per_token, logit_bias=True, matrix_float32=loading.router_float32)
    transposed = loading.checkpoint == "safetensors" and get_format(s.expert_format).kind == "float"
    why = "float GPT-OSS experts stored as x @ W are not read natively" if transposed else None
    cfg = HFConfig(s.config)
    experts = dict(activation=CLAMPED_SWIGLU, swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                   swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                   tensors=ExpertTensors(router="router", fused_xw_with_biases=True, gate_up_interleaved=True))
    return tuple(Layer(grouped_query(s, i, loading, rotary, sinks=True),
                       mixture(s, i, loading, router, experts_native=why, **experts), norms)
                 for i in range(s.num_layers))
