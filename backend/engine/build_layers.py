"""The torch modules of a model's decoder layers, compiled from their descriptions.

A family describes its layers as data (``describe_layers`` in its folder,
``models/layer_description``); this module builds each block from its description:
grouped-query attention (rotary, q/k norm, window, sinks, clipping) or latent attention (its
ranks, interleaved rotary, YaRN's softmax scale), a dense gated MLP, or a mixture of experts
(the router its kind names, the routed experts with their activation and layout, shared
experts and their gate), reading the tensors the description names under the checkpoint's
Hugging Face names. ``Build`` carries what the blocks of one model share while it is built:
where they go (a pipeline stage's device; under tensor parallelism, a card and its share),
the expert placement, the rotary tables, the KV cache groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridmoe.backend.engine import native_experts
from hybridmoe.backend.engine.attention import Attention
from hybridmoe.backend.engine.experts import ExpertActivation, ExpertStore, HostExperts, ResidentExperts
from hybridmoe.backend.engine.host_memory import HostArena
from hybridmoe.backend.engine.kv_cache import CacheGroup, PagedCache, PagedKV, PagedLatent
from hybridmoe.backend.engine.latent_maps import stored_maps
from hybridmoe.backend.engine.layers import GatedMLP, RMSNorm
from hybridmoe.backend.engine.loader import Loader
from hybridmoe.backend.engine.mla import MLAttention
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.engine.rope import Rotary, softmax_scale_multiplier
from hybridmoe.backend.engine.routing import SigmoidGroupedTopK, SoftmaxGroupedGreedy, SoftmaxTopK, TopKSoftmax
from hybridmoe.backend.engine.stats import ExpertRecorder
from hybridmoe.backend.engine.stored_latent import stored_latent
from hybridmoe.backend.engine.tensor_parallel import kv_heads, part
from hybridmoe.backend.errors import UnsupportedModelError
from hybridmoe.backend.formats.weights import WeightSource
from hybridmoe.backend.models.hf_config import HFConfig
from hybridmoe.backend.models.layer_description import (
    Attention as AttentionDescription,
    DenseFeedForward,
    ExpertTensors,
    FeedForward,
    GroupedQueryAttention,
    LatentAttention,
    MixtureOfExperts,
    Norm,
    Rotation,
    Router,
)
from hybridmoe.backend.models.spec import KV_BLOCK_TOKENS, ModelSpec


class Build:
    """What the blocks of one model share while it is built."""

    def __init__(self, spec: ModelSpec, weights: WeightSource, placement: dict[int, tuple[int, ...]],
                 device: torch.device, dtype: torch.dtype, max_context: int, recorder: ExpertRecorder | None,
                 *, sliding_rewind: int = 0, cache_dtype: torch.dtype | None = None):
        # The spec decides the model's sizes (hidden, widths, experts, windows); the layers'
        # descriptions everything else.
        self.spec = spec
        self.config = HFConfig(spec.config)
        self.weights = weights
        self.load = Loader(weights, device, dtype)
        self.placement = placement
        self.device, self.dtype, self.max_context = device, dtype, max_context
        self.cache_dtype = cache_dtype or dtype  # the KV cache's elements (model._cache_dtype)
        self.sliding_rewind = sliding_rewind
        self.recorder = recorder
        self.hidden = spec.hidden_size
        self.norms: Norm | None = None  # the RMSNorms of the layer being built (and, after the last, the final one)
        self.resident_form = "dense"  # or "int8", "int4", "stored": how main-device experts are held (ResidentExperts)
        # Tensor parallelism: (card, cards) while a card's share of a layer is built (else
        # None); `placement` is then that card's experts, `on_cards` those of every card.
        self.card: tuple[int, int] | None = None
        self.on_cards = placement
        self.sequences = 1  # conversations the KV cache is sized for
        self.cache = PagedCache([], max_context)
        self.host_memory = HostArena()  # the CPU's cache tensors, every group's, in huge pages
        self.moe_blocks: list[MoE] = []  # every MoE block built (each card's), in layer order
        self._memo: dict[str, Any] = {}

    def on(self, device: torch.device) -> None:
        """Build what follows (a pipeline stage's layers, the head) on `device`."""
        self.device = device
        self.load.device = device

    def memo(self, key: str, factory: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = factory()
        return self._memo[key]

    def cache_group(self, i: int) -> CacheGroup:
        """The KV cache group of layer i: blocks for `sequences` conversations of the
        context, each as many as ``ModelSpec.kv_tokens`` counts (the planner's figure)."""
        window = self.spec.window_of(i)
        if window is not None and window >= self.max_context:
            window = None  # a window as long as the context never bites
        def make() -> CacheGroup:
            tokens = self.spec.kv_tokens(i, self.max_context, self.sliding_rewind)
            blocks = self.sequences * tokens // KV_BLOCK_TOKENS
            group = CacheGroup(blocks, window, self.sliding_rewind, self.host_memory)
            self.cache.groups.append(group)
            return group
        return self.memo(f"cache/{window}", make)

    @property
    def first_card(self) -> bool:
        """Whether this is the card (or the one device) that adds what must be added once:
        the output projection's bias, the CPU experts, the expert counts."""
        return self.card is None or self.card[0] == 0

    def part(self, count: int, align: int = 1) -> tuple[int, int] | None:
        """This card's range of `count` units under tensor parallelism (None: all of them)."""
        return None if self.card is None else part(count, *self.card, align)

    def mlp(self, prefix: str, intermediate: int, act: str,
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> GatedMLP | None:
        """A dense MLP or shared experts: under tensor parallelism, this card's columns (None
        when it has none)."""
        cols = self.part(intermediate, align=32)
        if cols is not None and cols[0] == cols[1]:
            return None
        return self.load.mlp(prefix, self.hidden, intermediate, act, names, part=cols)

    def norm(self, name: str, dim: int | None = None) -> RMSNorm:
        """An RMSNorm of the layer's kind (``norms``)."""
        return self.load.norm(name, dim or self.hidden, self.norms.eps,
                              round_before_weight=not self.norms.weight_before_rounding)

    def rotary(self, r: Rotation) -> Rotary:
        """The rotary tables, built once per model (and device) and shared by its layers."""
        def make() -> Rotary:
            return Rotary(r.params, r.dim, self.max_context,
                          int(self.config.get("max_position_embeddings", self.max_context)),
                          layout=r.layout, float32_math=r.float32, device=self.device)
        return self.memo(f"rotary/{r.dim}/{r.layout}/{self.device}", make)


def attention(b: Build, i: int, d: AttentionDescription) -> nn.Module:
    """Layer i's attention block as `d` describes it."""
    return _ATTENTION[type(d)](b, i, d)


def feed_forward(b: Build, i: int, d: FeedForward) -> nn.Module:
    """Layer i's feed-forward block as `d` describes it."""
    return _FEED_FORWARD[type(d)](b, i, d)


def _grouped_query(b: Build, i: int, d: GroupedQueryAttention) -> Attention:
    p = f"model.layers.{i}.self_attn"
    h, head_dim = b.hidden, d.head_dim
    heads = b.part(d.heads)
    if heads is None:
        heads, kv = (0, d.heads), (0, d.kv_heads)
    else:
        if d.qk_norm == "whole":
            raise UnsupportedModelError(
                "tensor parallelism: this model normalises q and k over all heads together",
                "Use a pipeline (--parallel pp).")
        kv = kv_heads(heads, d.heads, d.kv_heads)
    rows = (heads[0] * head_dim, heads[1] * head_dim)
    kv_rows = (kv[0] * head_dim, kv[1] * head_dim)
    q = b.load.linear(f"{p}.q_proj", d.heads * head_dim, h, rows=rows)
    k = b.load.linear(f"{p}.k_proj", d.kv_heads * head_dim, h, rows=kv_rows)
    v = b.load.linear(f"{p}.v_proj", d.kv_heads * head_dim, h, rows=kv_rows)
    o = b.load.linear(f"{p}.o_proj", h, d.heads * head_dim, bias=b.load.has(f"{p}.o_proj.bias") and b.first_card,
                      cols=None if b.card is None else rows)
    q_norm = k_norm = None
    if d.qk_norm == "per_head":
        q_norm, k_norm = b.norm(f"{p}.q_norm.weight", head_dim), b.norm(f"{p}.k_norm.weight", head_dim)
    elif d.qk_norm == "whole":
        q_norm = b.norm(f"{p}.q_norm.weight", d.heads * head_dim)
        k_norm = b.norm(f"{p}.k_norm.weight", d.kv_heads * head_dim)
    n_heads, n_kv_heads = heads[1] - heads[0], kv[1] - kv[0]
    cache = PagedKV(b.cache_group(i), n_kv_heads, head_dim, head_dim, b.cache_dtype, b.device)
    return Attention(
        q=q, k=k, v=v, o=o, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
        rotary=b.rotary(d.rotary), cache=cache, q_norm=q_norm, k_norm=k_norm,
        norm_per_head=d.qk_norm == "per_head", clip_qkv=d.clip_qkv,
        sinks=b.load.tensor(f"{p}.sinks", (d.heads,), rows=heads) if d.sinks else None,
    )


def _latent(b: Build, i: int, d: LatentAttention) -> MLAttention:
    h, n_heads, q_lora, kv_lora = b.hidden, d.heads, d.q_lora_rank, d.kv_lora_rank
    nope, rope, v_dim = d.nope_dim, d.rope_dim, d.value_dim
    p = f"model.layers.{i}.self_attn"
    # Under tensor parallelism a card holds its heads' rows of q_b (or q), kv_b and their
    # columns of o; the latent projections, and the latent cache every head reads, whole.
    heads = b.part(n_heads) or (0, n_heads)
    q_rows = (heads[0] * (nope + rope), heads[1] * (nope + rope))
    if q_lora:
        q_proj = None
        q_a = b.load.linear(f"{p}.q_a_proj", q_lora, h)
        q_a_norm = b.norm(f"{p}.q_a_layernorm.weight", q_lora)
        q_b = b.load.linear(f"{p}.q_b_proj", n_heads * (nope + rope), q_lora, rows=q_rows)
    else:
        q_proj = b.load.linear(f"{p}.q_proj", n_heads * (nope + rope), h, rows=q_rows)
        q_a = q_a_norm = q_b = None
    kv_b = f"{p}.kv_b_proj.weight"
    # A GGUF's kv_b is read as stored: split on the CPU (engine/latent_maps.py), whole or split
    # on a GPU (engine/stored_latent.py).
    maps = stored_maps(b.load.weights, kv_b, heads, nope, v_dim, kv_lora, b.device, b.dtype)
    held = None if maps is not None else stored_latent(b.load.weights, kv_b, heads, n_heads, nope, v_dim, kv_lora,
                                                       b.device, b.dtype)
    return MLAttention(
        q_proj=q_proj, q_a=q_a, q_a_norm=q_a_norm, q_b=q_b,
        kv_a=b.load.linear(f"{p}.kv_a_proj_with_mqa", kv_lora + rope, h),
        kv_a_norm=b.norm(f"{p}.kv_a_layernorm.weight", kv_lora),
        kv_b_weight=None if maps is not None or held is not None else b.load.tensor(
            kv_b, (n_heads * (nope + v_dim), kv_lora), rows=(heads[0] * (nope + v_dim), heads[1] * (nope + v_dim))),
        stored_maps=maps, stored_kv_b=held,
        o=b.load.linear(f"{p}.o_proj", h, n_heads * v_dim,
                        cols=None if b.card is None else (heads[0] * v_dim, heads[1] * v_dim)),
        n_heads=heads[1] - heads[0], nope_dim=nope, rope_dim=rope, v_dim=v_dim, kv_lora_rank=kv_lora,
        rotary=b.rotary(d.rotary),
        cache=PagedLatent(b.cache_group(i), kv_lora, rope, b.cache_dtype, b.device),
        # DeepSeek's YaRN (mscale_all_dim) sharpens the softmax too.
        scale=(nope + rope) ** -0.5 * softmax_scale_multiplier(d.rotary.params),
    )


def _dense(b: Build, i: int, d: DenseFeedForward) -> GatedMLP | None:
    return b.mlp(f"model.layers.{i}.mlp", b.spec.dense_intermediate_size, d.activation)


def _mixture(b: Build, i: int, d: MixtureOfExperts) -> MoE:
    """Layer i's MoE block: its shared experts and their gate, its router, its routed experts
    split by the placement."""
    t = d.tensors
    names = [f"model.layers.{i}.{block}" for block in t.blocks]
    p = next((name for name in names if f"{name}.{t.router}.weight" in b.weights), names[0])
    shared = shared_gate = None
    if d.shared is not None:
        shared = b.mlp(f"{p}.{t.shared}", b.spec.shared_intermediate_size, d.shared.activation)
    if d.shared_gate:
        shared_gate = b.load.linear(f"{p}.shared_expert_gate", 1, b.hidden, bias=False)
    router = _router(b, f"{p}.{t.router}", d.router)
    act = ExpertActivation(d.activation, alpha=d.swiglu_alpha, limit=d.swiglu_limit,
                           interleaved=t.gate_up_interleaved)
    main, host = _routed_experts(b, i, p, act, t)
    moe = MoE(i, router, main, host, shared=shared, shared_gate=shared_gate,
              recorder=b.recorder if b.first_card else None, tensors=t)
    b.moe_blocks.append(moe)
    return moe


def _routed_experts(b: Build, i: int, prefix: str, act: ExpertActivation,
                    t: ExpertTensors) -> tuple[ResidentExperts, HostExperts]:
    """Layer i's routed experts split by the placement: (main device, host)."""
    n_experts = b.spec.n_routed_experts
    store = ExpertStore(b.weights, prefix, n_experts, b.hidden, b.spec.moe_intermediate_size, names=t.experts,
                        fused_xw_with_biases=t.fused_xw_with_biases)
    on_main = set(b.placement.get(i, ()))
    on_gpus = set(b.on_cards.get(i, ()))  # on any card (the main device's, without tensor parallelism)
    bad = [e for e in on_gpus if not 0 <= e < n_experts]
    if bad:
        raise ValueError(f"placement for layer {i} names experts {sorted(bad)}; the layer has {n_experts}")
    main = ResidentExperts(store, on_main, b.dtype, b.device, act, form=b.resident_form)
    host_ids = set(range(n_experts)) - on_gpus if b.first_card else set()
    host = HostExperts(store, host_ids, b.dtype, act)
    native_experts.prepare(host)
    return main, host


def _router(b: Build, name: str, r: Router) -> nn.Module:
    """The module of the router's kind, its matrix `name`.weight: in the compute dtype, or
    float32 for the group routers, as their references compute."""
    n = b.spec.n_routed_experts
    if r.kind == "softmax_topk":
        return SoftmaxTopK(b.load.tensor(f"{name}.weight", (n, b.hidden)), r.k, normalize=r.normalize,
                           float32_weights=r.weights_float32)
    if r.kind == "topk_softmax":
        return TopKSoftmax(b.load.tensor(f"{name}.weight", (n, b.hidden)), b.load.tensor(f"{name}.bias", (n,)), r.k)
    weight = b.load.tensor(f"{name}.weight", (n, b.hidden), dtype=torch.float32)
    if r.kind == "sigmoid_group_topk":
        bias = b.load.optional(f"{name}.e_score_correction_bias", (n,), dtype=torch.float32) if r.choice_bias else None
        return SigmoidGroupedTopK(weight, bias, r.k, n_group=r.n_group, topk_group=r.topk_group,
                                  normalize=r.normalize, scaling=r.scaling)
    if r.kind == "softmax_group_greedy":
        return SoftmaxGroupedGreedy(weight, r.k, n_group=r.n_group, topk_group=r.topk_group, normalize=r.normalize,
                                    scaling=r.scaling)
    raise ValueError(f"no router module of kind {r.kind!r}")


_ATTENTION = {GroupedQueryAttention: _grouped_query, LatentAttention: _latent}
_FEED_FORWARD = {DenseFeedForward: _dense, MixtureOfExperts: _mixture}
