"""A Hugging Face text config as llama.cpp's ``{arch}.*`` metadata keys.

This is the inverse of the families' ``config_from_gguf`` (``hybridmoe.backend.models.families``):
what those read, this writes, under the key names llama.cpp's model loaders look up. A
config that llama.cpp's graph for the architecture cannot represent (a routing variant it
hard-codes differently, dense layers where it expects experts, sliding windows it does not
implement) is refused here, before anything is written, rather than converted into a file
that loads and then computes something else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import gguf

from hybridmoe.backend.engine.hf_config import HFConfig, RopeParams
from hybridmoe.backend.errors import UnsupportedModelError
from hybridmoe.backend.models.families import FAMILIES

log = logging.getLogger(__name__)

_USE_GGUF = "Use a GGUF published for this model, or run the checkpoint with the embedded engine."


@dataclass(frozen=True)
class _ArchWriter:
    """The keys one llama.cpp architecture needs beyond the common ones."""

    write: Callable[[_Keys, HFConfig], None]
    # MLA in llama.cpp's absorbed form has one shared "KV head" (see _deepseek2).
    one_kv_head: bool = False


# llama.cpp architecture (a family's GGUF_ARCH) -> its writer, filled in by @_writes below.
_WRITERS: dict[str, _ArchWriter] = {}


def _writes(arch: str, *, one_kv_head: bool = False):
    def register(write: Callable[[_Keys, HFConfig], None]) -> Callable[[_Keys, HFConfig], None]:
        _WRITERS[arch] = _ArchWriter(write, one_kv_head)
        return write

    return register


def convertible_families() -> tuple[ModuleType, ...]:
    """The registry's families this converter writes GGUF metadata for."""
    return tuple(f for f in FAMILIES if f.GGUF_ARCH in _WRITERS)


def _family(name: str, source: str) -> ModuleType:
    for family in convertible_families():
        if family.FAMILY == name:
            return family
    raise UnsupportedModelError(
        f"{source}: converting {name} checkpoints to GGUF is not supported yet "
        f"(supported: {', '.join(sorted(f.FAMILY for f in convertible_families()))}).",
        _USE_GGUF,
    )


def gguf_arch(family: str, source: str) -> str:
    return _family(family, source).GGUF_ARCH


def write_hparams(writer: gguf.GGUFWriter, family: str, config: Mapping[str, Any], n_layers: int,
                  source: str, n_mtp: int = 0) -> None:
    """Write the architecture keys of `config` (a text config) for `family`; `n_mtp` NextN
    layers kept after the `n_layers` decoder layers count as blocks too (glm4moe)."""
    cfg = HFConfig(dict(config), source)
    fam = _family(family, source)
    arch = _WRITERS[fam.GGUF_ARCH]
    w = _Keys(writer, cfg, source, fam, n_mtp)
    w.common(n_layers + n_mtp, head_count_kv=1 if arch.one_kv_head else None)
    arch.write(w, cfg)


class _Keys:
    def __init__(self, writer: gguf.GGUFWriter, cfg: HFConfig, source: str, family: ModuleType, n_mtp: int):
        self.writer = writer
        self.cfg = cfg
        self.source = source
        self.family = family
        self.n_mtp = n_mtp

    def refuse(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.source}: {what}", _USE_GGUF)

    def common(self, n_layers: int, head_count_kv: int | None) -> None:
        c, wr = self.cfg, self.writer
        wr.add_context_length(int(c.require("max_position_embeddings")))
        wr.add_embedding_length(int(c.require("hidden_size")))
        wr.add_block_count(n_layers)
        if c.get("intermediate_size"):
            wr.add_feed_forward_length(int(c.get("intermediate_size")))
        wr.add_head_count(int(c.require("num_attention_heads")))
        wr.add_head_count_kv(head_count_kv or int(c.get("num_key_value_heads") or c.require("num_attention_heads")))
        wr.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", self.family.RMS_EPS_DEFAULT)))
        wr.add_vocab_size(int(c.require("vocab_size")))
        n_experts = c.n_routed_experts()
        wr.add_expert_count(n_experts)
        wr.add_expert_used_count(int(c.require("num_experts_per_tok")))
        self.rope()

    def rope_params(self) -> RopeParams:
        """The config's rotary embedding, with the family's defaults for what it leaves out."""
        return self.cfg.rope(default_theta=self.family.ROPE_THETA_DEFAULT,
                             default_partial=self.family.PARTIAL_ROTARY_DEFAULT)

    def rope(self) -> None:
        rope = self.rope_params()
        wr = self.writer
        wr.add_rope_freq_base(rope.theta)
        if rope.partial_rotary_factor != 1.0 and not self.family.GGUF_PARTIAL_ROTARY:
            raise self.refuse(f"partial rotary embeddings (factor {rope.partial_rotary_factor}) are not "
                              "supported by this converter.")
        if rope.kind == "default":
            return
        factor = float(rope.get("factor", 1.0))
        if rope.kind == "linear":
            wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            wr.add_rope_scaling_factor(factor)
        elif rope.kind == "yarn":
            wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            wr.add_rope_scaling_factor(factor)
            wr.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")))
            if rope.get("beta_fast") is not None:
                wr.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast")))
            if rope.get("beta_slow") is not None:
                wr.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow")))
        else:
            raise self.refuse(f"rope scaling {rope.kind!r} is not supported by this converter.")


@_writes("deepseek2", one_kv_head=True)
def _deepseek2(w: _Keys, c: HFConfig) -> None:
    wr = w.writer
    if int(c.get("moe_layer_freq", 1)) != 1:
        raise w.refuse(f"moe_layer_freq {c.get('moe_layer_freq')} (MoE only every few layers) has no "
                       "llama.cpp deepseek2 equivalent.")
    kv_lora, rope_dim = int(c.require("kv_lora_rank")), int(c.require("qk_rope_head_dim"))
    nope, v = int(c.require("qk_nope_head_dim")), int(c.require("v_head_dim"))
    # MLA in llama.cpp's absorbed form: the one shared "KV head" is the compressed latent
    # plus the rope part; the per-head sizes go to the *_mla keys.
    wr.add_key_length(kv_lora + rope_dim)
    wr.add_value_length(kv_lora)
    wr.add_key_length_mla(nope + rope_dim)
    wr.add_value_length_mla(v)
    wr.add_q_lora_rank(int(c.get("q_lora_rank") or 0))
    wr.add_kv_lora_rank(kv_lora)
    wr.add_rope_dimension_count(rope_dim)
    wr.add_leading_dense_block_count(int(c.get("first_k_dense_replace", 0)))
    wr.add_expert_feed_forward_length(int(c.require("moe_intermediate_size")))
    n_shared = int(c.get("n_shared_experts") or 0)
    if n_shared < 1:
        raise w.refuse("llama.cpp's deepseek2 graph needs shared experts; this model has none.")
    wr.add_expert_shared_count(n_shared)
    wr.add_expert_weights_scale(float(c.get("routed_scaling_factor", 1.0)))
    wr.add_expert_weights_norm(bool(c.get("norm_topk_prob", False)))
    v3 = c.model_type in ("deepseek_v3", "kimi_k2", "kimi_k25")
    scoring = c.get("scoring_func", "sigmoid" if v3 else "softmax")
    if scoring not in ("sigmoid", "softmax"):
        raise w.refuse(f"scoring_func {scoring!r} is not supported.")
    wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if scoring == "sigmoid"
                              else gguf.ExpertGatingFuncType.SOFTMAX)
    n_group, topk_group = int(c.get("n_group", 1)), int(c.get("topk_group", 1))
    # A GGUF has no routing method: a group count > 1 is read as group-limited routing (by
    # llama.cpp and the engine), so it is written only for the routers that limit groups; a
    # V2 with topk_method "greedy" ignores its n_group.
    limits_groups = c.get("topk_method", "noaux_tc" if v3 else "greedy") in ("group_limited_greedy", "noaux_tc")
    if n_group > 1 and limits_groups:
        wr.add_expert_group_count(n_group)
        wr.add_expert_group_used_count(topk_group)
    rope = w.rope_params()
    if rope.kind == "yarn":
        # llama.cpp's deepseek2 graph rebuilds the softmax scale (mscale^2) from this; the
        # 0.1 factor is llama.cpp's convention for the key (it divides it out again).
        wr.add_rope_scaling_yarn_log_mul(0.1 * float(rope.get("mscale_all_dim", 0.0)))


def _qwen_common(w: _Keys, c: HFConfig) -> None:
    wr = w.writer
    if c.get("use_sliding_window", False):
        raise w.refuse("sliding-window attention is not supported by llama.cpp's Qwen MoE graphs.")
    if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1:
        raise w.refuse("dense layers among the MoE layers (mlp_only_layers / decoder_sparse_step) "
                       "have no llama.cpp equivalent for this architecture.")
    wr.add_expert_feed_forward_length(int(c.require("moe_intermediate_size")))
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_rope_dimension_count(head_dim)


@_writes("qwen3moe")
def _qwen3moe(w: _Keys, c: HFConfig) -> None:
    # llama.cpp's qwen3moe graph always renormalises the top-k weights.
    if not c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob false: llama.cpp's qwen3moe graph always normalises the "
                       "top-k expert weights, so the converted model would compute differently.")
    _qwen_common(w, c)


@_writes("qwen2moe")
def _qwen2moe(w: _Keys, c: HFConfig) -> None:
    # ... and its qwen2moe graph never does.
    if c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob true: llama.cpp's qwen2moe graph never normalises the "
                       "top-k expert weights, so the converted model would compute differently.")
    _qwen_common(w, c)
    w.writer.add_expert_shared_feed_forward_length(int(c.require("shared_expert_intermediate_size")))


@_writes("llama")
def _mixtral(w: _Keys, c: HFConfig) -> None:
    wr = w.writer
    if c.get("sliding_window"):
        raise w.refuse("sliding-window attention is not supported by llama.cpp's llama graph.")
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    wr.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)


@_writes("olmoe")
def _olmoe(w: _Keys, c: HFConfig) -> None:
    wr = w.writer
    if c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob true: llama.cpp's olmoe graph never normalises the top-k "
                       "expert weights.")
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    wr.add_rope_dimension_count(hidden // heads)
    if c.get("clip_qkv"):
        wr.add_clamp_kqv(float(c.get("clip_qkv")))


def _head_dim(c: HFConfig) -> int:
    return int(c.get("head_dim") or int(c.require("hidden_size")) // int(c.require("num_attention_heads")))


@_writes("glm4moe")
def _glm4moe(w: _Keys, c: HFConfig) -> None:
    """GLM-4.5 / 4.6: DeepSeek-V3-style routing (sigmoid scores, correction bias, scaled and
    normalised top-k) with one shared expert, the first layers dense, NEOX rotary on part of
    each head (llama.cpp's glm4moe rope type rotates dims i and i + n_rot/2 of the first
    n_rot, which is transformers' rotate-half on the partial slice: no Q/K permutation)."""
    wr = w.writer
    if str(c.get("hidden_act", "silu")) != "silu":
        raise w.refuse(f"hidden_act {c.get('hidden_act')!r}: llama.cpp's glm4moe graph uses SiLU.")
    n_group, topk_group = int(c.get("n_group", 1)), int(c.get("topk_group", 1))
    if n_group > 1 and topk_group < n_group:
        raise w.refuse(f"group-limited routing (n_group {n_group}, topk_group {topk_group}): llama.cpp's "
                       "glm4moe graph picks the top-k experts among all of them.")
    n_shared = int(c.get("n_shared_experts", 1))
    if n_shared < 1:
        raise w.refuse("llama.cpp's glm4moe graph always adds a shared expert; this model has none.")
    head_dim = _head_dim(c)
    partial = w.rope_params().partial_rotary_factor
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_rope_dimension_count(int(head_dim * partial))
    wr.add_leading_dense_block_count(int(c.get("first_k_dense_replace", 1)))
    wr.add_expert_feed_forward_length(int(c.require("moe_intermediate_size")))
    wr.add_expert_shared_count(n_shared)
    wr.add_expert_weights_scale(float(c.get("routed_scaling_factor", 1.0)))
    wr.add_expert_weights_norm(bool(c.get("norm_topk_prob", True)))
    wr.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    # The NextN layers kept as the last blocks (llama.cpp skips them when generating; a
    # checkpoint without them is written with 0, whatever its config announces).
    wr.add_nextn_predict_layers(w.n_mtp)


@_writes("gpt-oss")
def _gpt_oss(w: _Keys, c: HFConfig) -> None:
    """GPT-OSS. llama.cpp builds in what this family does not store: the clamped SwiGLU
    (alpha 1.702, limit 7), softmax over the top-k router logits, sinks, and sliding windows
    on a period of layers (``attention.sliding_window_pattern``, 2 unless written)."""
    wr = w.writer
    alpha, limit = float(c.get("swiglu_alpha", 1.702)), float(c.get("swiglu_limit", 7.0))
    if abs(alpha - 1.702) > 1e-6 or abs(limit - 7.0) > 1e-6:
        raise w.refuse(f"swiglu_alpha {alpha} / swiglu_limit {limit}: llama.cpp's gpt-oss graph has 1.702 and "
                       "7.0 built in.")
    if c.get("tie_word_embeddings", False):
        raise w.refuse("tied embeddings: llama.cpp's gpt-oss graph needs its own output head.")
    head_dim = _head_dim(c)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_rope_dimension_count(head_dim)
    wr.add_expert_feed_forward_length(int(c.require("intermediate_size")))
    n_layers = int(c.require("num_hidden_layers"))
    types = c.get("layer_types")
    if types is None:  # transformers' default: even layers slide
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding):
        wr.add_sliding_window(int(c.require("sliding_window")))
    wr.add_sliding_window_pattern(_swa_period(w, sliding))
    # YaRN: a config with "truncate": false (the published GPT-OSS ones) asks for the ramp
    # between fractional correction dims; ggml always rounds them outwards (floor / ceil), as
    # truncate=true does, and has no key to say otherwise. llama.cpp's own converter writes
    # these models the same way (every published GPT-OSS GGUF runs so): the difference moves
    # the frequencies at the ramp's two ends a little (dims 8..18 of 64 for gpt-oss-20b/120b),
    # so the file is written as llama.cpp runs it, and the engine reads it back alike.
    rope = w.rope_params()
    if rope.kind == "yarn" and rope.get("truncate", True) is False:
        log.warning("%s: YaRN 'truncate: false' is written as llama.cpp computes it (truncated correction "
                    "range); logits differ slightly from transformers'", w.source)


def _swa_period(w: _Keys, sliding: list[bool]) -> int:
    """llama.cpp's sliding_window_pattern p for per-layer sliding flags: layer i slides when
    i % p < p - 1 (p = 0: every layer; 1: none). A layout no period gives is refused."""
    n = len(sliding)
    for period in (0, *range(1, n + 1)):
        if all(s == (period == 0 or i % period < period - 1) for i, s in enumerate(sliding)):
            return period
    raise w.refuse("its sliding-window layers (layer_types) follow no fixed period, which llama.cpp's "
                   "gpt-oss graph cannot represent.")
