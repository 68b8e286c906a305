"""The host CPU: model, sockets, cores, threads, NUMA layout, the ISA features our kernels
dispatch on, and the size of the last-level cache.

Sources, in order of trust: /proc/cpuinfo (what the kernel enumerated), then the sysfs
topology under /sys/devices/system/{cpu,node}, then psutil / sysctl for the running
machine only. Each fact that no source gives is reported in ``unknown`` with the reason.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psutil

from hybridmoe.backend.hardware.profile import CPU, NumaNode
from hybridmoe.backend.hardware.sysfs import (
    is_host_root,
    numbered_dirs,
    parse_cache_size,
    parse_cpulist,
    parse_meminfo,
    read_int,
    read_text,
)

__all__ = ["detect_cpu", "X86_FEATURES", "ARM_FEATURES"]

# x86 flags the CPU expert kernels (and llama.cpp's) dispatch on, named as in /proc/cpuinfo:
# every flag a native kernel set needs (cpu_kernels.NATIVE_KERNEL_SETS) is among them.
X86_FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx512vbmi",
    "avx512_bitalg",
    "gfni",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "amx_fp16",
)

# Arm /proc/cpuinfo "Features" name -> the name we report. "asimd" is what the kernel calls
# Advanced SIMD; everyone else calls it NEON. Dot product and int8 matmul matter for
# quantized GEMV the way VNNI does on x86.
ARM_FEATURES = {
    "asimd": "neon",
    "asimddp": "dotprod",
    "i8mm": "i8mm",
    "bf16": "bf16",
    "sve": "sve",
    "sve2": "sve2",
}

# Arm cores do not name themselves in /proc/cpuinfo; lscpu keeps a table of (implementer,
# part) codes. These are the ones found in servers and workstations people run LLMs on.
_ARM_IMPLEMENTERS = {
    0x41: "ARM",
    0x42: "Broadcom",
    0x43: "Cavium",
    0x46: "Fujitsu",
    0x48: "HiSilicon",
    0x4E: "NVIDIA",
    0x51: "Qualcomm",
    0x61: "Apple",
    0xC0: "Ampere",
}
_ARM_PARTS = {
    (0x41, 0xD03): "Cortex-A53",
    (0x41, 0xD05): "Cortex-A55",
    (0x41, 0xD08): "Cortex-A72",
    (0x41, 0xD0B): "Cortex-A76",
    (0x41, 0xD0C): "Neoverse-N1",  # also Ampere Altra
    (0x41, 0xD40): "Neoverse-V1",  # AWS Graviton3
    (0x41, 0xD41): "Cortex-A78",
    (0x41, 0xD44): "Cortex-X1",
    (0x41, 0xD47): "Cortex-A710",
    (0x41, 0xD49): "Neoverse-N2",
    (0x41, 0xD4F): "Neoverse-V2",  # NVIDIA Grace, AWS Graviton4, Google Axion
    (0x41, 0xD84): "Neoverse-V3",
    (0x46, 0x001): "A64FX",
    (0x48, 0xD01): "Kunpeng-920",
    (0xC0, 0xAC3): "AmpereOne",
}

_CPUINFO = "/proc/cpuinfo"


def detect_cpu(
    proc_root: str | os.PathLike[str] = "/proc",
    sys_root: str | os.PathLike[str] = "/sys",
    *,
    sysctl: Callable[[str], str | None] | None = None,
) -> tuple[CPU, dict[str, str]]:
    """Describe the CPU from ``proc_root`` and ``sys_root`` (fake trees in tests).

    Returns the CPU and ``{"cpu.<field>": reason}`` for each fact left unknown. Never raises
    for missing or malformed files. ``sysctl`` (name -> value) is used where there is no
    /proc/cpuinfo, i.e. on macOS; it defaults to the ``sysctl`` command on Darwin.
    """
    proc = Path(proc_root)
    cpu_dir = Path(sys_root) / "devices" / "system" / "cpu"
    node_dir = Path(sys_root) / "devices" / "system" / "node"
    on_host = is_host_root(proc_root, "/proc") and is_host_root(sys_root, "/sys")
    unknown: dict[str, str] = {}

    cpuinfo_text = read_text(proc / "cpuinfo")
    if sysctl is not None or (cpuinfo_text is None and on_host and sys.platform == "darwin"):
        return _detect_from_sysctl(sysctl or _run_sysctl)

    processors, extra = _parse_cpuinfo(cpuinfo_text or "")
    if cpuinfo_text is None:
        cpuinfo_missing = f"{_CPUINFO} is missing or unreadable"
    elif not processors:
        cpuinfo_missing = f"{_CPUINFO} lists no processors"
    else:
        cpuinfo_missing = None

    arch = _arch(processors, on_host)
    if arch is None:
        unknown["cpu.arch"] = cpuinfo_missing or f"{_CPUINFO} has neither x86 'flags' nor Arm 'Features'"

    model_name = _model_name(processors, extra)
    if model_name is None:
        unknown["cpu.model_name"] = cpuinfo_missing or f"{_CPUINFO} has no 'model name' or Arm part code"

    topology = _sysfs_topology(cpu_dir)

    sockets = _distinct(processors, ("physical id",))
    if sockets is None and topology:
        sockets = len({package for package, _ in topology.values() if package is not None}) or None
    if sockets is None:
        unknown["cpu.sockets"] = (
            f"no 'physical id' in {_CPUINFO} and no {cpu_dir}/cpu*/topology/physical_package_id"
        )

    physical_cores, cores_reason = _physical_cores(processors, topology, on_host)
    if physical_cores is None:
        unknown["cpu.physical_cores"] = cores_reason

    threads = len(processors) or _count_online(cpu_dir)
    if threads is None and on_host:
        threads = os.cpu_count()
    if threads is None:
        unknown["cpu.threads"] = cpuinfo_missing or f"{_CPUINFO} lists no processors"

    numa_nodes, numa_reason = _numa_nodes(node_dir)
    if numa_reason:
        unknown["cpu.numa_nodes"] = numa_reason

    features, features_reason = _features(processors)
    if features_reason:
        unknown["cpu.features"] = cpuinfo_missing or features_reason

    l3_bytes = _l3_from_sysfs(cpu_dir)
    if l3_bytes is None:
        l3_bytes, l3_reason = _l3_from_cpuinfo(processors, sockets)
        if l3_bytes is None:
            unknown["cpu.l3_bytes"] = l3_reason

    cpu = CPU(
        model_name=model_name,
        arch=arch,
        sockets=sockets,
        physical_cores=physical_cores,
        threads=threads,
        numa_nodes=numa_nodes,
        features=features,
        l3_bytes=l3_bytes,
    )
    return cpu, unknown


# --- /proc/cpuinfo ----------------------------------------------------------------------


def _parse_cpuinfo(text: str) -> tuple[list[dict[str, str]], dict[str, str]]:
    """Processor blocks (those with a "processor" key) and the keys of any other block.

    Blocks are separated by blank lines; lines without a colon are ignored, which is how
    garbage or truncated files are survived. Arm kernels put "Hardware:" and similar in a
    trailing block of their own, hence ``extra``.
    """
    processors: list[dict[str, str]] = []
    extra: dict[str, str] = {}
    for block in text.split("\n\n"):
        entry: dict[str, str] = {}
        for line in block.splitlines():
            key, colon, value = line.partition(":")
            if colon and key.strip():
                entry[key.strip()] = value.strip()
        if not entry:
            continue
        if "processor" in entry and entry["processor"].isdigit():
            processors.append(entry)
        else:
            extra.update(entry)
    return processors, extra


def _arch(processors: list[dict[str, str]], on_host: bool) -> str | None:
    first = processors[0] if processors else {}
    if "flags" in first:
        return "x86_64" if "lm" in first["flags"].split() else "i686"
    if "Features" in first or "CPU implementer" in first:
        return "aarch64" if first.get("CPU architecture", "8").strip() in ("8", "AArch64") else "armv7l"
    # The file did not tell; on this machine the interpreter's own architecture is the
    # answer, but never for a fake tree describing some other machine.
    return platform.machine() or None if on_host else None


def _model_name(processors: list[dict[str, str]], extra: dict[str, str]) -> str | None:
    for entry in processors:
        if entry.get("model name"):
            return entry["model name"]
    if processors and "CPU implementer" in processors[0]:
        try:
            implementer = int(processors[0]["CPU implementer"], 16)
            part = int(processors[0].get("CPU part", ""), 16)
        except ValueError:
            return None
        vendor = _ARM_IMPLEMENTERS.get(implementer, f"implementer {implementer:#x}")
        core = _ARM_PARTS.get((implementer, part))
        return f"{vendor} {core}" if core else f"{vendor} part {part:#05x}"
    return extra.get("Hardware") or extra.get("model name")


def _distinct(processors: list[dict[str, str]], keys: tuple[str, ...]) -> int | None:
    """Number of distinct values of ``keys`` over all processors; None if any lacks one."""
    if not processors or not all(all(k in p for k in keys) for p in processors):
        return None
    return len({tuple(p[k] for k in keys) for p in processors})


def _features(processors: list[dict[str, str]]) -> tuple[tuple[str, ...], str | None]:
    """Features every processor has (hybrid cores may differ; a kernel runs on any thread)."""
    if not processors:
        return (), f"{_CPUINFO} lists no processors"
    if all("flags" in p for p in processors):
        common = set.intersection(*(set(p["flags"].split()) for p in processors))
        return tuple(f for f in X86_FEATURES if f in common), None
    if all("Features" in p for p in processors):
        common = set.intersection(*(set(p["Features"].split()) for p in processors))
        return tuple(name for flag, name in ARM_FEATURES.items() if flag in common), None
    return (), f"{_CPUINFO} has no 'flags' (x86) or 'Features' (Arm) line for every processor"


# --- sysfs topology -----------------------------------------------------------------------


def _count_online(cpu_dir: Path) -> int | None:
    online = read_text(cpu_dir / "online")
    if online is None:
        return None
    try:
        return len(parse_cpulist(online)) or None
    except ValueError:
        return None


def _sysfs_topology(cpu_dir: Path) -> dict[int, tuple[int | None, tuple[int, ...] | None]]:
    """cpu number -> (package id, the CPUs sharing its core) from sysfs; {} if absent."""
    topology = {}
    for number, path in numbered_dirs(cpu_dir, "cpu"):
        topo = path / "topology"
        if not topo.is_dir():
            continue
        package = read_int(topo / "physical_package_id")
        # core_cpus_list is the current name; thread_siblings_list the one older kernels use.
        siblings_text = read_text(topo / "core_cpus_list") or read_text(topo / "thread_siblings_list")
        try:
            siblings = parse_cpulist(siblings_text) if siblings_text is not None else None
        except ValueError:
            siblings = None
        topology[number] = (package, siblings)
    return topology


def _physical_cores(
    processors: list[dict[str, str]],
    topology: dict[int, tuple[int | None, tuple[int, ...] | None]],
    on_host: bool,
) -> tuple[int | None, str]:
    # A physical core is a unique (socket, core) pair; "core id" alone repeats per socket.
    cores = _distinct(processors, ("physical id", "core id"))
    if cores:
        return cores, ""
    # sysfs: each core has exactly one set of sibling threads. Counting sets rather than
    # core_id values also works on Arm, where core_id may repeat across clusters.
    sibling_sets = {siblings for _, siblings in topology.values() if siblings}
    if sibling_sets and all(siblings for _, siblings in topology.values()):
        return len(sibling_sets), ""
    if on_host:
        count = psutil.cpu_count(logical=False)
        if count:
            return count, ""
    reason = (
        f"no 'physical id'/'core id' pairs in {_CPUINFO} and no core_cpus_list in sysfs topology"
    )
    if on_host:
        reason += "; psutil could not count physical cores either"
    return None, reason


def _numa_nodes(node_dir: Path) -> tuple[tuple[NumaNode, ...], str | None]:
    entries = numbered_dirs(node_dir, "node")
    if not entries:
        return (), f"no {node_dir}/node* (kernel without NUMA support, or /sys not mounted)"
    nodes = []
    problems = []
    for number, path in entries:
        cpus: tuple[int, ...] = ()
        cpulist = read_text(path / "cpulist")
        if cpulist is None:
            problems.append(f"node{number}/cpulist missing")
        else:
            try:
                cpus = parse_cpulist(cpulist)
            except ValueError:
                problems.append(f"node{number}/cpulist unreadable: {cpulist.strip()!r}")
        meminfo = read_text(path / "meminfo")
        memory = parse_meminfo(meminfo).get("MemTotal") if meminfo is not None else None
        if memory is None:
            problems.append(f"node{number}/meminfo has no MemTotal")
        # Nodes without CPUs are real (CXL memory, HBM in flat mode) and kept as such.
        nodes.append(NumaNode(id=number, cpus=cpus, memory_total_bytes=memory))
    return tuple(nodes), ("; ".join(problems) if problems else None)


# --- last-level cache ------------------------------------------------------------------


def _l3_from_sysfs(cpu_dir: Path) -> int | None:
    """Total L3 over the whole machine: one size per distinct cache instance.

    The total is what matters for "is this buffer out of cache" (an EPYC 9355 has eight
    32 MiB L3 slices per socket); cpu0's own index3 alone would undercount.
    """
    instances: dict[tuple, int] = {}
    for number, path in numbered_dirs(cpu_dir, "cpu"):
        for _, index in numbered_dirs(path / "cache", "index"):
            if read_int(index / "level") != 3:
                continue
            if (read_text(index / "type") or "").strip() not in ("Unified", "Data"):
                continue
            size = parse_cache_size(read_text(index / "size") or "")
            if not size:
                continue
            shared = (read_text(index / "shared_cpu_list") or "").strip()
            cache_id = read_int(index / "id")
            # Instances are told apart by the CPUs sharing them (or their id); a cache with
            # neither is counted once per CPU that reports it, the best we can do.
            key = ("shared", shared) if shared else ("id", cache_id) if cache_id is not None else ("cpu", number)
            instances[key] = size
    return sum(instances.values()) or None


def _l3_from_cpuinfo(processors: list[dict[str, str]], sockets: int | None) -> tuple[int | None, str]:
    """Intel's cpuinfo "cache size" is the per-package L3; AMD's is the per-core L2."""
    if not processors:
        return None, f"no cache index3 in sysfs and {_CPUINFO} lists no processors"
    vendor = processors[0].get("vendor_id", "")
    size = parse_cache_size(processors[0].get("cache size", ""))
    if vendor == "GenuineIntel" and size:
        return size * (sockets or 1), ""
    if size:
        return None, (
            f"no cache index3 in sysfs; {_CPUINFO} 'cache size' is not the L3 on {vendor or 'this CPU'}"
        )
    return None, f"no cache index3 in sysfs and no 'cache size' in {_CPUINFO}"


# --- macOS ------------------------------------------------------------------------------


def _run_sysctl(name: str) -> str | None:
    try:
        result = subprocess.run(
            ["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else None


def _detect_from_sysctl(sysctl: Callable[[str], str | None]) -> tuple[CPU, dict[str, str]]:
    """macOS has no /proc; sysctl gives the same facts under hw.* and machdep.*."""
    unknown: dict[str, str] = {}

    def number(name: str) -> int | None:
        value = sysctl(name)
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None

    model_name = sysctl("machdep.cpu.brand_string")
    arch = "arm64" if number("hw.optional.arm64") == 1 else (sysctl("hw.machine") or None)
    sockets = number("hw.packages")
    physical_cores = number("hw.physicalcpu")
    threads = number("hw.logicalcpu")
    l3 = number("hw.l3cachesize") or None  # Apple silicon has no L3 (a system cache instead)

    if arch == "arm64":
        flags = {
            "neon": "hw.optional.neon",
            "dotprod": "hw.optional.arm.FEAT_DotProd",
            "i8mm": "hw.optional.arm.FEAT_I8MM",
            "bf16": "hw.optional.arm.FEAT_BF16",
            "sve": "hw.optional.arm.FEAT_SVE",
        }
    else:
        # hw.optional names no VNNI, BF16, BITALG or GFNI: an Intel Mac (none has AVX512_BF16)
        # runs the native AVX2 kernel set at best, as cpu_kernels.native_kernel_set then says.
        flags = {
            "avx2": "hw.optional.avx2_0",
            "fma": "hw.optional.fma",
            "f16c": "hw.optional.f16c",
            "avx512f": "hw.optional.avx512f",
            "avx512bw": "hw.optional.avx512bw",
            "avx512vl": "hw.optional.avx512vl",
            "avx512dq": "hw.optional.avx512dq",
            "avx512vbmi": "hw.optional.avx512vbmi",
        }
    features = tuple(name for name, key in flags.items() if number(key) == 1)

    for field, value in (
        ("model_name", model_name),
        ("arch", arch),
        ("sockets", sockets),
        ("physical_cores", physical_cores),
        ("threads", threads),
    ):
        if value is None:
            unknown[f"cpu.{field}"] = "not reported by sysctl"
    if l3 is None:
        unknown["cpu.l3_bytes"] = (
            "Apple silicon has no L3 (it has a system-level cache sysctl does not size)"
            if arch == "arm64"
            else "hw.l3cachesize not reported by sysctl"
        )
    unknown["cpu.numa_nodes"] = "macOS does not expose NUMA nodes"
    cpu = CPU(
        model_name=model_name,
        arch=arch,
        sockets=sockets,
        physical_cores=physical_cores,
        threads=threads,
        features=features,
        l3_bytes=l3,
    )
    return cpu, unknown
