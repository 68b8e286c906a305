"""What a machine has, as plain data: detected on this machine or described by the user.

Every fact that could not be determined is ``None`` and ``HardwareProfile.unknown`` maps
its dotted name (``"memory.cgroup_limit_bytes"``) to the reason, so that nothing is
silently guessed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...] = ()
    memory_total_bytes: int | None = None


@dataclass(frozen=True)
class CPU:
    model_name: str | None = None
    arch: str | None = None  # "x86_64", "aarch64", ...
    sockets: int | None = None
    physical_cores: int | None = None
    threads: int | None = None
    numa_nodes: tuple[NumaNode, ...] = ()
    # Lower-case names as in /proc/cpuinfo where one exists: "avx2", "fma", "f16c", "avx512f",
    # "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx512vbmi",
    # "avx512_bitalg", "gfni", "amx_tile", "amx_int8", "amx_bf16", "neon", "sve" (cpu.X86_FEATURES,
    # cpu.ARM_FEATURES; the native kernel set they get: cpu_kernels.native_kernel_set).
    features: tuple[str, ...] = ()
    l3_bytes: int | None = None  # all L3 instances of all sockets together


@dataclass(frozen=True)
class Memory:
    total_bytes: int | None = None
    available_bytes: int | None = None
    cgroup_limit_bytes: int | None = None  # None: no limit set (or unknown, see `unknown`)
    hugepages_total: int | None = None
    hugepage_size_bytes: int | None = None
    # Linux's transparent huge pages: "always", "madvise" or "never". The CPU's weight copies
    # and KV cache ask for them (madvise); in 4 KiB pages a decode step reads them slower.
    transparent_hugepages: str | None = None
    bandwidth_measured_bytes_per_s: float | None = None
    bandwidth_measured_note: str | None = None  # how it was measured ("best of 3 probes 0.1 s apart")
    bandwidth_theoretical_bytes_per_s: float | None = None
    bandwidth_note: str | None = None  # how the theoretical figure was derived

    @property
    def usable_bytes(self) -> int | None:
        """RAM this process may use: the smaller of physical RAM and the cgroup limit."""
        known = [v for v in (self.total_bytes, self.cgroup_limit_bytes) if v is not None]
        return min(known) if known else None

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """The figure the planner uses: theoretical when known (an upper bound), else measured."""
        return self.bandwidth_theoretical_bytes_per_s or self.bandwidth_measured_bytes_per_s


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    vendor: str = "nvidia"  # "nvidia", "amd", "apple", ...
    total_bytes: int | None = None
    free_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    # Fastest link the card and its slot can train to (what transfers are planned with) ...
    pcie_generation: int | None = None
    pcie_width: int | None = None
    # ... and the link now: the generation drops while a card idles, a narrower width than
    # the maximum means a riser or slot problem worth telling the user about.
    pcie_generation_current: int | None = None
    pcie_width_current: int | None = None
    nvlink_links: int | None = None
    memory_bandwidth_bytes_per_s: float | None = None
    served: bool = True  # False: seen, but the hybrid backend cannot use it
    source: str = "nvml"  # "nvml", "torch", "described", ...

    @property
    def pcie_bandwidth_bytes_per_s(self) -> float | None:
        """Theoretical one-direction PCIe bandwidth from generation and link width."""
        per_lane = {3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
        if self.pcie_generation in per_lane and self.pcie_width:
            return per_lane[self.pcie_generation] * self.pcie_width
        return None


@dataclass(frozen=True)
class Disk:
    path: str
    free_bytes: int | None = None
    total_bytes: int | None = None


@dataclass(frozen=True)
class HardwareProfile:
    cpu: CPU = field(default_factory=CPU)
    memory: Memory = field(default_factory=Memory)
    gpus: tuple[GPU, ...] = ()
    disk: Disk | None = None
    # Fact (dotted name) -> why it is unknown.
    unknown: dict[str, str] = field(default_factory=dict)
    # True when the profile describes a machine the user is sizing, not this one.
    described: bool = False
    name: str = "this machine"

    @property
    def served_gpus(self) -> tuple[GPU, ...]:
        return tuple(g for g in self.gpus if g.served)

    @property
    def llamacpp_gpus(self) -> tuple[GPU, ...]:
        """The GPUs llama.cpp can drive: the engine's (CUDA) and AMD cards of known memory
        (llama.cpp's ROCm/HIP and Vulkan builds; the engine's GPU path is CUDA's alone)."""
        return tuple(g for g in self.gpus if g.served or (g.vendor == "amd" and g.total_bytes))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"]["usable_bytes"] = self.memory.usable_bytes
        d["memory"]["bandwidth_bytes_per_s"] = self.memory.bandwidth_bytes_per_s
        for g, gd in zip(self.gpus, d["gpus"]):
            gd["pcie_bandwidth_bytes_per_s"] = g.pcie_bandwidth_bytes_per_s
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HardwareProfile":
        def build(klass, data):
            names = {f.name for f in fields(klass)}
            return klass(**{k: v for k, v in data.items() if k in names})

        cpu = dict(d.get("cpu") or {})
        cpu["numa_nodes"] = tuple(
            build(NumaNode, {**n, "cpus": tuple(n.get("cpus") or ())}) for n in cpu.get("numa_nodes") or ()
        )
        cpu["features"] = tuple(cpu.get("features") or ())
        gpus = []
        for g in d.get("gpus") or ():
            g = dict(g)
            if g.get("compute_capability") is not None:
                g["compute_capability"] = tuple(g["compute_capability"])
            gpus.append(build(GPU, g))
        disk = d.get("disk")
        return cls(
            cpu=build(CPU, cpu),
            memory=build(Memory, d.get("memory") or {}),
            gpus=tuple(gpus),
            disk=build(Disk, disk) if disk else None,
            unknown=dict(d.get("unknown") or {}),
            described=bool(d.get("described", False)),
            name=d.get("name", "this machine"),
        )
