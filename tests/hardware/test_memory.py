"""Host memory: /proc/meminfo, cgroup v1/v2 limits, and the theoretical bandwidth table."""

from __future__ import annotations

import pytest

from hybridmoe.backend.hardware.memory import detect_memory, read_cgroup_memory, theoretical_host_bandwidth
from tests.hardware.fakes import (
    GIB,
    epyc_two_socket,
    write,
    write_cgroup_v1,
    write_cgroup_v2,
    write_cpuinfo,
    write_meminfo,
    x86_block,
)


def test_two_epyc_9355_sockets_are_1228_8_gb_per_s():
    figure, note = theoretical_host_bandwidth("AMD EPYC 9355 32-Core Processor", sockets=2)
    assert figure == pytest.approx(1_228.8e9)  # 24 channels × 6400 MT/s × 8 B
    assert "2 sockets × 12 channels × DDR5-6400" in note


@pytest.mark.parametrize(
    "model, sockets, cores, expected",
    [
        ("AMD EPYC 9654 96-Core Processor", 1, 96, 12 * 4800e6 * 8),
        ("AMD EPYC 9575F 64-Core Processor", 2, 128, 2 * 12 * 6400e6 * 8),
        ("Intel(R) Xeon(R) 6980P", 2, 256, 2 * 12 * 6400e6 * 8),
        ("Intel(R) Xeon(R) 6767P", 1, 64, 8 * 6400e6 * 8),
        ("Intel(R) Xeon(R) Platinum 8480+", 2, 112, 2 * 8 * 4800e6 * 8),
        ("INTEL(R) XEON(R) PLATINUM 8592+", 1, 64, 8 * 5600e6 * 8),
        ("AMD Ryzen Threadripper PRO 7995WX 96-Cores", 1, 96, 8 * 5200e6 * 8),
        ("AMD Ryzen Threadripper 7980X 64-Cores", 1, 64, 4 * 5200e6 * 8),
        ("Apple M2 Ultra", 1, 24, 800e9),
        ("Apple M4 Max", 1, 16, 546e9),
        ("Apple M4 Max", 1, 14, 410e9),
        ("Apple M4", 1, 10, 120e9),
    ],
)
def test_platform_table(model, sockets, cores, expected):
    figure, _ = theoretical_host_bandwidth(model, sockets, cores)
    assert figure == pytest.approx(expected)


def test_unknown_platform_and_unknown_sockets_say_why():
    figure, reason = theoretical_host_bandwidth("AMD EPYC", 1)
    assert figure is None and "not in the memory platform table" in reason
    figure, reason = theoretical_host_bandwidth(None)
    assert figure is None and "CPU model unknown" in reason
    figure, note = theoretical_host_bandwidth("AMD EPYC 9355 32-Core Processor")
    assert figure == pytest.approx(614.4e9) and "one socket assumed" in note


def test_meminfo_hugepages_and_no_cgroup_limit(tmp_path):
    proc, sys = epyc_two_socket(tmp_path)
    memory, unknown = detect_memory(proc, sys, cpu_model="AMD EPYC 9355 32-Core Processor", sockets=2)
    assert memory.total_bytes == 384 * GIB
    assert memory.available_bytes == 370 * GIB
    assert (memory.hugepages_total, memory.hugepage_size_bytes) == (16, GIB)
    assert memory.transparent_hugepages == "madvise"
    assert memory.cgroup_limit_bytes is None  # every level says "max"
    assert memory.usable_bytes == 384 * GIB
    assert memory.bandwidth_bytes_per_s == pytest.approx(1_228.8e9)
    assert "DDR5-6400" in memory.bandwidth_note
    assert unknown == {}


def _container(tmp_path):
    """A container: /proc present, /sys holds nothing but its cgroup."""
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    write_cpuinfo(proc, [x86_block(0, model="AMD EPYC 9355 32-Core Processor", vendor="AuthenticAMD",
                                   physical_id=0, core_id=0, flags="lm avx2", cache_size="1024 KB",
                                   siblings=1, cores=1)])
    write_meminfo(proc, total=64 * GIB, available=60 * GIB)
    return proc, sys


def test_cgroup_v2_limit_below_ram_is_what_is_usable(tmp_path):
    proc, sys = _container(tmp_path)
    write_cgroup_v2(proc, sys, path="/", limits={"/": str(8 * GIB)}, current=3 * GIB, inactive_file=1 * GIB)
    memory, unknown = detect_memory(proc, sys)
    assert memory.cgroup_limit_bytes == 8 * GIB
    assert memory.usable_bytes == 8 * GIB
    # 3 GiB charged of which 1 GiB is reclaimable file cache: 6 GiB of headroom, not 60.
    assert memory.available_bytes == 6 * GIB
    assert "memory.cgroup_limit_bytes" not in unknown


def test_cgroup_v2_parent_limit_applies_to_children(tmp_path):
    proc, sys = _container(tmp_path)
    write_cgroup_v2(proc, sys, path="/work.slice/job.scope",
                    limits={"/work.slice": str(16 * GIB), "/work.slice/job.scope": "max"})
    cgroup, reason = read_cgroup_memory(proc, sys)
    assert reason is None and cgroup.version == 2
    assert cgroup.limit_bytes == 16 * GIB
    assert cgroup.directory.endswith("job.scope")


def test_cgroup_v2_namespaced_path_falls_back_to_the_mount(tmp_path):
    """With a cgroup namespace the host path from /proc/self/cgroup is not under the mount."""
    proc, sys = _container(tmp_path)
    write_cgroup_v2(proc, sys, path="/", limits={"/": str(4 * GIB)})
    write(proc / "self" / "cgroup", "0::/kubepods/pod1234/container\n")
    cgroup, _ = read_cgroup_memory(proc, sys)
    assert cgroup.limit_bytes == 4 * GIB


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    proc, sys = _container(tmp_path)
    write_cgroup_v1(proc, sys, path="/docker/abc123", mount_root="/docker/abc123",
                    limit=12 * GIB, usage=5 * GIB, inactive_file=2 * GIB)
    memory, _ = detect_memory(proc, sys)
    assert memory.cgroup_limit_bytes == 12 * GIB
    assert memory.usable_bytes == 12 * GIB
    assert memory.available_bytes == 9 * GIB

    write_cgroup_v1(proc, sys, path="/docker/abc123", mount_root="/docker/abc123",
                    limit=9223372036854771712, usage=5 * GIB, with_stat_limit=False)
    memory, unknown = detect_memory(proc, sys)
    assert memory.cgroup_limit_bytes is None
    assert memory.available_bytes == 60 * GIB
    assert "memory.cgroup_limit_bytes" not in unknown


def test_odd_meminfo_and_no_cgroup_information(tmp_path):
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    write(proc / "meminfo", "MemTotal:  1000 kB\nnonsense line\nMemAvailable: lots kB\nHugePages_Total: x\n")
    memory, unknown = detect_memory(proc, sys)
    assert memory.total_bytes == 1000 * 1024
    assert memory.available_bytes is None and "MemAvailable" in unknown["memory.available_bytes"]
    assert memory.hugepages_total is None and "memory.hugepages_total" in unknown
    assert memory.cgroup_limit_bytes is None and "self/cgroup" in unknown["memory.cgroup_limit_bytes"]
    assert "CPU model unknown" in unknown["memory.bandwidth_theoretical_bytes_per_s"]

    memory, unknown = detect_memory(tmp_path / "nothing", sys)
    assert memory.total_bytes is None and "missing or unreadable" in unknown["memory.total_bytes"]


def test_transparent_huge_pages_off_is_shown_with_what_to_do(tmp_path):
    from hybridmoe.app.render import hardware_text
    from hybridmoe.backend.hardware.profile import HardwareProfile

    proc, sys = epyc_two_socket(tmp_path)
    write(sys / "kernel" / "mm" / "transparent_hugepage" / "enabled", "always madvise [never]\n")
    memory, unknown = detect_memory(proc, sys)
    assert memory.transparent_hugepages == "never" and "memory.transparent_hugepages" not in unknown
    text = hardware_text(HardwareProfile(memory=memory))
    assert "transparent huge pages  never: the CPU reads its weights and KV cache in 4 KiB pages" in text
    assert "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled" in text

    write(sys / "kernel" / "mm" / "transparent_hugepage" / "enabled", "[always] madvise never\n")
    memory, _ = detect_memory(proc, sys)
    assert "transparent huge pages  always (the CPU's weights and KV cache use them)" in hardware_text(
        HardwareProfile(memory=memory))

    (sys / "kernel" / "mm" / "transparent_hugepage" / "enabled").unlink()
    memory, unknown = detect_memory(proc, sys)
    assert memory.transparent_hugepages is None
    assert "transparent_hugepage/enabled is missing" in unknown["memory.transparent_hugepages"]
    assert "transparent huge pages" not in hardware_text(HardwareProfile(memory=memory))
