"""Host memory: how much there is, how much this process may use, and how fast it can be
read in theory.

* Size and availability from /proc/meminfo (psutil on a non-Linux host).
* The cgroup memory limit, because in a container or a systemd slice the limit, not the
  installed RAM, decides what the planner may promise. Both cgroup v2 and v1 are read,
  resolving the process's own cgroup through /proc/self/cgroup and /proc/self/mountinfo.
* The theoretical DRAM bandwidth from a small table of server and workstation platforms
  (channels × transfer rate × 8 bytes × sockets): the planner's decode-speed upper bound.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

from hybridmoe.backend.hardware.profile import Memory
from hybridmoe.backend.hardware.sysfs import is_host_root, parse_meminfo, read_text

__all__ = [
    "MemoryPlatform",
    "MEMORY_PLATFORMS",
    "CgroupMemory",
    "detect_memory",
    "read_cgroup_memory",
    "theoretical_host_bandwidth",
]

# The kernel writes "unlimited" in cgroup v1 as PAGE_COUNTER_MAX pages (about 2**63 bytes,
# rounded down to a page). Anything this large is no limit at all.
_UNLIMITED_THRESHOLD = 2**60


# --- theoretical bandwidth ------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlatform:
    """A CPU family whose memory system is fixed by the platform.

    ``pattern`` is a case-insensitive regular expression searched in the CPU model name.
    Servers and workstations are described by channels per socket and the highest memory
    speed the platform supports; unified-memory SoCs (Apple) by the vendor's figure.
    """

    pattern: str
    name: str
    channels_per_socket: int | None = None
    megatransfers: int | None = None
    memory_type: str = "DDR5"
    fixed_bytes_per_s: float | None = None
    min_physical_cores: int | None = None  # to tell apart bins with different memory buses

    def bandwidth(self, sockets: int) -> tuple[float, str]:
        if self.fixed_bytes_per_s is not None:
            return self.fixed_bytes_per_s, f"{self.name}: {self.fixed_bytes_per_s / 1e9:,.1f} GB/s (vendor figure)"
        assert self.channels_per_socket and self.megatransfers
        figure = self.channels_per_socket * self.megatransfers * 1e6 * 8 * sockets
        socket_word = "socket" if sockets == 1 else "sockets"
        return figure, (
            f"{self.name}: {sockets} {socket_word} × {self.channels_per_socket} channels × "
            f"{self.memory_type}-{self.megatransfers} × 8 B = {figure / 1e9:,.1f} GB/s "
            "(highest supported memory speed; slower DIMMs or 2 DIMMs per channel give less)"
        )


# First match wins: specific patterns come before general ones.
MEMORY_PLATFORMS: tuple[MemoryPlatform, ...] = (
    # AMD EPYC: the last digit of the model number is the generation.
    MemoryPlatform(r"EPYC 9\d\d5", "AMD EPYC 9005 (Turin)", 12, 6400),
    MemoryPlatform(r"EPYC 9\d\d4", "AMD EPYC 9004 (Genoa)", 12, 4800),
    MemoryPlatform(r"EPYC 8\d\d4", "AMD EPYC 8004 (Siena)", 6, 4800),
    MemoryPlatform(r"EPYC 7\d\d3", "AMD EPYC 7003 (Milan)", 8, 3200, "DDR4"),
    MemoryPlatform(r"EPYC 7\d\d2", "AMD EPYC 7002 (Rome)", 8, 3200, "DDR4"),
    MemoryPlatform(r"EPYC 4\d\d4", "AMD EPYC 4004", 2, 5200),
    # AMD Threadripper: PRO (WX) parts have 8 channels, the others 4.
    MemoryPlatform(r"Threadripper PRO 9\d\d5WX", "AMD Threadripper PRO 9000 WX", 8, 6400),
    MemoryPlatform(r"Threadripper PRO 7\d\d5WX", "AMD Threadripper PRO 7000 WX", 8, 5200),
    MemoryPlatform(r"Threadripper PRO 5\d\d5WX", "AMD Threadripper PRO 5000 WX", 8, 3200, "DDR4"),
    MemoryPlatform(r"Threadripper 9\d\d0X", "AMD Threadripper 9000", 4, 6400),
    MemoryPlatform(r"Threadripper 7\d\d0X", "AMD Threadripper 7000", 4, 5200),
    MemoryPlatform(r"Threadripper PRO 3\d\d5WX", "AMD Threadripper PRO 3000 WX", 8, 3200, "DDR4"),
    MemoryPlatform(r"Threadripper 3\d\d0X", "AMD Threadripper 3000", 4, 3200, "DDR4"),
    MemoryPlatform(r"Ryzen \d+ 9\d\d\d", "AMD Ryzen 9000 (AM5)", 2, 5600),
    MemoryPlatform(r"Ryzen \d+ 7\d\d\d", "AMD Ryzen 7000 (AM5)", 2, 5200),
    MemoryPlatform(r"Ryzen \d+ [35]\d\d\d", "AMD Ryzen 3000/5000 (AM4)", 2, 3200, "DDR4"),
    # Intel Xeon 6: the 6900 series has 12 channels, 6700/6500 have 8 (P and E cores alike).
    MemoryPlatform(r"Xeon.*\b69\d\d[PE]\b", "Intel Xeon 6900 (Granite Rapids-AP)", 12, 6400),
    MemoryPlatform(r"Xeon.*\b6[5-7]\d\d[PE]\b", "Intel Xeon 6700/6500 (Granite Rapids-SP)", 8, 6400),
    # Intel Xeon Scalable: the second digit of the model number is the generation.
    MemoryPlatform(r"Xeon.*(Platinum|Gold|Silver|Bronze) [3-8]5\d\d", "Intel Xeon 5th gen (Emerald Rapids)", 8, 5600),
    MemoryPlatform(r"Xeon.*(Platinum|Gold|Silver|Bronze) [3-8]4\d\d", "Intel Xeon 4th gen (Sapphire Rapids)", 8, 4800),
    MemoryPlatform(r"Xeon.*(Platinum|Gold|Silver) [4-8]3\d\d", "Intel Xeon 3rd gen (Ice Lake)", 8, 3200, "DDR4"),
    MemoryPlatform(r"Xeon.*(Platinum|Gold|Silver|Bronze) [3-8]2\d\d", "Intel Xeon 2nd gen (Cascade Lake)", 6, 2933, "DDR4"),
    MemoryPlatform(r"Xeon.*\bw[3579]-3[45]\d\d", "Intel Xeon W-3400/3500", 8, 4800),
    MemoryPlatform(r"Xeon.*\bw[3579]-2[45]\d\d", "Intel Xeon W-2400/2500", 4, 4800),
    MemoryPlatform(r"Xeon.*\bE5-\d{4} v4", "Intel Xeon E5 v4 (Broadwell-EP)", 4, 2400, "DDR4"),
    MemoryPlatform(r"Xeon.*\bE5-\d{4} v3", "Intel Xeon E5 v3 (Haswell-EP)", 4, 2133, "DDR4"),
    MemoryPlatform(r"Core\(TM\) Ultra \d 2\d\d(K|KF|F)?\b", "Intel Core Ultra 200S (Arrow Lake)", 2, 6400),
    # Desktop Core: the 12th to 14th generations take DDR5 at these speeds (DDR4 boards exist too);
    # the X-series (Cascade Lake-X) has four DDR4 channels.
    MemoryPlatform(r"Core.*\bi[3579]-14\d\d\d", "Intel Core 14th gen (Raptor Lake Refresh)", 2, 5600),
    MemoryPlatform(r"Core.*\bi[3579]-13\d\d\d", "Intel Core 13th gen (Raptor Lake)", 2, 5600),
    MemoryPlatform(r"Core.*\bi[3579]-12\d\d\d", "Intel Core 12th gen (Alder Lake)", 2, 4800),
    MemoryPlatform(r"Core.*\bi[79]-10\d\d\dX", "Intel Core X-series 10th gen (Cascade Lake-X)", 4, 2933, "DDR4"),
    # Apple silicon: one unified memory, quoted by Apple as a single figure. The binned Max
    # parts (fewer CPU cores) have a narrower bus.
    MemoryPlatform(r"Apple M1 Ultra", "Apple M1 Ultra", fixed_bytes_per_s=800e9),
    MemoryPlatform(r"Apple M1 Max", "Apple M1 Max", fixed_bytes_per_s=400e9),
    MemoryPlatform(r"Apple M1 Pro", "Apple M1 Pro", fixed_bytes_per_s=200e9),
    MemoryPlatform(r"Apple M1\b", "Apple M1", fixed_bytes_per_s=68.25e9),
    MemoryPlatform(r"Apple M2 Ultra", "Apple M2 Ultra", fixed_bytes_per_s=800e9),
    MemoryPlatform(r"Apple M2 Max", "Apple M2 Max", fixed_bytes_per_s=400e9),
    MemoryPlatform(r"Apple M2 Pro", "Apple M2 Pro", fixed_bytes_per_s=200e9),
    MemoryPlatform(r"Apple M2\b", "Apple M2", fixed_bytes_per_s=100e9),
    MemoryPlatform(r"Apple M3 Ultra", "Apple M3 Ultra", fixed_bytes_per_s=819e9),
    MemoryPlatform(r"Apple M3 Max", "Apple M3 Max (16-core CPU)", fixed_bytes_per_s=400e9, min_physical_cores=16),
    MemoryPlatform(r"Apple M3 Max", "Apple M3 Max (14-core CPU)", fixed_bytes_per_s=300e9),
    MemoryPlatform(r"Apple M3 Pro", "Apple M3 Pro", fixed_bytes_per_s=150e9),
    MemoryPlatform(r"Apple M3\b", "Apple M3", fixed_bytes_per_s=100e9),
    MemoryPlatform(r"Apple M4 Max", "Apple M4 Max (16-core CPU)", fixed_bytes_per_s=546e9, min_physical_cores=16),
    MemoryPlatform(r"Apple M4 Max", "Apple M4 Max (14-core CPU)", fixed_bytes_per_s=410e9),
    MemoryPlatform(r"Apple M4 Pro", "Apple M4 Pro", fixed_bytes_per_s=273e9),
    MemoryPlatform(r"Apple M4\b", "Apple M4", fixed_bytes_per_s=120e9),
    MemoryPlatform(r"Apple M5\b(?! (Pro|Max|Ultra))", "Apple M5", fixed_bytes_per_s=153e9),
)


# Desktop Ryzen CPUs reach memory through their core dies (CCDs), each over one fabric link
# that reads at most 32 bytes per fabric clock: 64 GB/s at Zen 4/5's usual 2,000 MHz FCLK,
# 57.6 GB/s at Zen 2/3's 1,800 MHz. A one-CCD part (Ryzen 5 and 7) therefore reads less than
# its two DDR5 channels carry (a 7800X3D measures about 64 GB/s of the 83.2 its DDR5-5200 gives).
_CCD_LINK_BYTES_PER_CLOCK = 32
_DESKTOP_RYZEN = re.compile(r"Ryzen (?P<tier>\d+) (?P<gen>[3579])(?P<rest>\d\d\d)(?P<suffix>[A-Z0-9]*)", re.IGNORECASE)


def ccd_read_limit(cpu_model: str | None) -> tuple[float, str] | None:
    """(bytes/s, why) that a desktop Ryzen's core dies can read from memory together, or None
    for every other CPU (server and workstation parts have enough CCDs, APUs have none)."""
    match = _DESKTOP_RYZEN.search(cpu_model or "")
    if not match or "G" in match["suffix"].upper() or "threadripper" in (cpu_model or "").lower():
        return None
    # Ryzen 9 parts (x900, x950) have two CCDs, Ryzen 3/5/7 one.
    ccds = 2 if int(match["tier"]) >= 9 else 1
    fclk_mhz = 2000 if match["gen"] in "79" else 1800
    figure = ccds * _CCD_LINK_BYTES_PER_CLOCK * fclk_mhz * 1e6
    dies = "one CCD" if ccds == 1 else f"{ccds} CCDs"
    return figure, (f"{dies} × 32 B per fabric clock × {fclk_mhz:,} MHz = {figure / 1e9:,.1f} GB/s "
                    "(a desktop Ryzen's core dies read no faster)")


def theoretical_host_bandwidth(
    cpu_model: str | None, sockets: int | None = None, physical_cores: int | None = None, *,
    channels: int | None = None, megatransfers: int | None = None,
) -> tuple[float | None, str]:
    """(bytes/s, how it was derived) for a known platform, else (None, why not).

    ``sockets`` multiplies per-socket figures; when it is unknown one socket is assumed and
    the note says so (an underestimate is safer than a promise). ``physical_cores`` tells
    apart Apple Max bins. ``channels`` (populated DIMM channels, all sockets together) and
    ``megatransfers`` (the DIMMs' MT/s) replace the platform's figures where the machine's
    owner knows them: slower DIMMs, or channels left empty. A desktop Ryzen's figure is at
    most what its CCDs can read (``ccd_read_limit``).
    """
    platform = _platform(cpu_model, physical_cores)
    if channels or megatransfers:
        if platform is not None and platform.fixed_bytes_per_s is not None:
            return platform.bandwidth(1)  # unified memory: the vendor's figure is the machine's
        total_channels = channels or (platform.channels_per_socket * (sockets or 1) if platform and platform.channels_per_socket else None)
        speed = megatransfers or (platform.megatransfers if platform else None)
        if not total_channels or not speed:
            missing = "channels" if not total_channels else "MT/s"
            return None, (f"memory {missing} unknown: the CPU model is not in the memory platform table; "
                          "describe both channels and mts")
        figure = total_channels * speed * 1e6 * 8
        memory_type = platform.memory_type if platform else "DDR"
        return _within_ccds(cpu_model, figure, f"described: {total_channels} channels × {memory_type}-{speed} × 8 B = "
                                                f"{figure / 1e9:,.1f} GB/s")
    if not cpu_model:
        return None, "CPU model unknown, so the memory platform is unknown"
    if platform is None:
        return None, (
            f"CPU model {cpu_model!r} is not in the memory platform table "
            "(channels × speed unknown); describe the machine's bandwidth (or its channels and mts) to plan with it"
        )
    if platform.fixed_bytes_per_s is not None:
        return platform.bandwidth(1)
    figure, note = platform.bandwidth(sockets or 1)
    if sockets is None:
        note += "; socket count unknown, one socket assumed"
    return _within_ccds(cpu_model, figure, note)


def _platform(cpu_model: str | None, physical_cores: int | None) -> MemoryPlatform | None:
    """The first platform of MEMORY_PLATFORMS whose pattern `cpu_model` matches."""
    for platform in MEMORY_PLATFORMS if cpu_model else ():
        if not re.search(platform.pattern, cpu_model, re.IGNORECASE):
            continue
        if platform.min_physical_cores is not None:
            if physical_cores is None or physical_cores < platform.min_physical_cores:
                continue
        return platform
    return None


def _within_ccds(cpu_model: str | None, figure: float, note: str) -> tuple[float, str]:
    """The channels' figure, or what a desktop Ryzen's CCDs can read when that is less."""
    limit = ccd_read_limit(cpu_model)
    if limit is not None and limit[0] < figure:
        return limit[0], f"{limit[1]}, less than the channels' {figure / 1e9:,.1f} GB/s ({note})"
    return figure, note


# --- cgroup limit -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupMemory:
    """This process's cgroup memory facts. ``limit_bytes`` None: no limit anywhere above it."""

    version: int  # 1 or 2
    directory: str  # the cgroup directory that was read, for messages
    limit_bytes: int | None
    used_bytes: int | None  # charged memory minus reclaimable inactive file cache


def _parse_cgroup_entries(text: str) -> list[tuple[str, list[str], str]]:
    """/proc/self/cgroup lines "hierarchy:controllers:path" -> (hierarchy, controllers, path)."""
    entries = []
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/"):
            entries.append((parts[0], [c for c in parts[1].split(",") if c], parts[2]))
    return entries


def _parse_cgroup_mounts(text: str) -> list[tuple[str, str, str, set[str]]]:
    """/proc/self/mountinfo -> (mount point, root inside the hierarchy, fstype, super options)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype = tail[0]
        if fstype in ("cgroup", "cgroup2"):
            mounts.append((fields[4], fields[3], fstype, set(tail[2].split(","))))
    return mounts


def _in_sys_root(mount_point: str, sys_root: Path, on_host: bool) -> Path | None:
    """Where a mount point named in mountinfo lives under ``sys_root`` (fake trees in tests)."""
    if mount_point == "/sys" or mount_point.startswith("/sys/"):
        return sys_root / mount_point[len("/sys/") :]
    return Path(mount_point) if on_host else None


def _cgroup_dir(mount: Path, mount_root: str, cgroup_path: str) -> Path:
    """The directory of our cgroup under a mount of (part of) the hierarchy.

    With a cgroup namespace, or when a container runtime mounts only its own subtree, the
    path in /proc/self/cgroup does not exist under the mount; the mount itself is then our
    cgroup (as far as we can see).
    """
    relative = cgroup_path
    if mount_root != "/" and (cgroup_path == mount_root or cgroup_path.startswith(mount_root + "/")):
        relative = cgroup_path[len(mount_root) :]
    candidate = mount / relative.lstrip("/")
    return candidate if candidate.is_dir() else mount


def _ancestors(directory: Path, mount: Path) -> list[Path]:
    """``directory`` and each parent up to and including ``mount``."""
    chain = [directory]
    while chain[-1] != mount and mount in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _stat_value(directory: Path, key: str) -> int | None:
    for line in (read_text(directory / "memory.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _read_v2(directory: Path, mount: Path) -> CgroupMemory | None:
    limits = []
    seen_controller = False
    # A parent's memory.max applies to every cgroup below it, so the effective limit is
    # the smallest one on the way up.
    for level in _ancestors(directory, mount):
        text = read_text(level / "memory.max")
        if text is None:
            continue
        seen_controller = True
        text = text.strip()
        if text.isdigit() and int(text) < _UNLIMITED_THRESHOLD:
            limits.append(int(text))
    if not seen_controller:
        return None  # memory controller not enabled here (e.g. hybrid v1/v2 systems)
    current = read_text(directory / "memory.current")
    used = None
    if current is not None and current.strip().isdigit():
        used = int(current) - (_stat_value(directory, "inactive_file") or 0)
    return CgroupMemory(2, str(directory), min(limits) if limits else None, used)


def _read_v1(directory: Path, mount: Path) -> CgroupMemory | None:
    # hierarchical_memory_limit already is the minimum over the ancestors.
    limit = _stat_value(directory, "hierarchical_memory_limit")
    if limit is None:
        values = []
        for level in _ancestors(directory, mount):
            text = (read_text(level / "memory.limit_in_bytes") or "").strip()
            if text.isdigit():
                values.append(int(text))
        if not values:
            return None
        limit = min(values)
    usage = (read_text(directory / "memory.usage_in_bytes") or "").strip()
    used = None
    if usage.isdigit():
        used = int(usage) - (_stat_value(directory, "total_inactive_file") or 0)
    return CgroupMemory(1, str(directory), limit if limit < _UNLIMITED_THRESHOLD else None, used)


def read_cgroup_memory(
    proc_root: str | os.PathLike[str] = "/proc", sys_root: str | os.PathLike[str] = "/sys"
) -> tuple[CgroupMemory | None, str | None]:
    """This process's cgroup memory limit and use: (facts, None) or (None, why unknown).

    (None, None) means cgroups are readable but no memory controller applies: no limit.
    """
    proc, sys_path = Path(proc_root), Path(sys_root)
    on_host = is_host_root(proc_root, "/proc") and is_host_root(sys_root, "/sys")
    cgroup_text = read_text(proc / "self" / "cgroup")
    if cgroup_text is None:
        return None, f"{proc}/self/cgroup is missing (not Linux, or /proc not mounted)"
    entries = _parse_cgroup_entries(cgroup_text)
    if not entries:
        return None, f"{proc}/self/cgroup lists no cgroup"
    mounts = _parse_cgroup_mounts(read_text(proc / "self" / "mountinfo") or "")

    v2_path = next((path for hierarchy, controllers, path in entries if hierarchy == "0" and not controllers), None)
    v1_path = next((path for _, controllers, path in entries if "memory" in controllers), None)

    if v2_path is not None:
        v2_mounts = [(m, root) for m, root, fstype, _ in mounts if fstype == "cgroup2"]
        if not mounts:  # no mountinfo: the usual places for a v2 (or hybrid) mount
            v2_mounts = [("/sys/fs/cgroup", "/"), ("/sys/fs/cgroup/unified", "/")]
        for mount_point, root in v2_mounts:
            mount = _in_sys_root(mount_point, sys_path, on_host)
            if mount is None or not mount.is_dir():
                continue
            facts = _read_v2(_cgroup_dir(mount, root, v2_path), mount)
            if facts is not None:
                return facts, None

    if v1_path is not None:
        v1_mounts = [(m, root) for m, root, fstype, opts in mounts if fstype == "cgroup" and "memory" in opts]
        if not mounts:
            v1_mounts = [("/sys/fs/cgroup/memory", "/")]
        for mount_point, root in v1_mounts:
            mount = _in_sys_root(mount_point, sys_path, on_host)
            if mount is None or not mount.is_dir():
                continue
            facts = _read_v1(_cgroup_dir(mount, root, v1_path), mount)
            if facts is not None:
                return facts, None
        return None, f"this process is in memory cgroup {v1_path!r} but its files under {sys_path}/fs/cgroup are unreadable"

    return None, None


# --- putting it together ---------------------------------------------------------------------


def read_transparent_hugepages(sys_root: str | os.PathLike[str] = "/sys") -> tuple[str | None, str]:
    """The transparent huge pages mode, the bracketed word of "always [madvise] never", or
    None and why not."""
    path = Path(sys_root) / "kernel" / "mm" / "transparent_hugepage" / "enabled"
    text = read_text(path)
    if text is None:
        return None, f"{path} is missing or unreadable"
    chosen = re.search(r"\[(\w+)\]", text)
    return (chosen.group(1), "") if chosen else (None, f"no [mode] in {path}: {text.strip()!r}")


def detect_memory(
    proc_root: str | os.PathLike[str] = "/proc",
    sys_root: str | os.PathLike[str] = "/sys",
    *,
    cpu_model: str | None = None,
    sockets: int | None = None,
    physical_cores: int | None = None,
) -> tuple[Memory, dict[str, str]]:
    """Host memory facts and ``{"memory.<field>": reason}`` for what is unknown.

    The CPU facts select the theoretical bandwidth; the measured one is the probe's
    business (``hybridmoe.backend.hardware.bandwidth``) and is left None here.
    """
    unknown: dict[str, str] = {}
    on_host = is_host_root(proc_root, "/proc")
    meminfo_path = Path(proc_root) / "meminfo"
    meminfo_text = read_text(meminfo_path)
    meminfo = parse_meminfo(meminfo_text) if meminfo_text is not None else {}
    source = str(meminfo_path)
    if meminfo_text is None and on_host:
        # No /proc/meminfo on macOS and the BSDs; psutil knows their way.
        try:
            vm = psutil.virtual_memory()
            meminfo = {"MemTotal": vm.total, "MemAvailable": vm.available}
            source = "psutil"
        except Exception as error:  # psutil raises assorted OS-specific errors
            unknown["memory.total_bytes"] = f"psutil.virtual_memory failed: {error}"

    def fact(key: str, field: str) -> int | None:
        if key in meminfo:
            return meminfo[key]
        if meminfo_text is None and source != "psutil":
            reason = f"{meminfo_path} is missing or unreadable"
        else:
            reason = f"no {key} line in {source}"
        unknown.setdefault(f"memory.{field}", reason)
        return None

    total = fact("MemTotal", "total_bytes")
    available = fact("MemAvailable", "available_bytes")
    hugepages_total = hugepage_size = thp = None
    if source != "psutil":
        hugepages_total = fact("HugePages_Total", "hugepages_total")
        hugepage_size = fact("Hugepagesize", "hugepage_size_bytes")
        thp, thp_reason = read_transparent_hugepages(sys_root)
        if thp is None:
            unknown["memory.transparent_hugepages"] = thp_reason

    cgroup, cgroup_reason = read_cgroup_memory(proc_root, sys_root)
    limit = cgroup.limit_bytes if cgroup else None
    if cgroup_reason and not (on_host and sys.platform == "darwin"):
        unknown["memory.cgroup_limit_bytes"] = cgroup_reason
    if cgroup and limit is not None and cgroup.used_bytes is not None:
        # MemAvailable is the host's view; inside a limit only the headroom under the
        # limit is really available to us.
        headroom = max(limit - cgroup.used_bytes, 0)
        available = headroom if available is None else min(available, headroom)

    theoretical, note = theoretical_host_bandwidth(cpu_model, sockets, physical_cores)
    if theoretical is None:
        unknown["memory.bandwidth_theoretical_bytes_per_s"] = note

    memory = Memory(
        total_bytes=total,
        available_bytes=available,
        cgroup_limit_bytes=limit,
        hugepages_total=hugepages_total,
        hugepage_size_bytes=hugepage_size,
        transparent_hugepages=thp,
        bandwidth_theoretical_bytes_per_s=theoretical,
        bandwidth_note=note if theoretical is not None else None,
    )
    return memory, unknown
