"""The speed to expect, beside the bound (docs/sizing.md §6, "Expected speed").

The bound (``estimate.decode_step``) is bytes over theoretical bandwidth at 100 % and a GPU and
a CPU that overlap perfectly. No backend reaches it: held against published runs of llama.cpp
and KTransformers it was 1.8x to 7.3x above the measured speed. The expected figure takes the
same bytes at the rates a backend is known to reach, and says where each rate came from:

* the host's read rate: the engine's own, measured on this machine after a benchmark or a chat
  (``hardware.achieved``); else the read probe (this machine) or the platform's theoretical
  figure times ``PROBE_OF_THEORETICAL`` (a described one), times the share of it the backend's
  decode reaches (``RATES``);
* NUMA: of each socket beyond the first, the backend reads ``extra_socket_share`` locally;
* the CPU's compute: the CPU experts' multiply-adds at ``estimate.cpu_flops`` (cores × an
  assumed 2.5 GHz × the FMA rate of the kernel set it runs × the kernels' share of it), so that a
  step is never faster than the CPU can compute it (several conversations at once);
* the i-quants' unpacking: the engine's kernels unpack an i-quant's weights from codebooks before
  multiplying them, and at a token a step on few cores that, not the reads, sets the experts'
  time: the expert weights over the cores × the rate a core unpacks the format at, measured on
  this machine when ``bench generate`` ran that format, else the documented rate of the native
  kernel set the CPU's features get (``EXPERT_UNPACK_RATES_PER_CORE``: measured for the AVX-512
  and the AVX2 sets; the portable set's scaled from AVX2's by FMA width);
* the GPU: its bytes at ``gpu_share`` of the card's bandwidth;
* the hand-offs: a decode step passes from the GPU to the CPU and back at every MoE layer with
  CPU experts (the router runs on the GPU, the CPU's partial sums go back), ``handoff_s`` each.

The step is the sum of the host's and the GPU's times and the hand-offs: within a layer the
CPU waits for the router and the GPU for the CPU's experts, so the two hardly overlap in a
decode step. Prefill counts the CPU experts' compute (or, streamed, their copy over PCIe)
and, CPU-only, the always-read weights' compute, at the engine's prompt rate measured on this
machine (after ``bench generate`` or a chat with a long enough prompt), else at
``estimate.cpu_flops``; a GPU's own compute is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.backend.hardware.cpu_kernels import (
    KERNEL_SET_NAMES,
    PORTABLE_KERNEL_SET,
    native_kernel_set,
    native_kernel_set_lacks,
)
from hybridmoe.backend.plan.estimate import FLOPS_PER_CYCLE, DecodeEstimate

# A sustained multi-threaded read of host memory (what the read probe measures) reaches about
# this share of the DIMMs' theoretical figure (channels × MT/s × 8 B) on server and desktop
# DDR4/DDR5 platforms alike; the probe's figure itself is used wherever there is one.
PROBE_OF_THEORETICAL = 0.8


@dataclass(frozen=True)
class BackendRates:
    """The shares of the hardware's rates a backend's decode reaches, and their sources."""

    name: str
    host_share: float  # of the read probe: the CPU experts' bytes per token × tokens/s over it
    host_source: str
    extra_socket_share: float  # of each socket beyond the first, what its decode reads locally
    numa_source: str
    gpu_share: float  # of a card's memory bandwidth, over a decode step's GPU reads
    handoff_s: float  # per MoE layer with CPU experts in a decode step: GPU -> CPU -> GPU
    handoff_source: str


RATES = {
    "engine": BackendRates(
        "the engine",
        host_share=0.65,
        host_source="the engine's decode read 0.60-0.69 of the read probe (bench generate and serve, mid-size "
                    "benchmark model, CPU-only, 2-core Xeon VM; docs/sizing.md §6)",
        extra_socket_share=0.5,
        numa_source="assumed until measured on two sockets: a NUMA-aware CPU/GPU runtime (KTransformers, "
                    "DeepSeek-R1 on 2x Xeon Gold 6454S) decoded 1.29x faster on two sockets than on one",
        gpu_share=0.75,
        handoff_s=60e-6,
        handoff_source="a synchronised copy each way of one token's hidden state and the launches around it",
    ),
    "llamacpp": BackendRates(
        "llama.cpp",
        host_share=0.6,
        host_source="0.48 of the theoretical figure (0.8 × 0.6), set with two published llama.cpp runs in view "
                    "(Qwen3-30B-A3B on a Core i9-10900X, gpt-oss-120b on a Ryzen 9 7900: docs/sizing.md §6); on the "
                    "2-core VM, shared, llama.cpp's own decode read 0.04 of the probe in the one run taken",
        extra_socket_share=0.0,
        numa_source="llama.cpp keeps each page where it was first touched and its threads read across sockets "
                    "(no NUMA placement of experts): one socket's bandwidth",
        gpu_share=0.75,
        handoff_s=60e-6,
        handoff_source="a graph split each way between the CUDA and CPU back-ends per layer",
    ),
}


# Expert weights one core of the engine's CPU kernels unpacks per second in a decode step (one
# token), per native kernel set (hardware.cpu_kernels.native_kernel_set: the set a CPU's features
# get), for the formats whose unpacking, not the reads, sets a decode step's experts' time: the
# i-quants below IQ4, whose weights come from codebook grids (8 or 4 values an index, signs and
# scales from further tables). The one place to update them.
# Measured on a 2-core AMD EPYC (Zen 4) VM with the AVX-512 set's byte-plane decode kernels (commit
# 7ab2641) by `python benchmarks/expert_decode_rates.py`: one thread's CPU time per token of a
# layer of 128 experts of 2048 x 768, top 8 (the mid-size benchmark model's shape, random valid
# blocks), the median over the script's calls; the AVX2 set on the same CPU with
# HYBRIDMOE_NATIVE_ISA=avx2. The AVX-512 iq1_s / iq1_m figures predate their byte-plane kernels
# (ad431e0), which an Ice Lake core runs about 1.5x as fast: low until remeasured on Zen 4 (a
# bench run's measured rate replaces them). The AMX set decodes with the AVX-512 set's kernels.
# The portable set has no entry: the AVX2 set's rates scaled by FMA width (documented_unpack_rate).
# The formats with no entry (IQ4_XS, IQ4_NL, the K-quants, Q4_0-Q8_0: a 16-entry table at most)
# unpack fast enough to keep up with the reads on any machine with more than a few cores (IQ4_XS
# 20.1 and Q4_0 26.6 G weights/s a core with AVX-512, measured earlier on a 2-core Xeon VM).
EXPERT_UNPACK_RATES_PER_CORE: dict[str, dict[str, float]] = {
    "avx512": {
        "iq1_s": 17.5e9,
        "iq1_m": 16.9e9,
        "iq2_xxs": 44.0e9,
        "iq2_xs": 32.5e9,
        "iq2_s": 25.5e9,
        "iq3_xxs": 33.3e9,
        "iq3_s": 29.0e9,
    },
    "avx2": {
        "iq1_s": 11.4e9,
        "iq1_m": 10.6e9,
        "iq2_xxs": 15.1e9,
        "iq2_xs": 12.7e9,
        "iq2_s": 11.4e9,
        "iq3_xxs": 12.1e9,
        "iq3_s": 7.9e9,
    },
}
# The set the portable kernels' rates are scaled from: × the portable set's estimate.FLOPS_PER_CYCLE
# over this set's (assumed, not measured: the unpacking goes as the kernels' vector width).
PORTABLE_UNPACK_SCALED_FROM = "avx2"


def unpack_limited(expert_format: str | None) -> bool:
    """Whether the CPU's unpacking of `expert_format`, not the reads, limits the engine's decode of
    its experts (an i-quant below IQ4, on every kernel set): a run of it says nothing of the read
    rate (hardware.achieved keeps none)."""
    return any(expert_format in rates for rates in EXPERT_UNPACK_RATES_PER_CORE.values())


@dataclass(frozen=True)
class ExpertUnpack:
    """The rate at which the CPU unpacks a format's expert weights in a decode step, and how it was obtained."""

    weights_per_s: float  # all cores together
    how: str
    source: str = ""  # in a few words: "iq2_xxs unpacking measured on this machine"


def documented_unpack_rate(expert_format: str | None, features: tuple[str, ...]) -> tuple[float, str, str] | None:
    """The documented rate a core of a CPU with `features` unpacks `expert_format` at, with the
    kernel set it runs (EXPERT_UNPACK_RATES_PER_CORE): (weights/s, how, the set's name in words);
    None for a format that is not unpack-limited."""
    if not unpack_limited(expert_format):
        return None
    kernel_set = native_kernel_set(features)
    words = KERNEL_SET_NAMES[kernel_set]
    if kernel_set in EXPERT_UNPACK_RATES_PER_CORE:
        per_core = EXPERT_UNPACK_RATES_PER_CORE[kernel_set][expert_format]
        how = (f"{per_core / 1e9:.1f} G weights/s a core, the documented rate for {expert_format} with the {words} "
               "kernels")
        if kernel_set == "avx2" and "avx512f" in features:
            lacks = ", ".join(native_kernel_set_lacks("avx512", features))
            how += f" (this CPU has AVX-512 but not {lacks}, which the AVX-512 kernels need)"
        return per_core, how, words
    # The portable kernels: the AVX2 set's rate scaled by the FMA widths (stated, not measured).
    base = KERNEL_SET_NAMES[PORTABLE_UNPACK_SCALED_FROM]
    width, portable = FLOPS_PER_CYCLE[PORTABLE_UNPACK_SCALED_FROM], FLOPS_PER_CYCLE[PORTABLE_KERNEL_SET]
    scale = portable / width
    per_core = EXPERT_UNPACK_RATES_PER_CORE[PORTABLE_UNPACK_SCALED_FROM][expert_format] * scale
    how = (f"{per_core / 1e9:.1f} G weights/s a core, the documented rate for {expert_format} with the {base} "
           f"kernels × {scale:g} for the portable kernels ({portable:g} of {width:g} flops a cycle, "
           "assumed")
    lacks = native_kernel_set_lacks(PORTABLE_UNPACK_SCALED_FROM, features)
    if "avx2" in features and lacks:
        how += f"; this CPU has AVX2 but not {', '.join(lacks)}, which the {base} kernels need"
    return per_core, how + ")", words


def expert_unpack_rate(expert_format: str | None, *, cores: int | None, features: tuple[str, ...],
                       measured: tuple[float, str, str] | None = None) -> ExpertUnpack | None:
    """For a format whose unpacking limits the engine's decode (``unpack_limited``): the cores ×
    the rate a core unpacks at, measured on this machine (``measured``: hardware.achieved's
    lookup_rate) or the documented rate of the native kernel set the CPU's features get
    (``documented_unpack_rate``); else None."""
    documented = documented_unpack_rate(expert_format, features)
    if documented is None or not cores:
        return None
    if measured is not None:
        per_core, where, _ = measured
        how = f"{per_core / 1e9:.1f} G weights/s a core, measured on this machine ({where})"
        source = f"{expert_format} unpacking measured on this machine"
    else:
        per_core, how, words = documented
        source = f"{expert_format} unpacking at its documented rate with the {words} kernels"
    return ExpertUnpack(per_core * cores, f"{expert_format} unpacked at {how} × {cores} cores", source)


@dataclass(frozen=True)
class HostRate:
    """The rate at which a backend's decode reads the CPU experts here, and how it was obtained."""

    bytes_per_s: float
    how: str
    # Where the rate came from in a few words, for a table's note or a status line
    # ("the engine's share of the read probe, measured on this machine").
    source: str = ""


def host_read_rate(
    backend: str,
    *,
    theoretical: float | None,
    measured: float | None,
    sockets: int | None,
    achieved: tuple[float, float | None, str] | None = None,
) -> HostRate | None:
    """The expected read rate of `backend`'s CPU experts: with ``achieved`` (the engine measured
    on this machine: bytes/s, its share of the probe then, where from), that share of this
    process's probe reading, or without one the rate itself; else the probe or the theoretical
    figure at the backend's share (docs/sizing.md §6)."""
    rates = RATES[backend]
    if achieved is not None and backend == "engine":
        rate, share, where = achieved
        if share is not None and measured:
            return HostRate(measured * share, f"{measured * share / 1e9:,.1f} GB/s: the read probe's "
                                              f"{measured / 1e9:,.1f} GB/s × {share:.2f}, the engine's share measured "
                                              f"on this machine ({where})",
                            "the engine's share of the read probe, measured on this machine")
        return HostRate(rate, f"{rate / 1e9:,.1f} GB/s, the engine's decode measured on this machine ({where})",
                        "the engine's read rate, measured on this machine")
    if measured:
        base, base_how = measured, f"the read probe's {measured / 1e9:,.1f} GB/s"
        source = f"the read probe × {rates.name}'s usual share, {rates.host_share:g}"
    elif theoretical:
        base = theoretical * PROBE_OF_THEORETICAL
        base_how = f"{PROBE_OF_THEORETICAL:g} × the theoretical {theoretical / 1e9:,.1f} GB/s"
        source = f"the theoretical bandwidth × {PROBE_OF_THEORETICAL:g} × {rates.name}'s usual share, {rates.host_share:g}"
    else:
        return None
    parts = [base_how]
    if sockets and sockets > 1 and not measured:
        # The theoretical figure counts every socket; the backend reads the others' only partly.
        local = 1 + (sockets - 1) * rates.extra_socket_share
        base = base / sockets * local
        parts.append(f"{local:g} of {sockets} sockets read locally")
    rate = base * rates.host_share
    parts.append(f"× {rates.host_share:g}, {rates.name}'s share")
    return HostRate(rate, f"{rate / 1e9:,.1f} GB/s: " + ", ".join(parts), source)


@dataclass(frozen=True)
class Expected:
    tokens_per_s: float | None
    how: str
    # Where its rates came from in a few words (the screens that show the figure without `how`).
    source: str = ""


def expected_decode(
    bound: DecodeEstimate,
    *,
    backend: str,
    rate: HostRate | None,
    bound_host_bandwidth: float | None,
    host_weights: float,
    users: int,
    cpu_flops_per_s: float | None,
    cpu_moe_layers: int,
    has_gpu: bool,
    expert_unpack: ExpertUnpack | None = None,
    expert_bytes_per_weight: float = 1.0,
) -> Expected:
    """One decode step of `users` conversations at the expected rates (module docstring).

    ``bound`` is the same step's bound (its host and GPU seconds); ``host_weights`` the weights
    the CPU reads per step (each computed once per conversation: 2 × users flops a weight);
    ``cpu_moe_layers`` the MoE layers with experts on the CPU (a hand-off each, with a GPU);
    ``expert_unpack``, for a format whose unpacking limits it, the rate the CPU unpacks the
    step's expert weights at (``bound.host_expert_bytes_per_step`` / ``expert_bytes_per_weight``
    of them, once for all conversations: a super-block is unpacked once for any number of tokens).
    """
    rates = RATES[backend]
    parts, sources = [], []
    t_host = 0.0
    if bound.host_bytes_per_step:
        if rate is None:
            return Expected(None, "unknown: host memory bandwidth not known (measure it, or describe the machine)")
        # The bound's host time at the expected rate (a slow path's extra cost included), or,
        # where the bound has no bandwidth (the engine's rate known, the probe not run), the bytes.
        t_read = (bound.host_seconds * bound_host_bandwidth / rate.bytes_per_s if bound.host_seconds and bound_host_bandwidth
                  else bound.host_bytes_per_step / rate.bytes_per_s)
        unpacking = ""
        if expert_unpack is not None and bound.host_expert_bytes_per_step:
            # The experts take the longer of their reads and their unpacking; the other weights
            # and the cache are read between them, not alongside.
            t_expert_read = bound.host_expert_bytes_per_step / rate.bytes_per_s
            t_unpack = bound.host_expert_bytes_per_step / expert_bytes_per_weight / expert_unpack.weights_per_s
            if t_unpack > t_expert_read:
                t_read += t_unpack - t_expert_read
                unpacking = (f"; the experts' {t_unpack * 1e3:.2f} ms set by their unpacking, "
                             f"{expert_unpack.how}, not by their reads ({t_expert_read * 1e3:.2f} ms)")
                sources.append(expert_unpack.source)
        t_compute = 2 * users * host_weights / cpu_flops_per_s if cpu_flops_per_s else 0.0
        t_host = max(t_read, t_compute)
        sources.insert(0, rate.source if t_read >= t_compute else "the CPU's assumed compute rate")
        if t_compute > t_read:
            parts.append(f"CPU {t_host * 1e3:.2f} ms (compute: {2 * users * host_weights / 1e9:.1f} GFLOP at "
                         f"{cpu_flops_per_s / 1e12:.2f} TFLOP/s; reading at {rate.how}, {t_read * 1e3:.2f} ms{unpacking})")
        else:
            parts.append(f"CPU {t_host * 1e3:.2f} ms (reading at {rate.how}{unpacking})")
    t_gpu = 0.0
    if bound.gpu_seconds:
        reduces = bound.all_reduce_seconds
        t_gpu = (bound.gpu_seconds - reduces) / rates.gpu_share + reduces
        parts.append(f"GPU {t_gpu * 1e3:.2f} ms ({rates.gpu_share:g} of its bandwidth"
                     + (f", all-reduces {reduces * 1e3:.2f} ms" if reduces else "") + ")")
        sources.append(f"the GPUs' bandwidth × {rates.gpu_share:g}")
    if bound.gpu_bytes_per_step and not bound.gpu_seconds:
        parts.append("GPU not counted (its memory bandwidth is not known)")
    t_handoff = cpu_moe_layers * rates.handoff_s if has_gpu and bound.host_bytes_per_step else 0.0
    if t_handoff:
        parts.append(f"hand-offs {t_handoff * 1e3:.2f} ms ({cpu_moe_layers} MoE layers × {rates.handoff_s * 1e6:.0f} us)")
    step = t_host + t_gpu + t_handoff
    if not step:  # everything on cards of unknown bandwidth
        return Expected(None, f"unknown: {rates.name}: " + " + ".join(parts))
    return Expected(1.0 / step, f"{rates.name}: " + " + ".join(parts) + f" = {step * 1e3:.2f} ms a step",
                    "; ".join(sources))


# A prompt shorter than this is timed by the fixed costs of a forward call and by a regime of the
# kernels (few tokens an expert) that the plan's 2,048-token chunk is not in: not kept as the
# engine's prompt rate.
MIN_PROMPT_TOKENS_TO_RECORD = 256


def expected_prefill(
    *,
    tokens: int,
    cpu_expert_weights: float,
    cpu_always_weights: float,
    cpu_flops_per_s: float | None,
    streamed_bytes: float | None,
    pcie_bytes_per_s: float | None,
    measured: tuple[float, str, str] | None = None,
    expert_format: str = "",
) -> Expected:
    """Prompt tokens/s for a chunk of `tokens`: the CPU's multiply-adds over the weights it
    computes per token (``cpu_expert_weights``: the routed experts a token reaches on the CPU;
    ``cpu_always_weights``: CPU-only, the always-read ones), or, when the chunk streams the CPU
    experts to the GPU, their ``streamed_bytes`` over PCIe. A GPU's compute is not counted.

    The CPU's rate: the engine's prompt rate measured on this machine (``measured``:
    hardware.achieved's lookup_rate, flops/s, where from, the formats it was measured on), else
    ``cpu_flops_per_s``, the stated model (estimate.cpu_flops)."""
    if streamed_bytes and pcie_bytes_per_s:  # (none to stream: the other cases below)
        seconds = streamed_bytes / pcie_bytes_per_s
        return Expected(tokens / seconds, f"{tokens}-token chunk: the CPU experts copied to the GPU, "
                                          f"{streamed_bytes / 1e9:.2f} GB at {pcie_bytes_per_s / 1e9:.1f} GB/s over PCIe "
                                          "(the GPU's compute not counted)")
    flops = 2 * tokens * (cpu_expert_weights + cpu_always_weights)
    if not flops:
        return Expected(None, "every weight is on the GPU: the GPU's compute sets it, which the plan does not count")
    if measured is not None:
        rate, where, formats = measured
        other = f"; measured on {formats}, not {expert_format}" if expert_format and formats != expert_format else ""
        source = f"the engine's prompt rate measured on this machine ({where}{other})"
    elif cpu_flops_per_s:
        rate = cpu_flops_per_s
        source = ("cores × an assumed 2.5 GHz × the fp32 FMA rate of its kernel set × 0.5, nothing measured "
                  "on this machine yet")
    else:
        return Expected(None, "unknown: the CPU's core count is not known")
    seconds = flops / rate
    return Expected(tokens / seconds, f"{tokens}-token chunk: {flops / 1e12:.2f} TFLOP on the CPU at "
                                      f"{rate / 1e12:.2f} TFLOP/s, {source} (the GPU's compute not counted)")


# Fewer generated tokens than this time the first steps' warm-up (page faults, caches), not the decode.
MIN_TOKENS_TO_RECORD = 16


def decode_bytes_per_token(plan, stats) -> float | None:
    """The bytes a token of a finished generation (a session.Stats) read under a CPU-only
    `plan`: the plan's, its cache at the generation's middle position rather than the full
    context. None for anything else (llama.cpp, a GPU plan, a short answer, several
    conversations, a format whose unpacking rather than its reads limits it): with the measured
    tokens/s, what hardware.achieved keeps for this machine."""
    if (plan.main_device != "cpu" or stats.backend != "engine" or not stats.decode_tokens_per_s
            or stats.generated_tokens < MIN_TOKENS_TO_RECORD or plan.workload.users != 1
            or unpack_limited(plan.expert_format)):
        return None
    position = min(stats.prompt_tokens + stats.generated_tokens / 2, plan.workload.context)
    per_token = plan.host_bytes_per_token - plan.kv_bytes_per_conversation + plan.kv_bytes_per_token * position
    return per_token if per_token > 0 else None


def prompt_flops_per_s(plan, stats) -> float | None:
    """The CPU's multiply-adds per second in a finished generation's prompt (a session.Stats)
    under a CPU-only `plan`: the plan's flops per prompt token × the measured prompt tokens/s.
    None for anything else (llama.cpp, a GPU plan, several conversations, a prompt shorter than
    MIN_PROMPT_TOKENS_TO_RECORD): what hardware.achieved keeps as the engine's prompt rate."""
    if (plan.main_device != "cpu" or stats.backend != "engine" or not stats.prefill_tokens_per_s
            or stats.prompt_tokens < MIN_PROMPT_TOKENS_TO_RECORD or plan.workload.users != 1
            or not plan.prefill_cpu_flops_per_token):
        return None
    return plan.prefill_cpu_flops_per_token * stats.prefill_tokens_per_s


def remember_rates(plan, stats) -> None:
    """Keep the rates the engine reached on this machine in a finished generation: its decode's
    read rate (``decode_bytes_per_token``) and its prompt's compute rate (``prompt_flops_per_s``;
    hardware.achieved), so that later plans of it expect them."""
    per_token = decode_bytes_per_token(plan, stats)
    flops = prompt_flops_per_s(plan, stats)
    if per_token is None and flops is None:
        return
    from hybridmoe.backend.hardware import achieved, detect, probe_reading

    here = detect(measure_bandwidth=False)
    if per_token is not None:
        # The share of the process's probe reading, where it took one (the TUI does; `run` does not).
        achieved.record(here, bytes_per_token=per_token, tokens_per_s=stats.decode_tokens_per_s,
                        probe_bytes_per_s=probe_reading(),
                        source=f"a chat, {stats.generated_tokens} tokens at {stats.decode_tokens_per_s:.1f} tokens/s")
    if flops is not None:
        achieved.record_rate(here, "prefill_flops_per_s", expert_format=plan.expert_format, value=flops,
                             source=f"a chat's {stats.prompt_tokens}-token prompt at {stats.prefill_tokens_per_s:.1f} "
                                    "tokens/s")
