"""Which executor decodes each layer (one new token per sequence), and why.

A decoder layer has four executors for that phase: on a CPU main device the native chain
(every layer in one call, ``native/src/decode_chain.h``) and the per-call path
(``engine/cpu_decode``: a native call per block, Python between them); on a GPU the CUDA
decode kernels (Triton: ``engine/paged_decode.py`` for attention, ``engine/decode_experts.py``
for the routed experts on the card); and everywhere the PyTorch modules (the reference).
Which one runs is ``decode_plan(layers, machine)``: a pure function of the layers'
descriptions (``models/layer_description``) and of the machine. The planner asks it with the
descriptions a family returns from its config (``planned``: ``plan`` names the path before
anything is loaded); the engine with those its built modules return, and builds what it says.
``native_covers`` and ``cuda_covers`` say for one layer whether the executor runs it and, if
not, why; ``DecodePlan.summary`` is the line ``plan``, ``run --json``, ``bench generate`` and
the TUI's status line show.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.backend.models.layer_description import (
    CLAMPED_SWIGLU,
    SILU,
    Attention,
    DenseFeedForward,
    FeedForward,
    Layer,
    LatentAttention,
    MixtureOfExperts,
)

# Cache dtypes the native attention reads (bf16 as its bits), by torch's names
# (engine/native_attention.py checks a cache against them).
NATIVE_CACHE_DTYPES = ("float32", "bfloat16", "float16")

# The routers the native kernels choose with: the names of the native ``RouteKind``
# (``decode_ops.h``; the chain's ``ChainRoute``), which the chain is handed as they are.
NATIVE_ROUTERS = ("softmax_topk", "sigmoid_group_topk", "topk_softmax")

# What the CUDA decode kernels read: attention heads up to this size (``paged_decode.MAX_HEAD_DIM``),
# latent ranks up to MAX_LATENT, and the routed experts' activations the expert kernels have.
CUDA_MAX_HEAD_DIM = 256
CUDA_MAX_LATENT = 1024
CUDA_ACTIVATIONS = (SILU, CLAMPED_SWIGLU)


@dataclass(frozen=True)
class Machine:
    """What of the machine and the model's placement decides the path."""

    main_device: str  # "cpu", "cuda:0"
    native_off: str | None  # why the native kernels are not in use, None: they are
    split: str | None  # why layers are not all whole on the main device (stages, cards, a scheduler), None: they are
    gpu_kernels_off: str | None = None  # why the CUDA decode kernels are not in use (no Triton, they failed)


def _native_machine(m: Machine) -> str | None:
    """Why the machine alone keeps the native decode step from running at all."""
    if m.main_device != "cpu":
        return f"the main device is {m.main_device}"
    return m.native_off or m.split


def _cuda_machine(m: Machine) -> str | None:
    """Why the machine alone keeps the CUDA decode kernels from running at all."""
    if not m.main_device.startswith("cuda"):
        return f"the main device is {m.main_device}"
    return m.gpu_kernels_off


def attention_covered(a: Attention) -> str | None:
    """None when the native per-call path runs the attention block `a`, else why not."""
    if isinstance(a, LatentAttention):
        if not a.absorbed_allowed:
            return "latent attention's expanded form is forced"
        if not a.projections_native:
            return "projections in a format the native kernels do not read"
        if a.rotary.dim != a.rope_dim:
            return "partial rotary in latent attention"
        if not a.kv_b_native:
            return "kv_b in a dtype or layout the absorbed kernels do not read"
        if a.cache_dtype not in NATIVE_CACHE_DTYPES:
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
    if a.cache_dtype not in NATIVE_CACHE_DTYPES:
        return f"a {a.cache_dtype} cache"
    return None


def _dense_covered(f: DenseFeedForward) -> str | None:
    if f.activation != SILU:
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
    if not f.router.matrix_native:  # the decode step computes the logits with the router's NativeLinear
        return "a router matrix the native kernels do not read"
    if f.shared is not None and (why := _dense_covered(f.shared)) is not None:
        return f"shared experts: {why}"
    if f.shared_gate and not f.shared_gate_native:
        return "a shared-expert gate in a format the native kernels do not read"
    return f.experts_native


def native_covers(layer: Layer, machine: Machine) -> str | None:
    """None when the native per-call path runs both blocks of `layer` on `machine`, else why not."""
    return _native_machine(machine) or attention_covered(layer.attention) or ffn_covered(layer.ffn)


def cuda_attention_covered(a: Attention) -> str | None:
    """None when the CUDA decode kernels run the attention block `a` (``paged_decode``), else why not."""
    if isinstance(a, LatentAttention):
        if not a.absorbed_allowed:
            return "latent attention's expanded form is forced"
        for what, n in (("latent rank", a.kv_lora_rank), ("rotary size", a.rope_dim)):
            if n < 16 or n & (n - 1):
                return f"a {what} of {n} (the kernels' tiles take powers of two from 16)"
        if a.kv_lora_rank > CUDA_MAX_LATENT:
            return f"a latent rank over {CUDA_MAX_LATENT}"
        return None
    if a.window is not None:
        return "sliding window"
    if a.sinks:
        return "attention sinks"
    if max(a.head_dim, a.value_dim) > CUDA_MAX_HEAD_DIM:
        return f"heads over {CUDA_MAX_HEAD_DIM} features"
    return None


def cuda_ffn_covered(f: FeedForward) -> str | None:
    """None when the CUDA decode kernels run the feed-forward block `f`'s experts on the card
    (``decode_experts``; dense and shared MLPs are the projections' kernels, always), else why not."""
    if isinstance(f, MixtureOfExperts) and f.experts_on_main and f.activation not in CUDA_ACTIVATIONS:
        return f"{f.activation} experts"
    return None


def cuda_covers(layer: Layer, machine: Machine) -> str | None:
    """None when the CUDA decode kernels run both blocks of `layer` on `machine`, else why not."""
    return _cuda_machine(machine) or cuda_attention_covered(layer.attention) or cuda_ffn_covered(layer.ffn)


def _chain_shape(a: Attention) -> tuple:
    if isinstance(a, LatentAttention):
        return ("latent", a.heads, a.nope_dim, a.rope_dim, a.value_dim, a.kv_lora_rank, a.cache_dtype)
    return ("grouped", a.heads, a.kv_heads, a.head_dim, a.value_dim, a.cache_dtype)


def chain_covers(layers: list[Layer], machine: Machine) -> str | None:
    """None when the native chain runs every layer in one call: each layer natively, one
    attention shape (one cache group: all full attention), the same k in every MoE layer."""
    if not layers:
        return "no layers"
    if (why := _native_machine(machine)) is not None:
        return why
    for i, layer in enumerate(layers):
        if (why := native_covers(layer, machine)) is not None:
            return f"layer {i}: {why}"
    if len({_chain_shape(layer.attention) for layer in layers}) > 1:
        return "the layers' attention shapes differ"
    if len({layer.ffn.router.k for layer in layers if isinstance(layer.ffn, MixtureOfExperts)}) > 1:
        return "the MoE layers choose different numbers of experts"
    return None


# The executors a decode plan names: the native kernels on a CPU main device, the CUDA kernels
# on a GPU; each with the words its summary uses.
NATIVE, CUDA = "native", "cuda"
_STEP_WORDS = {NATIVE: "per-call path", CUDA: "GPU kernels"}


@dataclass(frozen=True)
class LayerPath:
    attention: str | None  # None: the plan's executor runs it; else why the PyTorch module does
    ffn: str | None

    def label(self, step: bool, executor: str = NATIVE) -> str:
        """The executor; `step`: whether the plan's executor (the native per-call step, the
        CUDA kernels) runs at all (else every block is a PyTorch module's)."""
        if not step or (self.attention is not None and self.ffn is not None):
            return "PyTorch modules"
        words = _STEP_WORDS[executor]
        if self.attention is not None:
            return f"{words}, attention in PyTorch"
        return f"{words}, feed-forward in PyTorch" if self.ffn is not None else words

    def why(self) -> str:
        """Why blocks run in PyTorch ("" when none does)."""
        if self.attention is not None and self.attention == self.ffn:
            return self.attention
        return "; ".join(f"{block}: {why}" for block, why in (("attention", self.attention), ("feed-forward", self.ffn))
                         if why)


@dataclass(frozen=True)
class DecodePlan:
    """The path of each layer for one new token. executor: NATIVE (a CPU main device) or
    CUDA; chain: whether the native chain runs every layer; else `why_not_chain` (NATIVE)
    and each layer's path."""

    chain: bool
    layers: tuple[LayerPath, ...]
    why_not_chain: str | None
    executor: str = NATIVE

    @property
    def native(self) -> bool:
        """Whether the native decode step runs at all (some block natively)."""
        return self.executor == NATIVE and self._step

    @property
    def _step(self) -> bool:
        return any(p.attention is None or p.ffn is None for p in self.layers)

    def _reasons(self) -> str:
        def once(whys) -> str:
            return ", ".join(dict.fromkeys(w for w in whys if w))

        attention, ffn = once(p.attention for p in self.layers), once(p.ffn for p in self.layers)
        if attention == ffn:
            return attention
        return "; ".join(f"{block}: {why}" for block, why in (("attention", attention), ("feed-forward", ffn)) if why)

    def groups(self) -> list[tuple[tuple[int, ...], str, str]]:
        """The layers on each path, in the order the paths first appear: (layers, executor,
        why). GPT-OSS's sliding and full layers alternate: two groups, not one per layer."""
        if self.chain:
            return [(tuple(range(len(self.layers))), "native chain", "")]
        step = self._step
        groups: dict[tuple[str, str], list[int]] = {}
        for i, path in enumerate(self.layers):
            groups.setdefault((path.label(step, self.executor), path.why()), []).append(i)
        return [(tuple(layers), label, why) for (label, why), layers in groups.items()]

    def summary(self) -> str:
        """One line: "decode: native chain, all 48 layers", or the layers on each path and why
        ("decode: per-call path, attention in PyTorch for layers 0-3: attention: sliding
        window; ...")."""
        n = len(self.layers)
        if self.chain:
            return f"decode: native chain, all {n} layers"
        if not self._step:  # no native step or GPU kernel at all: every layer's reasons, each once
            return f"decode: PyTorch modules, all {n} layers: {self._reasons()}"
        groups = self.groups()
        if len(groups) == 1:
            _, label, why = groups[0]
            said = f"{label}, all {n} layers" + (f": {why}" if why else "")
        else:
            said = "; ".join(f"{label} for {_which(layers)}" + (f": {why}" if why else "") for layers, label, why in groups)
        if self.executor == NATIVE and self.why_not_chain:
            said += f"; not the native chain: {self.why_not_chain}"
        return f"decode: {said}"

    def to_dict(self) -> dict:
        """The plan as ``plan --json`` gives it: the line, and the layers on each path."""
        return {"summary": self.summary(), "executor": self.executor, "chain": self.chain,
                "why_not_chain": self.why_not_chain,
                "groups": [{"layers": list(layers), "path": label, "why": why} for layers, label, why in self.groups()]}


def _which(layers: tuple[int, ...]) -> str:
    """Layer indices in words: "layer 3", "layers 0-3", "layers 0, 2, ..., 34" (a stride),
    else runs: "layers 0-3, 8, 10-12"."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    steps = {b - a for a, b in zip(layers, layers[1:])}
    if steps == {1}:
        return f"layers {layers[0]}-{layers[-1]}"
    if len(steps) == 1 and len(layers) > 3:
        return f"layers {layers[0]}, {layers[1]}, ..., {layers[-1]}"
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return "layers " + ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def decode_plan(layers: list[Layer] | None, machine: Machine, n_layers: int) -> DecodePlan:
    """The path of each of the `n_layers` layers. `layers`: None where the machine alone
    decides (layers split across cards are not described: their blocks are shards)."""
    if machine.main_device.startswith("cuda"):
        whole = _cuda_machine(machine) or (None if layers is not None else machine.split or "layers not described")
        if whole is not None:
            return DecodePlan(False, tuple(LayerPath(whole, whole) for _ in range(n_layers)), None, CUDA)
        return DecodePlan(False, tuple(LayerPath(cuda_attention_covered(layer.attention), cuda_ffn_covered(layer.ffn))
                                       for layer in layers), None, CUDA)
    whole = _native_machine(machine)
    if whole is not None or layers is None:
        why = whole or "layers not described"
        return DecodePlan(False, tuple(LayerPath(why, why) for _ in range(n_layers)), None)
    paths = tuple(LayerPath(attention_covered(layer.attention), ffn_covered(layer.ffn)) for layer in layers)
    why_not_chain = chain_covers(layers, machine)
    return DecodePlan(why_not_chain is None, paths, why_not_chain)
