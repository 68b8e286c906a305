"""Fake /proc and /sys trees and a fake NVML module, built to look like real machines.

Each ``write_*`` helper writes the files the kernel would, in the kernel's formats, so the
detectors are exercised on the same text they meet in the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

KIB = 1024
MIB = 1024**2
GIB = 1024**3


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


# --- /proc ------------------------------------------------------------------------------------


def x86_block(number: int, *, model: str, vendor: str, physical_id: int, core_id: int,
              flags: str, cache_size: str, siblings: int, cores: int) -> str:
    return (
        f"processor\t: {number}\nvendor_id\t: {vendor}\ncpu family\t: 25\nmodel\t\t: 17\n"
        f"model name\t: {model}\nstepping\t: 1\ncpu MHz\t\t: 3000.000\ncache size\t: {cache_size}\n"
        f"physical id\t: {physical_id}\nsiblings\t: {siblings}\ncore id\t\t: {core_id}\n"
        f"cpu cores\t: {cores}\napicid\t\t: {number}\nfpu\t\t: yes\nflags\t\t: {flags}\n"
        "bogomips\t: 6000.00\nclflush size\t: 64\naddress sizes\t: 52 bits physical, 57 bits virtual\n"
        "power management:\n"
    )


def arm_block(number: int, *, features: str, implementer: str = "0x41", part: str = "0xd4f") -> str:
    return (
        f"processor\t: {number}\nBogoMIPS\t: 2000.00\nFeatures\t: {features}\n"
        f"CPU implementer\t: {implementer}\nCPU architecture: 8\nCPU variant\t: 0x0\n"
        f"CPU part\t: {part}\nCPU revision\t: 0\n"
    )


def write_cpuinfo(proc: Path, blocks: list[str]) -> None:
    write(proc / "cpuinfo", "\n".join(blocks) + "\n")


def write_meminfo(proc: Path, *, total: int, available: int | None, hugepages: int = 0,
                  hugepage_size: int = 2 * MIB, extra: str = "") -> None:
    lines = [f"MemTotal:       {total // KIB} kB", f"MemFree:        {total // KIB // 2} kB"]
    if available is not None:
        lines.append(f"MemAvailable:   {available // KIB} kB")
    lines += [
        "Buffers:           29036 kB",
        f"HugePages_Total:   {hugepages}",
        f"HugePages_Free:    {hugepages}",
        f"Hugepagesize:       {hugepage_size // KIB} kB",
    ]
    write(proc / "meminfo", "\n".join(lines) + "\n" + extra)


# --- /sys -------------------------------------------------------------------------------------


def write_sys_cpu(sys: Path, cpu: int, *, package: int, core_cpus: str,
                  l3: tuple[str, str] | None = None) -> None:
    """One /sys/devices/system/cpu/cpuN with topology and, optionally, its L3 (size, shared)."""
    base = sys / "devices" / "system" / "cpu" / f"cpu{cpu}"
    write(base / "topology" / "physical_package_id", f"{package}\n")
    write(base / "topology" / "core_cpus_list", f"{core_cpus}\n")
    # L1d and L2 must be skipped by the L3 reader.
    for index, (level, kind, size) in enumerate([(1, "Data", "48K"), (2, "Unified", "1024K")]):
        cache = base / "cache" / f"index{index}"
        write(cache / "level", f"{level}\n")
        write(cache / "type", f"{kind}\n")
        write(cache / "size", f"{size}\n")
        write(cache / "shared_cpu_list", f"{core_cpus}\n")
    if l3:
        cache = base / "cache" / "index3"
        write(cache / "level", "3\n")
        write(cache / "type", "Unified\n")
        write(cache / "size", f"{l3[0]}\n")
        write(cache / "shared_cpu_list", f"{l3[1]}\n")


def write_node(sys: Path, node: int, *, cpulist: str, memory: int) -> None:
    base = sys / "devices" / "system" / "node" / f"node{node}"
    write(base / "cpulist", f"{cpulist}\n")
    write(
        base / "meminfo",
        f"Node {node} MemTotal:       {memory // KIB} kB\nNode {node} MemFree:        {memory // KIB // 2} kB\n",
    )


def write_cgroup_v2(proc: Path, sys: Path, *, path: str = "/", limits: dict[str, str],
                    current: int | None = None, inactive_file: int = 0) -> None:
    """A pure cgroup v2 system; ``limits`` maps cgroup paths to their memory.max text."""
    write(proc / "self" / "cgroup", f"0::{path}\n")
    write(
        proc / "self" / "mountinfo",
        "22 1 0:21 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n"
        "27 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    root = sys / "fs" / "cgroup"
    write(root / "cgroup.controllers", "cpu memory pids\n")
    for cgroup, limit in limits.items():
        write(root / cgroup.strip("/") / "memory.max", f"{limit}\n")
    own = root / path.strip("/")
    own.mkdir(parents=True, exist_ok=True)
    if current is not None:
        write(own / "memory.current", f"{current}\n")
        write(own / "memory.stat", f"anon {current // 2}\nfile {current // 2}\ninactive_file {inactive_file}\n")


def write_cgroup_v1(proc: Path, sys: Path, *, path: str, mount_root: str, limit: int,
                    usage: int, inactive_file: int = 0, with_stat_limit: bool = True) -> None:
    """A cgroup v1 memory hierarchy mounted (as container runtimes do) at its own subtree."""
    write(proc / "self" / "cgroup", f"12:pids:{path}\n4:memory:{path}\n1:name=systemd:{path}\n")
    write(
        proc / "self" / "mountinfo",
        f"35 31 0:32 {mount_root} /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
        f"32 31 0:29 {mount_root} /sys/fs/cgroup/cpu ro,nosuid - cgroup cgroup rw,cpu\n",
    )
    own = sys / "fs" / "cgroup" / "memory"
    write(own / "memory.limit_in_bytes", f"{limit}\n")
    write(own / "memory.usage_in_bytes", f"{usage}\n")
    stat = f"cache {usage // 2}\nrss {usage // 2}\ntotal_inactive_file {inactive_file}\n"
    if with_stat_limit:
        stat += f"hierarchical_memory_limit {limit}\n"
    write(own / "memory.stat", stat)


# --- machines ------------------------------------------------------------------------------------

EPYC_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat lm constant_tsc "
    "sse sse2 ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c avx2 bmi1 bmi2 "
    "avx_vnni avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi "
    "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq"
)
SPR_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep lm constant_tsc sse sse2 ssse3 fma cx16 "
    "sse4_1 sse4_2 avx f16c avx2 avx_vnni avx512f avx512dq avx512cd avx512bw avx512vl "
    "avx512_bf16 avx512vbmi avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg "
    "avx512_vpopcntdq avx512_fp16 amx_bf16 amx_tile amx_int8 serialize tsxldtrk"
)
NEOVERSE_V2_FEATURES = (
    "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt "
    "fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs "
    "sb paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm "
    "svebf16 i8mm bf16 dgh rng bti"
)


def epyc_two_socket(tmp: Path) -> tuple[Path, Path]:
    """2 × "EPYC 9355", scaled down to 4 cores per socket with SMT: 16 threads, 2 NUMA
    nodes of 192 GiB, two 32 MiB L3 slices per socket. Linux numbering: socket 0 owns
    cpus 0-3 and their siblings 8-11, socket 1 owns 4-7 and 12-15."""
    proc, sys = tmp / "proc", tmp / "sys"
    blocks = []
    for cpu in range(16):
        core = cpu % 8
        socket = core // 4
        blocks.append(
            x86_block(cpu, model="AMD EPYC 9355 32-Core Processor", vendor="AuthenticAMD",
                      physical_id=socket, core_id=core % 4, flags=EPYC_FLAGS, cache_size="1024 KB",
                      siblings=8, cores=4)
        )
        slice_first = (core // 2) * 2
        shared = f"{slice_first}-{slice_first + 1},{slice_first + 8}-{slice_first + 9}"
        write_sys_cpu(sys, cpu, package=socket, core_cpus=f"{core},{core + 8}", l3=("32768K", shared))
    write_cpuinfo(proc, blocks)
    write_meminfo(proc, total=384 * GIB, available=370 * GIB, hugepages=16, hugepage_size=1 * GIB)
    write(sys / "kernel" / "mm" / "transparent_hugepage" / "enabled", "always [madvise] never\n")
    write(sys / "devices" / "system" / "cpu" / "online", "0-15\n")
    write_node(sys, 0, cpulist="0-3,8-11", memory=192 * GIB)
    write_node(sys, 1, cpulist="4-7,12-15", memory=192 * GIB)
    write_cgroup_v2(proc, sys, path="/user.slice/user-1000.slice/session-1.scope",
                    limits={"/user.slice": "max", "/user.slice/user-1000.slice": "max",
                            "/user.slice/user-1000.slice/session-1.scope": "max"})
    return proc, sys


def sapphire_rapids(tmp: Path) -> tuple[Path, Path]:
    """One "Xeon Platinum 8480+", 4 cores with HT, no cache directories in sysfs (as in
    some VMs), so L3 comes from cpuinfo's "cache size"."""
    proc, sys = tmp / "proc", tmp / "sys"
    blocks = []
    for cpu in range(8):
        blocks.append(
            x86_block(cpu, model="Intel(R) Xeon(R) Platinum 8480+", vendor="GenuineIntel",
                      physical_id=0, core_id=cpu % 4, flags=SPR_FLAGS, cache_size="107520 KB",
                      siblings=8, cores=4)
        )
    write_cpuinfo(proc, blocks)
    write_meminfo(proc, total=512 * GIB, available=500 * GIB)
    write_node(sys, 0, cpulist="0-7", memory=512 * GIB)
    return proc, sys


def grace_aarch64(tmp: Path) -> tuple[Path, Path]:
    """Four Neoverse-V2 cores (NVIDIA Grace): no physical id in cpuinfo, topology in sysfs."""
    proc, sys = tmp / "proc", tmp / "sys"
    write_cpuinfo(proc, [arm_block(cpu, features=NEOVERSE_V2_FEATURES) for cpu in range(4)])
    write_meminfo(proc, total=480 * GIB, available=470 * GIB, hugepage_size=512 * MIB)
    for cpu in range(4):
        write_sys_cpu(sys, cpu, package=0, core_cpus=str(cpu), l3=("114M", "0-3"))
    write_node(sys, 0, cpulist="0-3", memory=480 * GIB)
    return proc, sys


# --- a fake NVML -----------------------------------------------------------------------------------


class NVMLError(Exception):
    message = "Unknown Error"

    def __init__(self, value: int = 999):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self.message


class NVMLError_NotSupported(NVMLError):  # noqa: N801 (pynvml's spelling)
    message = "Not Supported"


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    message = "NVML Shared Library Not Found"


class NVMLError_DriverNotLoaded(NVMLError):  # noqa: N801
    message = "Driver Not Loaded"


class NVMLError_InvalidArgument(NVMLError):  # noqa: N801
    message = "Invalid Argument"


@dataclass
class FakeDevice:
    name: str | bytes
    total: int
    free: int
    capability: tuple[int, int]
    uuid: str
    pcie_max: tuple[int, int] = (5, 16)  # generation, width
    pcie_now: tuple[int, int] = (1, 16)  # idle cards train down
    nvlink_active: int | None = None  # None: no NVLink on this card (NotSupported)
    bus_bits: int = 0
    mem_clock_mhz: int = 0
    fail: dict[str, NVMLError] = field(default_factory=dict)


def fake_nvml(devices: list[FakeDevice], *, init_error: NVMLError | None = None) -> Any:
    """A module-like object with pynvml's functions, constants and exception classes.

    ``calls`` records init/shutdown so tests can check that NVML is always shut down.
    """
    calls: list[str] = []
    max_links = 18

    def check(device: FakeDevice, what: str) -> None:
        if what in device.fail:
            raise device.fail[what]

    def init() -> None:
        calls.append("init")
        if init_error is not None:
            raise init_error

    def nvlink_state(handle: FakeDevice, link: int) -> int:
        if link >= max_links:
            raise NVMLError_InvalidArgument(2)
        if handle.nvlink_active is None:
            raise NVMLError_NotSupported(3)
        return 1 if link < handle.nvlink_active else 0

    def memory_info(handle: FakeDevice) -> Any:
        check(handle, "memory")
        return SimpleNamespace(total=handle.total, free=handle.free, used=handle.total - handle.free)

    def get_handle(index: int) -> FakeDevice:
        if not 0 <= index < len(devices):
            raise NVMLError_InvalidArgument(2)
        return devices[index]

    return SimpleNamespace(
        calls=calls,
        NVMLError=NVMLError,
        NVMLError_NotSupported=NVMLError_NotSupported,
        NVMLError_LibraryNotFound=NVMLError_LibraryNotFound,
        NVMLError_DriverNotLoaded=NVMLError_DriverNotLoaded,
        NVMLError_InvalidArgument=NVMLError_InvalidArgument,
        NVML_NVLINK_MAX_LINKS=max_links,
        NVML_FEATURE_ENABLED=1,
        NVML_FEATURE_DISABLED=0,
        NVML_CLOCK_MEM=2,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(devices),
        nvmlDeviceGetHandleByIndex=get_handle,
        nvmlDeviceGetName=lambda h: h.name,
        nvmlDeviceGetUUID=lambda h: h.uuid,
        nvmlDeviceGetMemoryInfo=memory_info,
        nvmlDeviceGetCudaComputeCapability=lambda h: h.capability,
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: h.pcie_max[0],
        nvmlDeviceGetMaxPcieLinkWidth=lambda h: h.pcie_max[1],
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: h.pcie_now[0],
        nvmlDeviceGetCurrPcieLinkWidth=lambda h: h.pcie_now[1],
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlDeviceGetMemoryBusWidth=lambda h: h.bus_bits,
        nvmlDeviceGetMaxClockInfo=lambda h, clock: h.mem_clock_mhz,
    )


H200 = dict(name="NVIDIA H200", total=143_771 * MIB, free=143_000 * MIB, capability=(9, 0),
            uuid="GPU-8a1c0d2e-0000-4000-8000-000000000000", nvlink_active=18)
RTX_PRO_6000 = dict(name=b"NVIDIA RTX PRO 6000 Blackwell Workstation Edition", total=97_887 * MIB,
                    free=97_000 * MIB, capability=(12, 0), uuid="GPU-5f3e9b71-0000-4000-8000-000000000001")


def fake_torch(*, available: bool, devices: list[tuple[str, int, int, tuple[int, int]]] = (),
               hip: str | None = None, cuda: str | None = "12.8") -> Any:
    """A torch-like object for the torch.cuda fallback: devices are (name, total, free, cc)."""

    def props(index: int) -> Any:
        name, total, _, (major, minor) = devices[index]
        return SimpleNamespace(name=name, total_memory=total, major=major, minor=minor)

    return SimpleNamespace(
        __version__="2.13.0",
        version=SimpleNamespace(hip=hip, cuda=cuda),
        cuda=SimpleNamespace(
            is_available=lambda: available,
            device_count=lambda: len(devices),
            get_device_properties=props,
            mem_get_info=lambda index: (devices[index][2], devices[index][1]),
        ),
    )
