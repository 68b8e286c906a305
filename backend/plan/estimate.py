"""Speed bounds (docs/sizing.md §6): every figure here is an upper bound from bytes and bandwidths
(the expected figures beside them: plan.expected)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridmoe.backend.hardware.cpu_kernels import PORTABLE_KERNEL_SET, native_kernel_set

# The rate at which the engine's CPU kernels compute experts in a prefill, for the crossover
# with streaming them to a GPU: cores × an assumed 2.5 GHz (a sustained all-core clock is not
# knowable from here; the plan says so) × the fp32 FMA peak of its native kernel set ×
# the share of it the kernels reach. They multiply dequantized panels in fp32 (or int8 dot
# products), never with AMX tiles or bf16 dot instructions, so those do not count: measured on
# an H200 machine's host (Xeon, 16 cores, AVX-512 and AMX), the CPU experts of a 4K-token
# prefill ran at 1.27-1.30 TFLOP/s, half the 2.56 of its FMA peak at 2.5 GHz. Planned with
# AMX's peak (41 TFLOP/s), the streaming threshold was 5,201 tokens where the measured rates
# put it at 189.
ASSUMED_CPU_HZ = 2.5e9
# By the native kernel set a CPU runs (hardware.cpu_kernels.native_kernel_set), not the widest
# vector ISA it has: a Skylake-X or Cascade Lake has AVX-512 but runs the AVX2 set, whose
# kernels never use 512-bit registers.
FLOPS_PER_CYCLE = {
    "avx512": 64.0,  # two FMA ports × 16 fp32 × 2 flops
    "avx2": 32.0,  # two FMA ports × 8 fp32 × 2 flops
    PORTABLE_KERNEL_SET: 8.0,
}
KERNEL_SHARE_OF_PEAK = 0.5

# One all-reduce of a token's hidden state across the cards of one machine (a few KB: latency,
# not bandwidth). NCCL's small-message all-reduce over PCIe peer-to-peer takes about 10 us; the
# GPU check measures it where there are two cards.
ALL_REDUCE_SECONDS = 10e-6


def tp_all_reduces(num_layers: int) -> int:
    """All-reduces in one decode step under tensor parallelism: after each layer's attention
    and after its MLP (a card sums its heads' and its slice's partial outputs), and one to
    gather the head's slices of the logits."""
    return 2 * num_layers + 1


def experts_touched(n_experts: int, k: int, users: int) -> float:
    """Distinct experts a layer reads when `users` tokens are routed uniformly: E(1 − ((E−k)/E)^u)."""
    return n_experts * (1 - ((n_experts - k) / n_experts) ** users)


def cpu_flops(physical_cores: int | None, features: tuple[str, ...]) -> float | None:
    if not physical_cores:
        return None
    return physical_cores * ASSUMED_CPU_HZ * FLOPS_PER_CYCLE[native_kernel_set(features)] * KERNEL_SHARE_OF_PEAK


def prefill_crossover_tokens(bits_per_weight: float, cpu_flops_per_s: float | None, pcie_bytes_per_s: float | None):
    """Tokens routed to one expert above which copying it to the GPU beats computing it on the CPU.

    Copying costs (bits/8)·P / B_pcie seconds; computing t tokens costs 2·P·t / F_cpu;
    they are equal at t = (bits/8) · F_cpu / (2 · B_pcie).
    """
    if not cpu_flops_per_s or not pcie_bytes_per_s:
        return None
    return (bits_per_weight / 8) * cpu_flops_per_s / (2 * pcie_bytes_per_s)


def prefill_stream_min_tokens(crossover_tokens_per_expert: float | None, n_experts: int, k: int) -> int | None:
    """Prompt tokens per forward call from which the engine streams a layer's CPU experts to the GPU.

    The copy must start before the router has run (layer n+1 is copied while layer n
    computes), so the choice is made on the call's token count T, before routing: T tokens
    route T·k pairs, T·k/E per expert on average, and streaming pays once that reaches the
    per-expert crossover, i.e. from T = crossover · E / k.
    """
    if crossover_tokens_per_expert is None or n_experts < 1 or k < 1:
        return None
    return max(1, math.ceil(crossover_tokens_per_expert * n_experts / k))


@dataclass(frozen=True)
class DecodeEstimate:
    host_bytes_per_step: float
    gpu_bytes_per_step: float
    tokens_per_s_per_user: float | None
    bound_by: str
    # The two paths' times at the bound's rates (the GPU's with its all-reduces), for the
    # expected figure (plan.expected), which takes them at the rates a backend reaches.
    host_seconds: float = 0.0
    gpu_seconds: float = 0.0
    all_reduce_seconds: float = 0.0
    # Of the host bytes, the routed experts' (the rest: always-read weights and cache, CPU-only),
    # whose unpacking, for some formats, the CPU's compute limits rather than the reads.
    host_expert_bytes_per_step: float = 0.0


def decode_step(
    *,
    host_bytes: float,
    host_bandwidth: float | None,
    gpu_bytes_by_card: list[tuple[float, float | None]],
    cards_in_parallel: bool = False,
    all_reduces: int = 0,
    host_slow_bytes: float = 0.0,
    slowdown: float = 1.0,
    host_expert_bytes: float = 0.0,
) -> DecodeEstimate:
    """Time of one decode step: the host path and the GPU path overlap, so the slower bounds.

    GPU cards of a pipeline run one after the other for the same token, so their times add.
    Under tensor parallelism (`cards_in_parallel`) they read their shares at once: the slowest
    card's time, plus `all_reduces` × ALL_REDUCE_SECONDS; the GPU bytes are then per card.
    `host_slow_bytes` of the host bytes take a slow path (models.slow_paths): each costs
    `slowdown` times a byte read at the bandwidth. `host_expert_bytes`: the routed experts' part
    of `host_bytes`, carried for the expected figure (plan.expected).
    """
    host_time_bytes = host_bytes + (slowdown - 1.0) * host_slow_bytes
    t_host = host_time_bytes / host_bandwidth if host_bandwidth and host_bytes else 0.0
    gpu_bytes = sum(b for b, _ in gpu_bytes_by_card)
    if cards_in_parallel:
        gpu_bytes = max((b for b, _ in gpu_bytes_by_card), default=0.0)
    t_gpu = 0.0
    unknown_gpu_bw = False
    for b, bw in gpu_bytes_by_card:
        if bw:
            t_gpu = max(t_gpu, b / bw) if cards_in_parallel else t_gpu + b / bw
        elif b:
            unknown_gpu_bw = True
    reduces = all_reduces * ALL_REDUCE_SECONDS if cards_in_parallel and t_gpu else 0.0
    t_gpu += reduces
    if host_bytes and not host_bandwidth:
        return DecodeEstimate(host_bytes, gpu_bytes, None, "unknown: host memory bandwidth not known",
                              host_expert_bytes_per_step=host_expert_bytes)
    if t_host == 0 and t_gpu == 0:
        return DecodeEstimate(host_bytes, gpu_bytes, None, "unknown: no bandwidth figures",
                              host_expert_bytes_per_step=host_expert_bytes)
    if t_host >= t_gpu:
        bound = ("PyTorch dequantization of CPU experts on the slow path" if host_slow_bytes
                 else "host memory bandwidth (CPU experts)")
        if unknown_gpu_bw:
            bound += "; GPU bandwidth unknown, GPU time not counted"
    else:
        bound = "GPU memory bandwidth"
    return DecodeEstimate(host_bytes, gpu_bytes, 1.0 / max(t_host, t_gpu), bound, t_host, t_gpu, reduces, host_expert_bytes)
