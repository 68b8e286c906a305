"""What a decoder layer is, as frozen data: the one description every executor compiles.

A family folder returns these from its config (``describe_layers(spec, loading)``: before
anything is loaded, so that ``plan`` can name the decode path), and the engine's built
modules return the same from ``describe()`` (what was loaded), so a test holds the two to
each other. ``plan/decode_path.py`` decides from them, and from the machine, which executor
runs each block (the native chain, the per-call native path, the CUDA kernels, the PyTorch
modules).

A description states the block's architecture (what the torch builder, ``engine/build_layers``,
compiles: the kinds of its parts, their settings, where its tensors are) and the facts of how it
is loaded that the executors depend on (whether its projections are in formats the native
kernels read, the cache dtype, where its experts live: ``Loading``), nothing of torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridmoe.backend.models.hf_config import RopeParams

# The routed experts' activations: SiLU of gate times up ("silu"), or SwiGLU with both halves
# clamped to a limit, a sigmoid slope alpha and up shifted by one (GPT-OSS).
SILU, CLAMPED_SWIGLU = "silu", "clamped_swiglu"


@dataclass(frozen=True)
class Norm:
    """A layer's RMSNorms (before its attention and its feed-forward block, and inside them: q/k,
    latent attention's; the model's final norm is its last layer's)."""

    eps: float
    weight_before_rounding: bool = False  # times the weight in float32, then rounded (GPT-OSS); else the other way


@dataclass(frozen=True)
class Rotation:
    """The rotary position embedding of an attention block."""

    params: RopeParams  # the config's rope settings, the family's defaults where it has none
    dim: int  # features of each head rotated (the first ones; partial rotary passes the rest)
    layout: str = "halves"  # "halves" (x[:d/2], x[d/2:]) or "pairs" (x0, x1), (x2, x3)... (DeepSeek)
    float32: bool = False  # rotated in float32, rounded once (DeepSeek-V2's reference)


@dataclass(frozen=True)
class Router:
    """How a token chooses its experts from the router's logits. kind: "softmax_topk" (softmax,
    top k, optionally renormalised), "sigmoid_group_topk" (sigmoid, groups, a choice bias),
    "topk_softmax" (top k of the biased logits, softmax over those), "softmax_group_greedy"
    (DeepSeek-V2: softmax, top k within the topk_group groups with the best single expert;
    over all experts with one group)."""

    kind: str
    k: int
    normalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0
    choice_bias: bool = False  # a per-expert bias added for the choice only (sigmoid_group_topk)
    logit_bias: bool = False  # a bias added to the logits (topk_softmax)
    matrix_float32: bool = True  # the matrix as the router computes with it
    # The native kernels read the matrix (the router's NativeLinear, ``routing._keep_weight``): a
    # CPU main device with the kernels on when it was built, as for the projections.
    matrix_native: bool = True
    weights_float32: bool = False  # the chosen weights kept in float32 (softmax_topk: else rounded to the logits' dtype)


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
    rotary: Rotation
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
    rotary: Rotation  # YaRN's mscale_all_dim in its params also sharpens the softmax
    projections_native: bool
    kv_b_native: bool  # kv_b as stored, or in a dtype and layout the absorbed kernels read
    cache_dtype: str


@dataclass(frozen=True)
class DenseFeedForward:
    activation: str  # "silu" or another (the native path multiplies silu(gate) by up)
    projections_native: bool  # gate|up joined and down in formats the native kernels read


@dataclass(frozen=True)
class ExpertTensors:
    """Where a MoE block's tensors are (model.layers.{i}.{block}.…) and how they are laid out."""

    blocks: tuple[str, ...] = ("mlp",)  # the block's name: the first of these whose router the checkpoint has
    router: str = "gate"
    experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per-expert gate, up, down
    shared: str = "shared_experts"
    fused_xw_with_biases: bool = False  # fused experts carry biases, and as floats are stored for x @ W (GPT-OSS)
    gate_up_interleaved: bool = False  # a fused gate_up alternates gate and up rows (GPT-OSS)


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
    activation: str = SILU  # the routed experts' (SILU or CLAMPED_SWIGLU)
    swiglu_alpha: float = 1.702  # CLAMPED_SWIGLU's sigmoid slope
    swiglu_limit: float = 7.0  # and clamp
    tensors: ExpertTensors = ExpertTensors()


Attention = GroupedQueryAttention | LatentAttention
FeedForward = DenseFeedForward | MixtureOfExperts


@dataclass(frozen=True)
class Layer:
    attention: Attention
    ffn: FeedForward
    norm: Norm


def activation_name(hidden_act: str) -> str:
    """A config's ``hidden_act`` as a description names it ("swish" is SiLU)."""
    return SILU if hidden_act in ("silu", "swish") else hidden_act


@dataclass(frozen=True)
class Loading:
    """How a model is (to be) loaded, as far as its layers' descriptions say: what the plan
    decides before a load, and what the engine did at one. A family's ``describe_layers``
    reads it for the facts its config cannot give."""

    main_device: str  # "cpu", "cuda:0"
    context: int  # tokens a conversation may reach (a sliding window as long never bites)
    checkpoint: str  # "safetensors" or "gguf"
    cache_dtype: str  # the KV cache's: "bfloat16", "float32", "float16" (a GGUF on the CPU)
    projections_native: bool  # the always-read projections in forms the native kernels read
    experts_on_main: Mapping[int, int] = field(default_factory=dict)  # MoE layer -> experts on the main device
    experts_native: Mapping[int, str] = field(default_factory=dict)  # MoE layer -> why its host experts are not read natively
    streamed: bool = False  # a scheduler streams the host experts (a GPU main device)

    @property
    def router_float32(self) -> bool:
        """Whether a router computes with its matrix in float32: always on the CPU (it is
        widened there), on a GPU in the compute dtype."""
        return self.main_device == "cpu" or self.cache_dtype == "float32"
