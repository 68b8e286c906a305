"""Machines the user does not have (yet): presets, TOML descriptions, explicit numbers.

Sizing before purchase needs a ``HardwareProfile`` for a machine that cannot be detected.
GPU memory is given as the driver reports it (``nvidia-smi``), because that, not the
marketing figure, is what the planner budgets from (docs/sizing.md §3): an RTX PRO 6000 "96 GB"
shows 97,887 MiB, an H200 NVL "141 GB" 140.4 GiB.

A description file looks like this (every key but ``[host] ram`` is optional; a GPU model
from ``GPU_MODELS`` supplies memory, bandwidth and link facts; a flat file may instead give
the same facts at the top level, under the names of ``FLAT_KEYS``: ``gpu_count = 4``,
``ram = "768GiB"``, as the README's example does)::

    name = "lab box"
    [gpu]
    model = "RTX PRO 6000"   # or one name per card: ["RTX 5090", "RTX 4090"]
    count = 4
    memory = "97887MiB"      # per card, as the driver reports it
    bandwidth = "1792GB/s"   # per card
    [host]
    ram = "768GiB"
    bandwidth = "1229GB/s"   # else channels × mts × 8 B, else derived from cpu + sockets
    channels = 24            # populated memory channels, all sockets together
    mts = 6400               # the DIMMs' transfer rate
    cpu = "AMD EPYC 9355 32-Core Processor"
    cores = 64               # physical cores, all sockets together
    threads = 128
    sockets = 2
    l3 = "512MiB"
    features = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
                "avx512_vnni", "avx512_bf16", "avx512vbmi", "avx512_bitalg", "gfni"]
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hybridmoe.backend.errors import HardwareDescriptionError
from hybridmoe.backend.hardware.memory import theoretical_host_bandwidth
from hybridmoe.backend.hardware.profile import CPU, GPU, HardwareProfile, Memory, NumaNode
from hybridmoe.backend.units import GiB, MiB, UnitError, fmt_bytes, fmt_rate, parse_bytes, parse_rate

__all__ = ["GPUModel", "GPU_MODELS", "FLAT_KEYS", "preset", "preset_names", "describe", "load_described"]


@dataclass(frozen=True)
class GPUModel:
    """A card as the driver reports it, for describing machines by model name alone."""

    name: str
    memory_bytes: int  # what nvidia-smi / NVML report as total
    memory_bandwidth_bytes_per_s: float
    compute_capability: tuple[int, int]
    pcie_generation: int
    pcie_width: int
    nvlink_links: int | None  # None: depends on the bridges or baseboard installed
    aliases: tuple[str, ...] = ()
    # "amd": driven by llama.cpp's ROCm (HIP) or Vulkan build, not by the embedded engine, whose
    # GPU path is CUDA's; compute_capability is then the gfx version.
    vendor: str = "nvidia"


# The first alias is the short name shown to users; matching ignores case and punctuation.
GPU_MODELS: tuple[GPUModel, ...] = (
    GPUModel("NVIDIA RTX PRO 6000 Blackwell", 97_887 * MiB, 1.792e12, (12, 0), 5, 16, 0,
             ("RTX PRO 6000", "RTX PRO 6000 Blackwell", "RTX PRO 6000 Workstation", "RTX PRO 6000 Blackwell Workstation Edition",
              "RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000 Blackwell Max-Q Workstation Edition")),
    GPUModel("NVIDIA H200 NVL", 143_771 * MiB, 4.8e12, (9, 0), 5, 16, None, ("H200 NVL",)),
    GPUModel("NVIDIA H200", 143_771 * MiB, 4.8e12, (9, 0), 5, 16, 18, ("H200", "H200 SXM")),
    GPUModel("NVIDIA H100 NVL", 95_830 * MiB, 3.9e12, (9, 0), 5, 16, None, ("H100 NVL",)),
    GPUModel("NVIDIA H100 80GB HBM3", 81_559 * MiB, 3.35e12, (9, 0), 5, 16, 18, ("H100", "H100 SXM")),
    GPUModel("NVIDIA A100-SXM4-80GB", 81_920 * MiB, 2.039e12, (8, 0), 4, 16, 12, ("A100 80GB", "A100 SXM4 80GB")),
    GPUModel("NVIDIA L40S", 46_068 * MiB, 864e9, (8, 9), 4, 16, 0, ("L40S",)),
    GPUModel("NVIDIA RTX 6000 Ada Generation", 49_140 * MiB, 960e9, (8, 9), 4, 16, 0, ("RTX 6000 Ada",)),
    GPUModel("NVIDIA H100 PCIe", 81_559 * MiB, 2.0e12, (9, 0), 5, 16, None, ("H100 PCIe",)),
    GPUModel("NVIDIA A100 80GB PCIe", 81_920 * MiB, 1.935e12, (8, 0), 4, 16, None, ("A100 PCIe", "A100 80GB PCIe")),
    GPUModel("NVIDIA RTX A6000", 49_140 * MiB, 768e9, (8, 6), 4, 16, None, ("A6000", "RTX A6000")),
    GPUModel("NVIDIA GeForce RTX 5090", 32_607 * MiB, 1.792e12, (12, 0), 5, 16, 0, ("RTX 5090",)),
    GPUModel("NVIDIA GeForce RTX 5080", 16_303 * MiB, 960e9, (12, 0), 5, 16, 0, ("RTX 5080",)),
    GPUModel("NVIDIA GeForce RTX 4090", 24_564 * MiB, 1.008e12, (8, 9), 4, 16, 0, ("RTX 4090",)),
    GPUModel("NVIDIA GeForce RTX 4090 D", 24_564 * MiB, 1.008e12, (8, 9), 4, 16, 0, ("RTX 4090D", "RTX 4090 D")),
    GPUModel("NVIDIA GeForce RTX 4080", 16_376 * MiB, 716.8e9, (8, 9), 4, 16, 0, ("RTX 4080", "RTX 4080 SUPER")),
    GPUModel("NVIDIA GeForce RTX 3090 Ti", 24_564 * MiB, 1.008e12, (8, 6), 4, 16, None, ("RTX 3090 Ti",)),
    GPUModel("NVIDIA GeForce RTX 3090", 24_576 * MiB, 936e9, (8, 6), 4, 16, None, ("RTX 3090",)),
    GPUModel("NVIDIA GeForce RTX 2080", 8_192 * MiB, 448e9, (7, 5), 3, 16, None, ("RTX 2080",)),
    # AMD cards as ROCm reports them (rocm-smi's "VRAM Total Memory"): the card's memory less the
    # 16 MiB the driver keeps, 17,163,091,968 B for a 16 GB RX 6900 XT.
    GPUModel("AMD Radeon RX 7900 XTX", 24_560 * MiB, 960e9, (11, 0), 4, 16, None, ("RX 7900 XTX",), vendor="amd"),
    GPUModel("AMD Radeon RX 7900 XT", 20_464 * MiB, 800e9, (11, 0), 4, 16, None, ("RX 7900 XT",), vendor="amd"),
    GPUModel("AMD Radeon RX 9070 XT", 16_368 * MiB, 644.6e9, (12, 0), 5, 16, None, ("RX 9070 XT",), vendor="amd"),
    GPUModel("AMD Radeon RX 6900 XT", 16_368 * MiB, 512e9, (10, 3), 4, 16, None, ("RX 6900 XT",), vendor="amd"),
    GPUModel("AMD Radeon RX 6800 XT", 16_368 * MiB, 512e9, (10, 3), 4, 16, None, ("RX 6800 XT",), vendor="amd"),
    GPUModel("AMD Radeon PRO W7900", 49_136 * MiB, 864e9, (11, 0), 4, 16, None, ("Radeon PRO W7900", "W7900"),
             vendor="amd"),
)

# The host a card's preset (``--hardware "RTX 4090"``, ``"2x RTX 3090"``) is given: a desktop for
# the GeForce cards, a workstation for the others. Real hosts differ: --ram, --host-bandwidth and
# --cores change these, and a TOML description says everything.
# The flags past AVX-512 VNNI/BF16 that the native AVX-512 kernel set also needs
# (cpu_kernels.NATIVE_KERNEL_SETS), which Zen 4 and Zen 5 have: listed last, so that the
# hardware screen's first line of features stays as it was.
_ZEN4_5_KERNEL_FLAGS = ("f16c", "avx512dq", "avx512vbmi", "avx512_bitalg", "gfni")
_DESKTOP_HOST: dict[str, Any] = {
    "cpu_model": "AMD Ryzen 9 9950X 16-Core Processor", "sockets": 1, "cores": 16, "threads": 32,
    "l3": 64 * MiB, "host_ram": 96 * GiB, "features": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                         "avx512_vnni", "avx512_bf16", *_ZEN4_5_KERNEL_FLAGS),
}
_WORKSTATION_HOST: dict[str, Any] = {
    "cpu_model": "AMD Ryzen Threadripper PRO 7975WX 32-Cores", "sockets": 1, "cores": 32, "threads": 64,
    "l3": 128 * MiB, "host_ram": 512 * GiB, "features": ("avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                          "avx512_vnni", "avx512_bf16", *_ZEN4_5_KERNEL_FLAGS),
}


def _normalize(name: str) -> str:
    """'NVIDIA RTX-PRO 6000' and 'rtx pro 6000' are the same card; '8×' is '8x'."""
    name = name.lower().replace("×", "x")
    name = re.sub(r"^(nvidia\s+(geforce\s+)?|amd\s+(radeon\s+)?)", "", name.strip())
    return re.sub(r"[^a-z0-9]", "", name)


def _vendor_of(name: str | None) -> str:
    """A card not in GPU_MODELS, by its name: an AMD one ("AMD Radeon ...", "Radeon PRO ...",
    "Instinct MI...") or, as any other name, NVIDIA's."""
    return "amd" if name and re.search(r"\b(amd|radeon|instinct)\b", name, re.IGNORECASE) else "nvidia"


def _find_gpu_model(name: str) -> GPUModel | None:
    wanted = _normalize(name)
    for model in GPU_MODELS:
        if wanted in {_normalize(model.name), *(_normalize(a) for a in model.aliases)}:
            return model
    return None


# --- presets ----------------------------------------------------------------------------------

# Zen 5 (EPYC 9005) ISA as /proc/cpuinfo names it.
_ZEN5_FEATURES = ("avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                  *_ZEN4_5_KERNEL_FLAGS)

# A plausible host for these GPUs: two EPYC 9355 (32 cores each, 8 × 32 MiB L3 each) with
# all 24 channels populated; the bandwidth follows from the platform table (1,228.8 GB/s).
_EPYC_9355_HOST: dict[str, Any] = {
    "cpu_model": "AMD EPYC 9355 32-Core Processor",
    "sockets": 2,
    "cores": 64,
    "threads": 128,
    "l3": 512 * MiB,
    "features": _ZEN5_FEATURES,
}

# 1.5 TiB = 24 × 64 GiB DIMMs for 8-GPU boxes; 768 GiB = 24 × 32 GiB (one DIMM per channel,
# the full-bandwidth minimum) for the others.
_PRESETS: dict[str, dict[str, Any]] = {
    "4x RTX PRO 6000": {"gpu_model": "RTX PRO 6000", "gpu_count": 4, "host_ram": 768 * GiB, **_EPYC_9355_HOST},
    "8x RTX PRO 6000": {"gpu_model": "RTX PRO 6000", "gpu_count": 8, "host_ram": 1536 * GiB, **_EPYC_9355_HOST},
    "4x H200 NVL": {"gpu_model": "H200 NVL", "gpu_count": 4, "host_ram": 768 * GiB, **_EPYC_9355_HOST},
    "8x H200 NVL": {"gpu_model": "H200 NVL", "gpu_count": 8, "host_ram": 1536 * GiB, **_EPYC_9355_HOST},
    "cpu-only": {"gpu_count": 0, "host_ram": 768 * GiB, **_EPYC_9355_HOST},
}


def preset_names() -> tuple[str, ...]:
    """The machine presets, then one single-card machine per GPU model (its short name)."""
    return tuple(_PRESETS) + tuple(model.aliases[0] for model in GPU_MODELS)


def _card_preset(name: str) -> dict[str, Any] | None:
    """"RTX 4090", "2x RTX 3090", "4 × L40S": that many of a known card in the host of its class."""
    match = re.match(r"^\s*(?:(\d+)\s*[x×]\s*)?(.+?)\s*$", name)
    card = _find_gpu_model(match[2]) if match else None
    if card is None:
        return None
    count = int(match[1]) if match[1] else 1
    host = _DESKTOP_HOST if "GeForce" in card.name or "Radeon RX" in card.name else _WORKSTATION_HOST
    return {"gpu_model": card.aliases[0], "gpu_count": count, **host}


def preset(name: str) -> HardwareProfile:
    """The preset machine called ``name`` (spacing, case and '×' vs 'x' do not matter): one of
    the named presets, or "[N x] CARD" for a known GPU model in the host of its class."""
    wanted = _normalize(name)
    for known, values in _PRESETS.items():
        if _normalize(known) == wanted:
            return describe(name=known, **values)
    card = _card_preset(name)
    if card is not None:
        host = card["cpu_model"].split(" Processor")[0]
        label = f"{card['gpu_count']}x {card['gpu_model']}" if card["gpu_count"] > 1 else card["gpu_model"]
        return describe(name=f"{label} (preset host: {host}, {fmt_bytes(card['host_ram'])} RAM)", **card)
    raise HardwareDescriptionError(
        f"unknown machine preset {name!r}",
        "Known presets: " + ", ".join(repr(n) for n in _PRESETS) + "; or a GPU model, alone or as \"2x MODEL\": "
        + ", ".join(repr(m.aliases[0]) for m in GPU_MODELS) + ". Any other machine: this one with other "
        "numbers (--hardware this --gpus 2 --gpu-memory 24564MiB --ram 128GiB --host-bandwidth 89.6GB/s --cores 16), "
        "or a TOML description (--hardware machine.toml; the README lists its keys).",
    )


# --- describe ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Source:
    """Where each value came from, so that errors point at it: a file line or a parameter."""

    where: Callable[[str], str]  # parameter -> "machine.toml:5" or "describe()"
    name: Callable[[str], str]  # parameter -> "[gpu] memory" or "gpu_memory"

    def at(self, parameter: str) -> str:
        return f"{self.where(parameter)}: {self.name(parameter)}"


_CALL = _Source(where=lambda _: "describe()", name=lambda parameter: parameter)

# Below these a unit was surely forgotten ("96" meaning 96 GiB is 96 bytes).
_MIN_SENSIBLE_MEMORY = 1 * GiB
_MIN_SENSIBLE_RATE = 1e9


def describe(
    *,
    name: str = "described machine",
    gpu_model: str | Sequence[str] | None = None,
    gpu_count: int | None = None,
    gpu_memory: int | str | None = None,
    gpu_bandwidth: float | str | None = None,
    host_ram: int | str | None = None,
    host_bandwidth: float | str | None = None,
    cpu_model: str | None = None,
    cores: int | None = None,
    threads: int | None = None,
    sockets: int | None = None,
    l3: int | str | None = None,
    features: Iterable[str] | None = None,
    channels: int | None = None,
    mts: int | None = None,
) -> HardwareProfile:
    """A ``HardwareProfile(described=True)`` from explicit numbers.

    Sizes and rates may be numbers (bytes, bytes/s) or strings with units ("96GiB",
    "1229GB/s"). ``gpu_memory`` is per card as the driver reports it and may be left out
    for a model in ``GPU_MODELS``. ``gpu_model`` may list one model per card (mixed cards);
    ``gpu_count`` is then their number. ``channels`` (populated memory channels, all sockets
    together) and ``mts`` (the DIMMs' MT/s) give the host bandwidth where the platform's
    highest figures are not the machine's. The machine is taken as idle: GPU free memory and host
    available memory equal the totals; the planner applies its own reserves. Raises
    ``HardwareDescriptionError`` saying what is wrong and what to do.
    """
    return _describe(
        dict(
            name=name,
            gpu_model=gpu_model,
            gpu_count=gpu_count,
            gpu_memory=gpu_memory,
            gpu_bandwidth=gpu_bandwidth,
            host_ram=host_ram,
            host_bandwidth=host_bandwidth,
            cpu_model=cpu_model,
            cores=cores,
            threads=threads,
            sockets=sockets,
            l3=l3,
            features=features,
            channels=channels,
            mts=mts,
        ),
        _CALL,
    )


def _fail(source: _Source, parameter: str, problem: str, hint: str) -> HardwareDescriptionError:
    return HardwareDescriptionError(f"{source.at(parameter)}: {problem}", hint)


def _quantity(values, parameter, source, label, parse, fmt, unit: str, bare: str, minimum: float):
    """A size or rate from a description: parsed, above zero, and not a bare number that was
    surely meant with a unit (a "96" for GPU memory is 96 bytes, not 96 GiB)."""
    value = values.get(parameter)
    if value is None:
        return None
    try:
        quantity = parse(value)
    except UnitError as error:
        raise _fail(source, parameter, f"{label}: {error.what}", error.hint or "") from None
    if quantity <= 0:
        raise _fail(source, parameter, f"{label} must be more than 0", f"Give the {label} with a unit, e.g. \"{unit}\".")
    if quantity < minimum:
        raise _fail(
            source, parameter, f"{label} {value!r} is only {fmt(quantity)}",
            f"A bare number is {bare}; write the unit, e.g. \"{value}{unit.lstrip('0123456789.')}\".",
        )
    return quantity


def _size(values: dict[str, Any], parameter: str, source: _Source, label: str,
          minimum: int = _MIN_SENSIBLE_MEMORY) -> int | None:
    return _quantity(values, parameter, source, label, parse_bytes, fmt_bytes, "96GiB", "bytes", minimum)


def _rate(values: dict[str, Any], parameter: str, source: _Source, label: str) -> float | None:
    return _quantity(values, parameter, source, label, parse_rate, fmt_rate, "1229GB/s", "bytes/s", _MIN_SENSIBLE_RATE)


def _count(values: dict[str, Any], parameter: str, source: _Source, label: str, minimum: int) -> int | None:
    value = values.get(parameter)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(source, parameter, f"{label} must be a whole number, not {value!r}", f"Write e.g. {max(minimum, 2)}.")
    if value < minimum:
        raise _fail(source, parameter, f"{label} must be at least {minimum}, not {value}", f"Write e.g. {max(minimum, 2)}.")
    return value


def _guess_arch(cpu_model: str | None) -> str | None:
    if not cpu_model:
        return None
    if re.search(r"\b(EPYC|Xeon|Threadripper|Ryzen|Core)\b", cpu_model, re.IGNORECASE):
        return "x86_64"
    if re.search(r"\bApple\b", cpu_model, re.IGNORECASE):
        return "arm64"
    if re.search(r"\b(Grace|Neoverse|Graviton|Ampere|Axion)\b", cpu_model, re.IGNORECASE):
        return "aarch64"
    return None


def _numa_per_socket(sockets: int, cores: int | None, threads: int | None, ram: int) -> tuple[NumaNode, ...]:
    """One node per socket (NPS1 / SNC off), CPUs numbered the way Linux numbers them on
    x86 servers: each socket's first threads, then the SMT siblings in the same order."""
    cpus_of: list[list[int]] = [[] for _ in range(sockets)]
    if cores and cores % sockets == 0:
        per_socket = cores // sockets
        smt_levels = (threads // cores) if threads and threads % cores == 0 else 1
        for level in range(smt_levels):
            for socket in range(sockets):
                start = level * cores + socket * per_socket
                cpus_of[socket].extend(range(start, start + per_socket))
    return tuple(
        NumaNode(id=s, cpus=tuple(cpus_of[s]), memory_total_bytes=ram // sockets) for s in range(sockets)
    )


def _describe(values: dict[str, Any], source: _Source) -> HardwareProfile:
    unknown: dict[str, str] = {}
    not_described = "not described"

    gpu_count = _count(values, "gpu_count", source, "GPU count", 0)
    gpu_model_name = values.get("gpu_model")
    # Mixed cards: one model per card, in order (["RTX 5090", "RTX 4090"]).
    models_per_card: list[str] | None = None
    if isinstance(gpu_model_name, (list, tuple)):
        if not gpu_model_name or not all(isinstance(m, str) for m in gpu_model_name):
            raise _fail(source, "gpu_model", f"GPU models must be a list of names, not {gpu_model_name!r}",
                        'Write e.g. ["RTX 5090", "RTX 4090"], one name per card.')
        models_per_card = list(gpu_model_name)
        if gpu_count is not None and gpu_count != len(models_per_card):
            raise _fail(source, "gpu_count", f"{gpu_count} GPUs but {len(models_per_card)} models listed",
                        "List one model per card, or leave the count out.")
        gpu_count = len(models_per_card)
        gpu_model_name = None
    elif gpu_model_name is not None and not isinstance(gpu_model_name, str):
        raise _fail(source, "gpu_model", f"GPU model must be text, not {gpu_model_name!r}", 'Write e.g. "RTX PRO 6000".')
    gpu_count = gpu_count if gpu_count is not None else (1 if gpu_model_name else 0)
    if gpu_count == 0:
        for parameter, label in (("gpu_memory", "GPU memory"), ("gpu_bandwidth", "GPU bandwidth"), ("gpu_model", "a GPU model")):
            if values.get(parameter) is not None:
                raise _fail(
                    source, parameter, f"{label} is given for a machine with 0 GPUs",
                    f"Set {source.name('gpu_count')} to the number of cards, or remove {source.name(parameter)}.",
                )
    gpu_memory = _size(values, "gpu_memory", source, "GPU memory per card")
    gpu_bandwidth = _rate(values, "gpu_bandwidth", source, "GPU memory bandwidth")
    names = models_per_card or [gpu_model_name] * gpu_count
    cards = [_find_gpu_model(n) if n else None for n in names]
    known = ", ".join(repr(m.aliases[0]) for m in GPU_MODELS)
    for n, c in zip(names, cards):
        if n and c is None and gpu_memory is None:
            raise _fail(
                source, "gpu_model", f"unknown GPU model {n!r} and no GPU memory given",
                f"Give the memory per card as the driver reports it (e.g. \"97887MiB\"), or use a known model: {known}.",
            )
    if gpu_count and not any(names) and gpu_memory is None:
        raise _fail(
            source, "gpu_count", f"{gpu_count} GPUs but neither their model nor their memory",
            f"Give the GPU model ({known}) or the memory per card as the driver reports it.",
        )
    channels = _count(values, "channels", source, "memory channel count", 1)
    mts = _count(values, "mts", source, "memory speed (MT/s)", 1)
    if mts is not None and mts < 400:
        raise _fail(source, "mts", f"memory speed {mts} MT/s is too slow to be a DIMM's",
                    "Give the transfer rate in MT/s, e.g. 5600 for DDR5-5600.")

    host_ram = _size(values, "host_ram", source, "host RAM")
    if host_ram is None:
        raise _fail(source, "host_ram", "host RAM is missing", 'Give the installed RAM, e.g. "768GiB".')
    host_bandwidth = _rate(values, "host_bandwidth", source, "host memory bandwidth")
    cpu_model = values.get("cpu_model")
    if cpu_model is not None and not isinstance(cpu_model, str):
        raise _fail(source, "cpu_model", f"CPU model must be text, not {cpu_model!r}", 'Write e.g. "AMD EPYC 9355".')
    sockets = _count(values, "sockets", source, "socket count", 1)
    cores = _count(values, "cores", source, "physical core count", 1)
    threads = _count(values, "threads", source, "thread count", 1)
    if cores is not None and sockets is not None and (cores < sockets or cores % sockets):
        raise _fail(
            source, "cores", f"{cores} cores cannot be shared evenly by {sockets} sockets",
            "Give the physical cores of all sockets together (e.g. 64 for two 32-core CPUs).",
        )
    if cores is not None and threads is not None and threads < cores:
        raise _fail(
            source, "threads", f"{threads} threads is fewer than the {cores} physical cores",
            "Give the hardware threads (2 per core with SMT on), or leave threads out.",
        )
    l3 = _size(values, "l3", source, "L3 cache size", minimum=1)
    features_value = values.get("features")
    if features_value is not None and (
        isinstance(features_value, str) or not all(isinstance(f, str) for f in features_value)
    ):
        raise _fail(source, "features", f"features must be a list of names, not {features_value!r}",
                    'Write e.g. ["avx2", "fma", "f16c"] (the names /proc/cpuinfo gives).')

    # GPUs: explicit numbers win over the model catalogue.
    gpus = []
    for index, (card, card_name) in enumerate(zip(cards, names)):
        memory = gpu_memory if gpu_memory is not None else card.memory_bytes  # type: ignore[union-attr]
        vendor = card.vendor if card else _vendor_of(card_name)
        gpus.append(
            GPU(
                index=index,
                name=card.name if card else (card_name or "GPU"),
                vendor=vendor,
                total_bytes=memory,
                free_bytes=memory,
                compute_capability=card.compute_capability if card else None,
                pcie_generation=card.pcie_generation if card else None,
                pcie_width=card.pcie_width if card else None,
                nvlink_links=card.nvlink_links if card else None,
                memory_bandwidth_bytes_per_s=gpu_bandwidth or (card.memory_bandwidth_bytes_per_s if card else None),
                served=vendor == "nvidia",  # the engine's GPU path is CUDA's (llama.cpp drives the others)
                source="described",
            )
        )
        for field in ("compute_capability", "pcie_generation", "pcie_width", "memory_bandwidth_bytes_per_s"):
            if getattr(gpus[-1], field) is None:
                unknown[f"gpus[{index}].{field}"] = f"{not_described}: GPU model {card_name or '(none)'} is not in the catalogue"
        if gpus[-1].nvlink_links is None:
            unknown[f"gpus[{index}].nvlink_links"] = (
                f"{not_described}: {card.name} NVLink depends on the bridges installed" if card
                else f"{not_described}: GPU model not in the catalogue"
            )

    if host_bandwidth is not None:
        theoretical, note = host_bandwidth, f"described: {fmt_rate(host_bandwidth)}"
    else:
        theoretical, note = theoretical_host_bandwidth(cpu_model, sockets, cores, channels=channels, megatransfers=mts)
        if theoretical is None:
            unknown["memory.bandwidth_theoretical_bytes_per_s"] = f"{not_described}; {note}"
    memory = Memory(
        total_bytes=host_ram,
        available_bytes=host_ram,
        bandwidth_theoretical_bytes_per_s=theoretical,
        bandwidth_note=note if theoretical is not None else None,
    )
    unknown["memory.bandwidth_measured_bytes_per_s"] = "described machine: nothing to measure"
    unknown["memory.hugepages_total"] = unknown["memory.hugepage_size_bytes"] = not_described
    unknown["memory.transparent_hugepages"] = not_described

    cpu = CPU(
        model_name=cpu_model,
        arch=_guess_arch(cpu_model),
        sockets=sockets,
        physical_cores=cores,
        threads=threads,
        numa_nodes=_numa_per_socket(sockets, cores, threads, host_ram) if sockets else (),
        features=tuple(features_value or ()),
        l3_bytes=l3,
    )
    for field in fields(CPU):
        value = getattr(cpu, field.name)
        if value is None or (field.name == "features" and features_value is None):
            unknown[f"cpu.{field.name}"] = not_described
    if not sockets:
        unknown["cpu.numa_nodes"] = f"{not_described}: give the socket count"
    elif cores is None:
        unknown["cpu.numa_nodes"] = "described: one node per socket assumed; CPUs unknown without a core count"
    else:
        unknown["cpu.numa_nodes"] = "described: one node per socket assumed (NPS1 / SNC off)"
    unknown["disk"] = "described machine: the model store is sized on the machine that runs it"

    name = values.get("name") or "described machine"
    return HardwareProfile(
        cpu=cpu, memory=memory, gpus=tuple(gpus), disk=None, unknown=unknown, described=True, name=str(name)
    )


# --- TOML descriptions -------------------------------------------------------------------------

# TOML (table, key) -> describe() parameter.
_TOML_KEYS: dict[tuple[str, str], str] = {
    ("", "name"): "name",
    ("gpu", "model"): "gpu_model",
    ("gpu", "count"): "gpu_count",
    ("gpu", "memory"): "gpu_memory",
    ("gpu", "bandwidth"): "gpu_bandwidth",
    ("host", "ram"): "host_ram",
    ("host", "bandwidth"): "host_bandwidth",
    ("host", "cpu"): "cpu_model",
    ("host", "cores"): "cores",
    ("host", "threads"): "threads",
    ("host", "sockets"): "sockets",
    ("host", "l3"): "l3",
    ("host", "features"): "features",
    ("host", "channels"): "channels",
    ("host", "mts"): "mts",
}
# A flat file gives the same facts at the top level: each under its parameter name
# (``gpu_count``, ``host_ram``), and the [host] facts also under their table key
# (``ram``, ``cpu``), as the README's example writes them.
FLAT_KEYS: dict[str, str] = {
    **{parameter: parameter for parameter in _TOML_KEYS.values()},
    **{key: parameter for (table, key), parameter in _TOML_KEYS.items() if table == "host"},
}
_EXAMPLE = '[gpu]\nmodel = "RTX PRO 6000"\ncount = 4\n[host]\nram = "768GiB"\ncpu = "AMD EPYC 9355"\nsockets = 2'


def _line_of(text: str, table: str, key: str) -> int | None:
    """Line number of ``key = ...`` inside ``[table]`` (top level when table is "")."""
    current = ""
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        header = re.match(r"^\[\s*([A-Za-z0-9_.-]+)\s*\]", stripped)
        if header:
            current = header[1]
            continue
        if current == table and re.match(rf"^[\"']?{re.escape(key)}[\"']?\s*=", stripped):
            return number
    return None


def _toml_name(table: str, key: str) -> str:
    return f"[{table}] {key}" if table else key


def load_described(path: str | os.PathLike[str]) -> HardwareProfile:
    """A described machine from a TOML file (format in this module's docstring).

    Every problem raises ``HardwareDescriptionError`` naming the file, the line and the key.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise HardwareDescriptionError(
            f"{path}: no such machine description", "Check the path, or use a preset: " + ", ".join(_PRESETS)
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise HardwareDescriptionError(f"{path}: cannot read it: {error}", "Give a UTF-8 TOML file.") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        message = str(error)
        line = re.search(r"at line (\d+)", message)
        where = f"{path}:{line[1]}" if line else str(path)
        raise HardwareDescriptionError(
            f"{where}: malformed TOML: {message}",
            "Fix that line; text values need quotes. A description looks like:\n" + _EXAMPLE,
        ) from None

    # Where each describe() parameter was written: a key of [gpu]/[host], or the parameter's
    # own name at the top level (flat files). Unwritten ones default to their table key.
    origin: dict[str, tuple[str, str]] = {param: key for key, param in _TOML_KEYS.items()}

    def where(parameter: str) -> str:
        table, key = origin[parameter]
        # A missing key (host RAM not given) is pointed at by its table's header.
        line = _line_of(text, table, key) or _line_of_table(text, table)
        return f"{path}:{line}" if line else str(path)

    source = _Source(where=where, name=lambda parameter: _toml_name(*origin[parameter]))

    def take(parameter: str, table: str, key: str, value: Any) -> None:
        if parameter in values:
            line = _line_of(text, table, key)
            raise HardwareDescriptionError(
                f"{path}{':' + str(line) if line else ''}: {_toml_name(table, key)} repeats "
                f"{_toml_name(*origin[parameter])}",
                "Give each fact once.",
            )
        values[parameter] = value
        origin[parameter] = (table, key)

    values: dict[str, Any] = {}
    for top_key, top_value in document.items():
        if isinstance(top_value, dict) and top_key in ("gpu", "host"):
            for key, value in top_value.items():
                if (top_key, key) not in _TOML_KEYS:
                    known = ", ".join(k for t, k in _TOML_KEYS if t == top_key)
                    line = _line_of(text, top_key, key)
                    raise HardwareDescriptionError(
                        f"{path}{':' + str(line) if line else ''}: unknown key {_toml_name(top_key, key)}",
                        f"Keys of [{top_key}]: {known}.",
                    )
                take(_TOML_KEYS[(top_key, key)], top_key, key, value)
        elif top_key in FLAT_KEYS and not isinstance(top_value, dict):
            take(FLAT_KEYS[top_key], "", top_key, top_value)
        else:
            line = _line_of(text, "", top_key) or _line_of_table(text, top_key)
            raise HardwareDescriptionError(
                f"{path}{':' + str(line) if line else ''}: unknown entry {top_key!r}",
                "A description has the tables [gpu] and [host], or these keys at the top level: "
                + ", ".join(FLAT_KEYS) + ". Example:\n" + _EXAMPLE,
            )
    if "name" not in values:
        values["name"] = path.stem
    return _describe(values, source)


def _line_of_table(text: str, table: str) -> int | None:
    if not table:
        return None
    for number, line in enumerate(text.splitlines(), start=1):
        if re.match(rf"^\s*\[\s*{re.escape(table)}\s*\]", line):
            return number
    return None
