"""Memory budgets and reserves (docs/sizing.md §3, §4)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridmoe.backend.hardware.profile import GPU
from hybridmoe.backend.models.families import family_by_name
from hybridmoe.backend.models.formats import GGUF_GPU_KERNEL_TYPES, int4_resident_layout
from hybridmoe.backend.models.inventory import TensorInventory
from hybridmoe.backend.models.spec import ModelSpec

GIB = 1 << 30
# CUDA context, cuBLAS workspaces and allocator fragmentation on a card we measured free memory of.
GPU_CONTEXT_RESERVE = 1 * GIB
# Page cache, the OS and the app itself on the host.
HOST_MIN_RESERVE = 4 * GIB
HOST_RESERVE_SHARE = 0.05


def described_gpu_budget(reported_bytes: int) -> int:
    """Usable memory of a card the user describes but does not have: 0.9 × reported − 3 GiB.

    The rule (docs/sizing.md §3) already covers context, fragmentation and activations.
    """
    return int(0.9 * reported_bytes - 3 * GIB)


def activation_bytes(spec: ModelSpec, chunk_tokens: int, bytes_per_element: int = 2) -> int:
    """Scratch memory for one prefill chunk on the main device.

    Per token: about six hidden-sized buffers (residual, normed input, attention output,
    MoE output, two in flight), the q/k/v projections, and the widest MLP's gate and up
    outputs (k routed experts' worth for a MoE layer). Attention scores are not
    materialised (flash / memory-efficient attention). Only the last token's logits are
    kept, in fp32.
    """
    attn_width = spec.num_attention_heads * spec.head_dim * 3
    mlp_width = 2 * max(
        spec.dense_intermediate_size,
        spec.shared_intermediate_size,
        spec.moe_intermediate_size * spec.experts_per_token,
    )
    per_token = bytes_per_element * (6 * spec.hidden_size + attn_width + mlp_width)
    return int(chunk_tokens * per_token + 4 * spec.vocab_size)


def expert_scratch_bytes(spec: ModelSpec) -> int:
    """GPU scratch for one routed expert widened for a matmul: a streamed expert dequantized
    (float32, then the compute dtype) or an int8 expert widened for a prompt's GEMM."""
    return spec.params_per_expert * (4 + 2)


def gpu_budget(gpu: GPU, described: bool, activations: int) -> int:
    """What may be placed on a card: measured free memory less reserves, or the sizing rule."""
    if described:
        return described_gpu_budget(gpu.total_bytes or 0)
    free = gpu.free_bytes if gpu.free_bytes is not None else (gpu.total_bytes or 0)
    return int(free - GPU_CONTEXT_RESERVE - activations)


# ---- llama.cpp's own accounting (a plan made with --backend llamacpp) --------------------

# What llama.cpp leaves free on a card when it chooses the layout: its own layout fitting,
# `--fit`, leaves 1 GiB free by default. Its compute buffers are counted apart.
LLAMACPP_CARD_MARGIN = 1 * GIB
# What a layout given with --n-cpu-moe leaves free: llama.cpp then allocates its buffers without
# fitting, and needs beyond them only the GPU runtime's own context and its BLAS library's
# workspace (CUDA, ROCm/HIP or Vulkan: a few hundred MiB). Without it, the stated layout of a
# published RX 6900 XT run (docs/sizing.md §6), 15.3 GiB of buffers on a 16 GiB card, was
# planned as not fitting.
LLAMACPP_RUNTIME_RESERVE = GIB // 2


def llamacpp_gpu_budget(gpu: GPU, described: bool, *, layout_given: bool = False) -> int:
    """What llama.cpp can place on a card: its memory (free memory, on this machine) less --fit's
    margin, or with the layout given (`layout_given`: --n-cpu-moe) the runtime's reserve. Unlike
    the engine's rule, llama.cpp's compute buffers are counted as such."""
    memory = gpu.total_bytes if described or gpu.free_bytes is None else gpu.free_bytes
    return int((memory or 0) - (LLAMACPP_RUNTIME_RESERVE if layout_given else LLAMACPP_CARD_MARGIN))


def llamacpp_compute_buffer(spec: ModelSpec, n_ubatch: int, offloaded_tensor_bytes: float) -> int:
    """A card's compute buffer in llama.cpp: one micro-batch's activations in float32 (the
    scratch of ``activation_bytes`` at 4 bytes an element) and, where experts stay on the CPU,
    room for the largest expert tensor it copies in to compute a large batch on the GPU
    ("op offload": one of a layer's gate, up or down tensors of all experts, as stored)."""
    return int(activation_bytes(spec, n_ubatch, 4) + offloaded_tensor_bytes)


def host_reserve(usable_bytes: int | None) -> int:
    """RAM kept for the OS, page cache and the app: 5 % of what is usable, at least 4 GiB."""
    return int(max(HOST_MIN_RESERVE, HOST_RESERVE_SHARE * (usable_bytes or 0)))


# ---- routed experts held on a GPU (the engine's ResidentExperts) -----------------------

# How the engine can hold a routed expert on a GPU: dense in the compute dtype, weight-only
# int8 with one scale per output row in the compute dtype, (experts stored in a 4-bit format)
# the stored 4-bit codes with one 16-bit scale, and min where the format has one, per group, or
# (a GGUF whose expert types the GPU kernels read) the file's blocks: ``stored_expert_bytes``.
RESIDENT_FORMS = ("dense", "int8", "int4", "stored")


def compute_dtype_bytes(spec: ModelSpec) -> int:
    """Bytes of one element of the engine's compute dtype for this model: float32 for a float32
    checkpoint (as the engine chooses from the embedding's dtype), else bfloat16."""
    return 4 if spec.other_format in ("f32", "fp32") else 2


@dataclass(frozen=True)
class EngineNumerics:
    """Element sizes of what the engine computes and holds, as ``engine.model`` chooses them."""

    compute: int  # bytes: activations and the tensors widened in host RAM (norms, routers)
    kv: int  # bytes of a KV cache element
    kv_name: str  # "bf16", "fp16" or "fp32" (--kv-dtype's names)
    embedding: int  # bytes of an element of an embedding table widened in host RAM (a GGUF's the
    # kernels read is held as stored: models/tensors._widened)


def engine_numerics(spec: ModelSpec, source: str, cpu_only: bool) -> EngineNumerics:
    """A float32 checkpoint computes and caches in float32; a GGUF run on the CPU alone computes
    in float32 with a float16 cache (model._default_dtype), an embedding table it widens in 16
    bits; the rest in bfloat16."""
    if compute_dtype_bytes(spec) == 4:
        return EngineNumerics(4, 4, "fp32", 4)
    if source == "gguf" and cpu_only:
        return EngineNumerics(4, 2, "fp16", 2)
    return EngineNumerics(2, 2, "bf16", 2)


def router_element_bytes(spec: ModelSpec, compute_bytes: int | None = None) -> int:
    """Bytes of one element of a router's matrix as the engine holds (and reads) it: float32
    for the families that route in float32 (their ``ROUTER_FLOAT32``), else the compute dtype
    (`compute_bytes`, default the checkpoint's: ``compute_dtype_bytes``); GGUF files store
    routers in F32 either way."""
    return 4 if family_by_name(spec.family).ROUTER_FLOAT32 else compute_bytes or compute_dtype_bytes(spec)


def resident_expert_bytes(spec: ModelSpec, form: str) -> int:
    """Bytes one routed expert takes on a GPU in `form`, exactly as the engine holds it:
    gate and up fused [2I, H] and down [H, I], plus per-row scales for int8 (2I + H of them)
    and GPT-OSS' expert biases (2I + H), both in the compute dtype; for int4, half a byte a
    weight and two bytes a group for its scale (and as many for its min)."""
    if form not in RESIDENT_FORMS or form == "stored":
        raise ValueError(f"resident expert form {form!r}; expected one of {RESIDENT_FORMS[:-1]} "
                         "(the stored form's bytes are the file's: stored_expert_bytes)")
    h, i = spec.hidden_size, spec.moe_intermediate_size
    elem = compute_dtype_bytes(spec)
    rows = 2 * i + h
    if form == "int4":
        layout = int4_resident_layout(spec.expert_format)
        if layout is None:
            raise ValueError(f"experts stored as {spec.expert_format} have no int4 form on a GPU")
        group, has_min = layout
        weights, scales = 3 * h * i // 2, 3 * h * i // group * 2 * (2 if has_min else 1)
    else:
        weights = 3 * h * i * (1 if form == "int8" else elem)
        scales = rows * elem if form == "int8" else 0
    biases = rows * elem if spec.family == "gpt_oss" else 0
    return weights + scales + biases


def resident_form_name(spec: ModelSpec, form: str) -> str:
    """What the Plan shows: "int8", "int4", "stored" (llama.cpp: as the file stores them), or the
    compute dtype ("bf16", "f32") for the dense form."""
    if form in ("int8", "int4", "stored"):
        return form
    return "f32" if compute_dtype_bytes(spec) == 4 else "bf16"

def stored_expert_bytes(spec: ModelSpec, inventory: TensorInventory) -> dict[int, float] | None:
    """Bytes one routed expert of each MoE layer takes on a GPU held as the GGUF stores it
    (engine/stored_experts.py): its matrices' blocks as the file has them, and GPT-OSS' expert
    biases (2I + H, whatever the file's float type) in the compute dtype. None where a layer's
    experts are not all block matrices of types the GPU kernels read (a float or safetensors
    checkpoint, a type without a kernel)."""
    h, i = spec.hidden_size, spec.moe_intermediate_size
    biases = 2 * i + h if spec.family == "gpt_oss" else 0
    out = {}
    for layer in spec.moe_layers:
        by_format = inventory.routed_format_bytes_by_layer.get(layer)
        if not by_format:
            return None
        blocks = sum(b for fmt, b in by_format.items() if fmt in GGUF_GPU_KERNEL_TYPES)
        other = (sum(by_format.values()) - blocks) / spec.n_routed_experts
        # Anything but the blocks must be the biases, in a 16- or 32-bit float type.
        if other and other not in (2 * biases, 4 * biases):
            return None
        out[layer] = blocks / spec.n_routed_experts + biases * compute_dtype_bytes(spec)
    return out



# ---- the prefill reserve: one layer's experts streamed in their stored form -------------

# The engine's streaming buffer starts every stored tensor of an expert at a multiple of this
# (hybridmoe.backend.engine.expert_streaming.ALIGN); an expert has at most ten stored tensors (gate, up,
# down, each with its scales, and biases), so a slot needs at most this much beyond its bytes.
STREAM_SLOT_ALIGN = 256
STREAM_SLOT_OVERHEAD = 10 * STREAM_SLOT_ALIGN


def prefill_reserve_bytes(n_experts: int, stored_bytes_per_expert: float) -> int:
    """GPU memory for streaming one MoE layer's experts in their stored form (docs/sizing.md §3)."""
    return int(n_experts * (math.ceil(stored_bytes_per_expert) + STREAM_SLOT_OVERHEAD))
