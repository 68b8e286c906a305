"""Speed estimates (docs/sizing.md §6). Every figure is an upper bound from bytes and bandwidths."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Theoretical per-core throughput for expert matmuls on the CPU, by the best ISA present
# (dense multiply-adds per cycle × 2 flops). A sustained all-core clock is not knowable
# from here, so the prefill crossover assumes 2.5 GHz and says so.
ASSUMED_CPU_HZ = 2.5e9
FLOPS_PER_CYCLE = (
    ("amx_bf16", 1024.0),  # AMX tiles: 16×32 bf16 dot products per cycle
    ("avx512_bf16", 128.0),  # two VDPBF16PS ports × 32 bf16 pairs
    ("avx512f", 64.0),  # two FMA ports × 16 fp32
    ("avx2", 32.0),  # two FMA ports × 8 fp32
)
PORTABLE_FLOPS_PER_CYCLE = 8.0

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
    per_cycle = next((f for name, f in FLOPS_PER_CYCLE if name in features), PORTABLE_FLOPS_PER_CYCLE)
    return physical_cores * ASSUMED_CPU_HZ * per_cycle


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


def decode_step(
    *,
    host_bytes: float,
    host_bandwidth: float | None,
    gpu_bytes_by_card: list[tuple[float, float | None]],
    cards_in_parallel: bool = False,
    all_reduces: int = 0,
) -> DecodeEstimate:
    """Time of one decode step: the host path and the GPU path overlap, so the slower bounds.

    GPU cards of a pipeline run one after the other for the same token, so their times add.
    Under tensor parallelism (`cards_in_parallel`) they read their shares at once: the slowest
    card's time, plus `all_reduces` × ALL_REDUCE_SECONDS; the GPU bytes are then per card.
    """
    t_host = host_bytes / host_bandwidth if host_bandwidth and host_bytes else 0.0
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
    if cards_in_parallel and t_gpu:
        t_gpu += all_reduces * ALL_REDUCE_SECONDS
    if host_bytes and not host_bandwidth:
        return DecodeEstimate(host_bytes, gpu_bytes, None, "unknown: host memory bandwidth not known")
    if t_host == 0 and t_gpu == 0:
        return DecodeEstimate(host_bytes, gpu_bytes, None, "unknown: no bandwidth figures")
    if t_host >= t_gpu:
        bound = "host memory bandwidth (CPU experts)"
        if unknown_gpu_bw:
            bound += "; GPU bandwidth unknown, GPU time not counted"
    else:
        bound = "GPU memory bandwidth"
    return DecodeEstimate(host_bytes, gpu_bytes, 1.0 / max(t_host, t_gpu), bound)
