"""Memory budgets and reserves (SIZING.md sections 3 and 4)."""

from __future__ import annotations

from backend.hardware.profile import GPU
from backend.models.spec import ModelSpec

GIB = 1 << 30
# CUDA context, cuBLAS workspaces and allocator fragmentation on a card we measured free memory of.
GPU_CONTEXT_RESERVE = 1 * GIB
# Page cache, the OS and the app itself on the host.
HOST_MIN_RESERVE = 4 * GIB
HOST_RESERVE_SHARE = 0.05


def described_gpu_budget(reported_bytes: int) -> int:
    """Usable memory of a card the user describes but does not have: 0.9 × reported − 3 GiB.

    The rule (SIZING.md section 3) already covers context, fragmentation and activations.
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


def gpu_budget(gpu: GPU, described: bool, activations: int) -> int:
    """What may be placed on a card: measured free memory less reserves, or the sizing rule."""
    if described:
        return described_gpu_budget(gpu.total_bytes or 0)
    free = gpu.free_bytes if gpu.free_bytes is not None else (gpu.total_bytes or 0)
    return int(free - GPU_CONTEXT_RESERVE - activations)


def host_reserve(usable_bytes: int | None) -> int:
    """RAM kept for the OS, page cache and the app: 5 % of what is usable, at least 4 GiB."""
    return int(max(HOST_MIN_RESERVE, HOST_RESERVE_SHARE * (usable_bytes or 0)))
