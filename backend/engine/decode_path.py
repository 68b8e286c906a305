"""Which path decodes each layer (one new token per sequence), and why.

A decoder layer has three executors for that phase on the CPU: the native chain (every layer
in one call, ``native/src/decode_chain.h``), the per-call path (``cpu_decode``: a native call
per step, Python between them) and the PyTorch modules (the reference; on a GPU, with the
Triton kernels). Which one runs is ``decode_plan(layers, machine)``: a pure function of what
each layer's blocks are (the frozen descriptions below, which the built modules return from
``describe()``) and of the machine, so a test can ask it without a model and ``run --json``,
``bench generate`` and the TUI's status line can say which path ran and why
(``DecodePlan.summary``).

A description states the block's architecture and the facts of how it was loaded that the
native kernels depend on (whether its projections are in formats they read, the cache dtype,
where its experts live), nothing of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# The routed experts' activations: SiLU of gate times up ("silu"), or SwiGLU with both halves
# clamped to a limit, a sigmoid slope alpha and up shifted by one (GPT-OSS).
SILU, CLAMPED_SWIGLU = "silu", "clamped_swiglu"

# Cache dtypes the native attention reads (bf16 as its bits).
_NATIVE_CACHE = ("float32", "bfloat16")


@dataclass(frozen=True)
class Router:
    """How a token chooses its experts from the router's logits. kind: "softmax_topk" (softmax,
    top k, optionally renormalised), "sigmoid_group_topk" (sigmoid, groups, a choice bias),
    "topk_softmax" (top k of the biased logits, softmax over those), "softmax_group_greedy"
    (DeepSeek-V2)."""

    kind: str
    k: int
    normalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    choice_bias: bool = False  # a per-expert bias added for the choice only (sigmoid_group_topk)
    logit_bias: bool = False  # a bias added to the logits (topk_softmax)
    matrix_float32: bool = True  # the matrix as the router computes with it


# The routers the native kernels choose with (``decode_ops.h``; the chain's ``ChainRoute``).
NATIVE_ROUTERS = ("softmax_topk", "sigmoid_group_topk", "topk_softmax")


@dataclass(frozen=True)
class GroupedQueryAttention:
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int
    qk_norm: str | None  # "per_head", "whole" (over all heads at once) or None
    window: int | None  # sliding window, None: full attention
    sinks: bool
    clip_qkv: float | None
    projections_native: bool  # q|k|v joined and the output in formats the native kernels read
    cache_dtype: str


@dataclass(frozen=True)
class LatentAttention:
    heads: int
    nope_dim: int
    rope_dim: int
    value_dim: int
    kv_lora_rank: int
    q_lora_rank: int | None  # None: q straight from the hidden state
    absorbed_allowed: bool  # False where the expanded form is forced (``set_mla_absorb(False)``)
    rotary_whole: bool  # the rotary part is the whole rope_dim
    projections_native: bool
    kv_b_native: bool  # kv_b as stored, or in a dtype and layout the absorbed kernels read
    cache_dtype: str


@dataclass(frozen=True)
class DenseFeedForward:
    activation: str  # "silu" or another (the native path multiplies silu(gate) by up)
    projections_native: bool  # gate|up joined and down in formats the native kernels read


@dataclass(frozen=True)
class MixtureOfExperts:
    router: Router
    shared: DenseFeedForward | None
    shared_gate: bool
    shared_gate_native: bool
    experts_on_main: int  # routed experts resident on the main device
    experts_on_host: int
    experts_native: str | None  # why the native kernels cannot read the host experts, None: they can
    streamed: bool  # a scheduler streams them (GPU main device)


Attention = GroupedQueryAttention | LatentAttention
FeedForward = DenseFeedForward | MixtureOfExperts


@dataclass(frozen=True)
class Layer:
    attention: Attention
    ffn: FeedForward


@dataclass(frozen=True)
class Machine:
    """What of the machine and the model's placement decides the path."""

    main_device: str  # "cpu", "cuda:0"
    native_off: str | None  # why the native kernels are not in use, None: they are
    split: str | None  # why layers are not all whole on the main device (stages, cards), None: they are


def attention_covered(a: Attention) -> str | None:
    """None when the native per-call path runs the attention block `a`, else why not."""
    if isinstance(a, LatentAttention):
        if not a.absorbed_allowed:
            return "latent attention's expanded form is forced"
        if not a.projections_native:
            return "projections in a format the native kernels do not read"
        if not a.rotary_whole:
            return "partial rotary in latent attention"
        if not a.kv_b_native:
            return "kv_b in a dtype or layout the absorbed kernels do not read"
        if a.cache_dtype not in _NATIVE_CACHE:
            return f"a {a.cache_dtype} cache"
        return None
    if a.window is not None:
        return "sliding window"
    if a.sinks:
        return "attention sinks"
    if a.clip_qkv is not None:
        return "q/k/v clipping"
    if a.qk_norm == "whole":
        return "q/k norm over all heads"
    if not a.projections_native:
        return "projections in a format the native kernels do not read"
    if a.cache_dtype not in _NATIVE_CACHE:
        return f"a {a.cache_dtype} cache"
    return None


def _dense_covered(f: DenseFeedForward) -> str | None:
    if f.activation != "silu":
        return f"{f.activation} activation"
    if not f.projections_native:
        return "projections in a format the native kernels do not read"
    return None


def ffn_covered(f: FeedForward) -> str | None:
    """None when the native per-call path runs the feed-forward block `f`, else why not."""
    if isinstance(f, DenseFeedForward):
        return _dense_covered(f)
    if f.streamed:
        return "experts streamed to the main device"
    if f.experts_on_main:
        return "experts resident on the main device"
    if not f.experts_on_host:
        return "no experts in host memory"
    if f.router.kind not in NATIVE_ROUTERS:
        return f"the {f.router.kind} router"
    if not f.router.matrix_float32:
        return "a router matrix not in float32"
    if f.shared is not None and (why := _dense_covered(f.shared)) is not None:
        return f"shared experts: {why}"
    if f.shared_gate and not f.shared_gate_native:
        return "a shared-expert gate in a format the native kernels do not read"
    return f.experts_native


def native_covers(layer: Layer) -> str | None:
    """None when the native per-call path runs both blocks of `layer`, else why not."""
    return attention_covered(layer.attention) or ffn_covered(layer.ffn)


def _chain_shape(a: Attention) -> tuple:
    if isinstance(a, LatentAttention):
        return ("latent", a.heads, a.nope_dim, a.rope_dim, a.value_dim, a.kv_lora_rank, a.cache_dtype)
    return ("grouped", a.heads, a.kv_heads, a.head_dim, a.value_dim, a.cache_dtype)


def chain_covers(layers: list[Layer]) -> str | None:
    """None when the native chain runs every layer in one call: each layer natively, one
    attention shape (one cache group: all full attention), the same k in every MoE layer."""
    if not layers:
        return "no layers"
    for i, layer in enumerate(layers):
        if (why := native_covers(layer)) is not None:
            return f"layer {i}: {why}"
    if len({_chain_shape(layer.attention) for layer in layers}) > 1:
        return "the layers' attention shapes differ"
    if len({layer.ffn.router.k for layer in layers if isinstance(layer.ffn, MixtureOfExperts)}) > 1:
        return "the MoE layers choose different numbers of experts"
    return None


@dataclass(frozen=True)
class LayerPath:
    attention: str | None  # None: native; else why the PyTorch module runs it
    ffn: str | None

    def label(self, step: bool) -> str:
        """The executor; `step`: whether the native per-call step runs at all (else every block
        is a PyTorch module's)."""
        if not step or (self.attention is not None and self.ffn is not None):
            return "PyTorch modules"
        if self.attention is not None:
            return "per-call path, attention in PyTorch"
        return "per-call path, feed-forward in PyTorch" if self.ffn is not None else "per-call path"

    def why(self) -> str:
        """Why blocks run in PyTorch ("" when none does)."""
        if self.attention is not None and self.attention == self.ffn:
            return self.attention
        return "; ".join(f"{block}: {why}" for block, why in (("attention", self.attention), ("feed-forward", self.ffn))
                         if why)


@dataclass(frozen=True)
class DecodePlan:
    """The path of each layer for one new token. chain: whether the native chain runs them
    all; else `why_not_chain` and each layer's path."""

    chain: bool
    layers: tuple[LayerPath, ...]
    why_not_chain: str | None

    @property
    def native(self) -> bool:
        """Whether the native decode step runs at all (some block natively)."""
        return any(p.attention is None or p.ffn is None for p in self.layers)

    def _reasons(self) -> str:
        def once(whys) -> str:
            return ", ".join(dict.fromkeys(w for w in whys if w))

        attention, ffn = once(p.attention for p in self.layers), once(p.ffn for p in self.layers)
        if attention == ffn:
            return attention
        return "; ".join(f"{block}: {why}" for block, why in (("attention", attention), ("feed-forward", ffn)) if why)

    def summary(self) -> str:
        """One line: "decode: native chain, all 48 layers", or each run of layers on one path
        and why ("decode: per-call path, attention in PyTorch for layers 0-3: attention: sliding
        window; ...")."""
        n = len(self.layers)
        if self.chain:
            return f"decode: native chain, all {n} layers"
        step = self.native
        if not step:  # no native step at all: every layer's reasons, each once
            return f"decode: PyTorch modules, all {n} layers: {self._reasons()}"
        groups: list[list] = []  # [first, last, label, why]
        for i, path in enumerate(self.layers):
            said = [path.label(step), path.why()]
            if groups and groups[-1][2:] == said:
                groups[-1][1] = i
            else:
                groups.append([i, i, *said])
        parts = []
        for first, last, label, why in groups:
            which = (f"all {n} layers" if len(groups) == 1 else
                     f"layer {first}" if first == last else f"layers {first}-{last}")
            parts.append(f"{label}, {which}" + (f": {why}" if why else "") if len(groups) == 1 else
                         f"{label} for {which}" + (f": {why}" if why else ""))
        said = "; ".join(parts)
        if step and self.why_not_chain:
            said += f"; not the native chain: {self.why_not_chain}"
        return f"decode: {said}"


def decode_plan(layers: list[Layer] | None, machine: Machine, n_layers: int) -> DecodePlan:
    """The path of each of the `n_layers` layers. `layers`: None where the machine alone
    decides (layers split across stages or cards are not described: their blocks are shards)."""
    whole = None
    if machine.main_device != "cpu":
        whole = f"the main device is {machine.main_device}"
    elif machine.native_off is not None:
        whole = machine.native_off
    elif machine.split is not None:
        whole = machine.split
    if whole is not None or layers is None:
        why = whole or "layers not described"
        return DecodePlan(False, tuple(LayerPath(why, why) for _ in range(n_layers)), None)
    paths = tuple(LayerPath(attention_covered(layer.attention), ffn_covered(layer.ffn)) for layer in layers)
    why_not_chain = chain_covers(layers)
    return DecodePlan(why_not_chain is None, paths, why_not_chain)
