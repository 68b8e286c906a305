"""DeepSeek-V2/V3/R1 and Kimi K2.x: multi-head latent attention (MLA), a few dense leading
layers, then MoE layers with shared experts.

Kimi K2 is DeepSeek-V3 with 384 experts and 64 heads; Kimi K2.5/K2.6 wrap it with a vision
tower (``KimiK25ForConditionalGeneration``): the language model's config is under
``text_config`` and its tensors under ``language_model.``. GGUF arch ``deepseek2`` covers all
of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.families.common import (
    DEEPSEEK_STYLE_MOE_KEYS,
    DecoderConfig,
    GGUFKey,
    TensorShape,
    decoder_norms,
    deepseek_style_mlp,
    dense,
    embeddings,
    gguf_to_config,
    latent,
    linear,
    mixture,
    mtp_layer_extras,
    norm,
    rms_norms,
    rotation,
)
from hybridmoe.backend.models.hf_config import HFConfig
from hybridmoe.backend.models.layer_description import Layer, Loading, Router
from hybridmoe.backend.models.spec import ModelSpec, Routing

FAMILY = "deepseek"
DISPLAY_NAME = "DeepSeek-V2/V3/R1 and Kimi K2.x"
HF_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "KimiK2ForCausalLM",
)
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")
GGUF_ARCH = "deepseek2"
# llama.cpp's converter drops DeepSeek's MTP layer, so a GGUF estimate leaves it out.
GGUF_KEEPS_MTP = False
# The engine holds (and reads) the routers' matrices in float32, as the reference routes.
ROUTER_FLOAT32 = True
LLAMA_PRE_TOKENIZERS = ("kimi-k2", "deepseek-v3", "qwen2", "llama-bpe")
SPECIAL_TOKEN_ROLES: dict[str, tuple[str, ...]] = {}
RMS_EPS_DEFAULT = 1e-6
ROPE_THETA_DEFAULT = 10000.0
PARTIAL_ROTARY_DEFAULT = 1.0
GGUF_PARTIAL_ROTARY = False

GGUF_TENSOR_NAMES: dict[str, str] = {}
GGUF_PERMUTES_QK = False
# MLA's kv_b_proj is written as attn_k_b (per head [kv_lora, nope]) and attn_v_b ([v, kv_lora]):
# the layout llama.cpp's absorbed attention over the compressed cache requires.
GGUF_SPLITS_FUSED_EXPERTS = False
GGUF_SPLITS_KV_B = True
HF_NAME_ALIASES: tuple = ()

# Config keys llama.cpp's converter stores for this family, beyond those every family has.
GGUF_KEYS = DEEPSEEK_STYLE_MOE_KEYS + (
    GGUFKey("norm_topk_prob", "expert_weights_norm", default=False, kind=bool),
    GGUFKey("n_group", "expert_group_count", default=1),
    GGUFKey("topk_group", "expert_group_used_count", default=1),
    GGUFKey("kv_lora_rank", "attention.kv_lora_rank"),
    GGUFKey("qk_rope_head_dim", "rope.dimension_count"),
    GGUFKey("v_head_dim", ("attention.value_length_mla", "attention.value_length")),  # see config_from_gguf
)


def spec_from_config(config: Mapping[str, Any], name: str, *, source: str = "config.json") -> ModelSpec:
    c = DecoderConfig.read(config, source, expert_count=("n_routed_experts",))
    f = c.fields
    v2 = _is_v2(c.text)
    # transformers' defaults differ between the two configurations: DeepseekV2Config has no
    # dense leading layers and two shared experts, DeepseekV3Config (Kimi K2 too) three
    # dense leading layers and one shared expert.
    first_dense = f.int("first_k_dense_replace", default=0 if v2 else 3)
    freq = f.int("moe_layer_freq", default=1)
    if freq < 1:
        raise ModelError(f"'moe_layer_freq' in {source} must be at least 1, not {freq}.",
                         "Restore the original config.json from the model repository.")
    moe_inter = f.int("moe_intermediate_size")
    n_shared = f.int("n_shared_experts", default=2 if v2 else 1)
    rope, nope = f.int("qk_rope_head_dim"), f.int("qk_nope_head_dim")
    return c.spec(
        name, FAMILY,
        moe_layers=tuple(i for i in range(c.num_layers) if i >= first_dense and i % freq == 0),
        attention="mla",
        head_dim=nope + rope,
        moe_intermediate_size=moe_inter,
        n_shared_experts=n_shared,
        shared_intermediate_size=n_shared * moe_inter,
        dense_intermediate_size=f.int("intermediate_size"),
        kv_lora_rank=f.int("kv_lora_rank"),
        q_lora_rank=f.int("q_lora_rank", default=0) or None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=nope,
        v_head_dim=f.int("v_head_dim"),
        n_mtp_layers=f.int("num_nextn_predict_layers", default=0),
        vision_params=vision_params_estimate(config.get("vision_config") or {}) if c.has_vision else 0,
        routing=_routing(f, v2),
    )


def _is_v2(text: Mapping[str, Any]) -> bool:
    """A DeepSeek-V2 configuration (transformers picks the configuration class by
    model_type); Kimi K2 and everything else here is V3."""
    model_type = text.get("model_type")
    if model_type is None:
        archs = text.get("architectures") or ()
        return "DeepseekV2ForCausalLM" in archs
    return model_type == "deepseek_v2"


def _routing(f, v2: bool) -> Routing:
    """V2 routes by softmax, over all experts ("greedy") or over the topk_group groups with
    the best single expert; V3 by sigmoid scores with a correction bias ("noaux_tc"). An
    explicit scoring_func wins, as in DeepSeek's own code. Defaults are transformers'."""
    scoring = str(f.get("scoring_func", default="softmax" if v2 else "sigmoid"))
    if scoring == "softmax":
        return Routing(scoring="softmax", method=str(f.get("topk_method", default="greedy")),
                       n_group=f.int("n_group", default=1), topk_group=f.int("topk_group", default=1),
                       normalize=bool(f.get("norm_topk_prob", default=False)),
                       scaling=f.float("routed_scaling_factor", default=1.0))
    return Routing(scoring="sigmoid", method=str(f.get("topk_method", default="noaux_tc")),
                   n_group=f.int("n_group", default=8), topk_group=f.int("topk_group", default=4),
                   normalize=bool(f.get("norm_topk_prob", default=True)),
                   scaling=f.float("routed_scaling_factor", default=2.5))


def _mla_attention(prefix: str, s: ModelSpec) -> Iterator[TensorShape]:
    h, heads = s.hidden_size, s.num_attention_heads
    if s.q_lora_rank:
        yield from linear(f"{prefix}.q_a_proj", s.q_lora_rank, h)
        yield norm(f"{prefix}.q_a_layernorm.weight", s.q_lora_rank)
        yield from linear(f"{prefix}.q_b_proj", heads * s.head_dim, s.q_lora_rank)
    else:
        yield from linear(f"{prefix}.q_proj", heads * s.head_dim, h)
    yield from linear(f"{prefix}.kv_a_proj_with_mqa", s.kv_lora_rank + s.qk_rope_head_dim, h)
    yield norm(f"{prefix}.kv_a_layernorm.weight", s.kv_lora_rank)
    yield from linear(f"{prefix}.kv_b_proj", heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank)
    yield from linear(f"{prefix}.o_proj", h, heads * s.v_head_dim, "attn_output")


def _decoder_layer(prefix: str, s: ModelSpec, moe: bool) -> Iterator[TensorShape]:
    yield from decoder_norms(prefix, s.hidden_size)
    yield from _mla_attention(f"{prefix}.self_attn", s)
    # noaux_tc routing keeps a per-expert e_score_correction_bias.
    yield from deepseek_style_mlp(f"{prefix}.mlp", s, moe, correction_bias=s.routing.method == "noaux_tc")


def expected_tensors(s: ModelSpec) -> Iterator[TensorShape]:
    """The tensors of the published checkpoint, MTP layers included (they count as other)."""
    model = "language_model.model" if s.has_vision else "model"
    yield from embeddings(s.vocab_size, s.hidden_size, s.tie_word_embeddings, model)
    for i in range(s.num_layers):
        yield from _decoder_layer(f"{model}.layers.{i}", s, i in s.moe_layers)
    for i in range(s.num_layers, s.num_layers + s.n_mtp_layers):
        # DeepSeek-V3's MTP module: a full MoE decoder layer and its extras.
        p = f"{model}.layers.{i}"
        yield from _decoder_layer(p, s, True)
        yield from mtp_layer_extras(p, s)
    if s.vision_params:
        yield TensorShape("vision_tower.(estimated from vision_config)", (s.vision_params,), "vision")


def vision_params_estimate(vc: Mapping[str, Any]) -> int:
    """Weights of the Kimi K2.5/K2.6 MoonViT tower and patch-merger projector.

    An estimate from ``vision_config`` (ViT blocks with qkv/o and a two-layer MLP, patch and
    position embeddings, the projector); it is under 1 GiB of a 554 GiB checkpoint and only
    counts as "other".
    """
    h = int(vc.get("vt_hidden_size") or 0)
    if not h:
        return 0
    inter = int(vc.get("vt_intermediate_size") or 4 * h)
    layers = int(vc.get("vt_num_hidden_layers") or 0)
    patch = int(vc.get("patch_size") or 14)
    per_layer = 4 * h * h + 2 * h * inter + 4 * h + inter + 5 * h
    pos = int(vc.get("init_pos_emb_height") or 0) * int(vc.get("init_pos_emb_width") or 0) * h
    tower = layers * per_layer + 3 * patch * patch * h + pos + 2 * h
    merge = math.prod(vc.get("merge_kernel_size") or [2, 2])
    mm = int(vc.get("mm_hidden_size") or h) * merge
    text_h = int(vc.get("text_hidden_size") or 0)
    projector = mm * mm + mm + mm * text_h + text_h + 2 * mm
    return tower + projector


# --- GGUF -------------------------------------------------------------------------------


def config_from_gguf(metadata: Mapping[str, Any], *, source: str,
                     tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> dict[str, Any]:
    cfg, f = gguf_to_config(metadata, source, tensor_shapes, GGUF_ARCH, GGUF_KEYS)
    # Recent llama.cpp converts MLA for the absorbed form (attn_k_b/attn_v_b, head_count_kv 1)
    # and keeps the per-head sizes in *_mla keys; older files have them in key/value_length.
    key_len = f.int("attention.key_length_mla", "attention.key_length")
    if f.has("attention.key_length_mla"):
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    # expert_gating_func 2 is sigmoid routing (DeepSeek-V3, Kimi K2); 1 is V2's softmax.
    sigmoid = f.int("expert_gating_func", default=1) == 2
    # A GGUF has no topk_method: experts in groups (expert_group_count > 1, written for V2's
    # n_group) mean V2's group_limited_greedy, as transformers routes it: only the
    # expert_group_used_count groups with the best single expert are eligible (full V2: 8
    # groups, top 3; V2-Lite has one group). llama.cpp limits the choice too, but ranks
    # groups by their best two experts (V3's rule), so a rare token may differ there.
    softmax_method = "group_limited_greedy" if cfg["n_group"] > 1 else "greedy"
    cfg.update(
        architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if sigmoid else "deepseek_v2",
        # block_count includes the MTP layers; HF's num_hidden_layers does not.
        num_hidden_layers=cfg["num_hidden_layers"] - cfg["num_nextn_predict_layers"],
        moe_layer_freq=1,
        q_lora_rank=f.int("attention.q_lora_rank", default=0) or None,
        qk_nope_head_dim=key_len - cfg["qk_rope_head_dim"],
        scoring_func="sigmoid" if sigmoid else "softmax",
        topk_method="noaux_tc" if sigmoid else softmax_method,
    )
    if "rope_scaling" in cfg and f.has("rope.scaling.yarn_log_multiplier"):
        # llama.cpp stores 0.1 * mscale_all_dim as the YaRN log multiplier.
        mscale = f.float("rope.scaling.yarn_log_multiplier") / 0.1
        cfg["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)
    return cfg


def router(s: ModelSpec) -> Router:
    """The router the spec's routing names: V2's softmax (greedy: over one group of all the
    experts; or group-limited), or V3's sigmoid with its correction bias (GLM-4.5 routes the
    same way); matrices in float32."""
    r = s.routing
    if r.scoring == "softmax":
        grouped = r.method == "group_limited_greedy"
        return Router("softmax_group_greedy", s.experts_per_token, normalize=r.normalize,
                      n_group=r.n_group if grouped else 1, topk_group=r.topk_group if grouped else 1,
                      scaling=float(r.scaling))
    return Router("sigmoid_group_topk", s.experts_per_token, normalize=r.normalize, n_group=r.n_group,
                  topk_group=r.topk_group, scaling=float(r.scaling), choice_bias=r.method == "noaux_tc")


def describe_layers(s: ModelSpec, loading: Loading) -> tuple[Layer, ...]:
    """Latent attention, its rotary part interleaved in pairs (``rope_interleave``, true for
    every released checkpoint; V2's reference always, in float32); routed and shared experts;
    dense first layers."""
    v2 = s.routing.scoring == "softmax"
    interleaved = v2 or HFConfig(s.config).get("rope_interleave", True)
    rotary = rotation(s, ROPE_THETA_DEFAULT, PARTIAL_ROTARY_DEFAULT, dim=s.qk_rope_head_dim,
                      layout="pairs" if interleaved else "halves", float32=v2)
    norms = rms_norms(s, RMS_EPS_DEFAULT)
    return tuple(Layer(latent(s, loading, rotary),
                       mixture(s, i, loading, router(s), shared=True) if i in s.moe_layers else dense(s, loading),
                       norms)
                 for i in range(s.num_layers))
