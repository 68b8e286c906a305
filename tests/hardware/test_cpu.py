"""CPU detection on fake /proc and /sys trees of real machine types."""

from __future__ import annotations

from hybridmoe.backend.hardware.cpu import detect_cpu
from hybridmoe.backend.hardware.cpu_kernels import native_kernel_set
from tests.hardware.fakes import (
    GIB,
    MIB,
    epyc_two_socket,
    grace_aarch64,
    sapphire_rapids,
    write,
    write_cpuinfo,
    write_sys_cpu,
    x86_block,
)


def test_two_socket_epyc_with_avx512_and_two_numa_nodes(tmp_path):
    proc, sys = epyc_two_socket(tmp_path)
    cpu, unknown = detect_cpu(proc, sys)

    assert unknown == {}
    assert cpu.model_name == "AMD EPYC 9355 32-Core Processor"
    assert cpu.arch == "x86_64"
    assert (cpu.sockets, cpu.physical_cores, cpu.threads) == (2, 8, 16)
    assert set(cpu.features) == {
        "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
        "avx512vbmi", "avx512_bitalg", "gfni",
    }
    assert not any(f.startswith("amx") for f in cpu.features)
    assert native_kernel_set(cpu.features) == "avx512"
    assert [n.id for n in cpu.numa_nodes] == [0, 1]
    assert cpu.numa_nodes[0].cpus == (0, 1, 2, 3, 8, 9, 10, 11)
    assert cpu.numa_nodes[1].cpus == (4, 5, 6, 7, 12, 13, 14, 15)
    assert [n.memory_total_bytes for n in cpu.numa_nodes] == [192 * GIB, 192 * GIB]
    # Four distinct 32 MiB slices across both sockets, each counted once.
    assert cpu.l3_bytes == 4 * 32 * MIB


def test_sapphire_rapids_with_amx_and_l3_from_cpuinfo(tmp_path):
    proc, sys = sapphire_rapids(tmp_path)
    cpu, unknown = detect_cpu(proc, sys)

    assert cpu.model_name == "Intel(R) Xeon(R) Platinum 8480+"
    assert (cpu.sockets, cpu.physical_cores, cpu.threads) == (1, 4, 8)
    for feature in ("amx_tile", "amx_int8", "amx_bf16", "avx512_fp16", "avx512_bf16", "avx512_vnni", "avx_vnni"):
        assert feature in cpu.features
    assert native_kernel_set(cpu.features) == "avx512"  # the AMX set decodes with the AVX-512 set's kernels
    # No cache directories in this sysfs: Intel's cpuinfo "cache size" is the package L3.
    assert cpu.l3_bytes == 107520 * 1024
    assert "cpu.l3_bytes" not in unknown
    assert len(cpu.numa_nodes) == 1


def test_aarch64_neoverse_with_sve_from_sysfs_topology(tmp_path):
    proc, sys = grace_aarch64(tmp_path)
    cpu, unknown = detect_cpu(proc, sys)

    assert cpu.arch == "aarch64"
    assert cpu.model_name == "ARM Neoverse-V2"
    assert set(cpu.features) == {"neon", "dotprod", "i8mm", "bf16", "sve", "sve2"}
    assert native_kernel_set(cpu.features) == "portable"
    # No "physical id" on Arm: sockets and cores come from sysfs.
    assert (cpu.sockets, cpu.physical_cores, cpu.threads) == (1, 4, 4)
    assert cpu.l3_bytes == 114 * MIB
    assert unknown == {}


def test_hybrid_cores_report_only_common_features(tmp_path):
    """A kernel may run on any thread, so a flag one core lacks is not a feature."""
    proc = tmp_path / "proc"
    blocks = [
        x86_block(0, model="Hybrid", vendor="GenuineIntel", physical_id=0, core_id=0,
                  flags="lm avx2 fma avx_vnni avx512f", cache_size="30720 KB", siblings=2, cores=2),
        x86_block(1, model="Hybrid", vendor="GenuineIntel", physical_id=0, core_id=1,
                  flags="lm avx2 fma avx_vnni", cache_size="30720 KB", siblings=2, cores=2),
    ]
    write_cpuinfo(proc, blocks)
    cpu, _ = detect_cpu(proc, tmp_path / "sys")
    assert cpu.features == ("avx2", "fma", "avx_vnni")


def test_odd_cpuinfo_gives_reasons_not_exceptions(tmp_path):
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    write(
        proc / "cpuinfo",
        "garbage without a colon\n@@@@\n\nprocessor\t: 0\nvendor_id : AuthenticAMD\n"
        "\nprocessor\t: 1\n: value without key\ncache size : lots\n\nprocessor : not-a-number\n",
    )
    cpu, unknown = detect_cpu(proc, sys)

    assert cpu.threads == 2  # the two numbered processor blocks
    assert cpu.model_name is None and "model name" in unknown["cpu.model_name"]
    assert cpu.arch is None and "cpu.arch" in unknown
    assert cpu.sockets is None and "physical id" in unknown["cpu.sockets"]
    assert cpu.physical_cores is None and "core id" in unknown["cpu.physical_cores"]
    assert cpu.features == () and "flags" in unknown["cpu.features"]
    assert cpu.numa_nodes == () and "node" in unknown["cpu.numa_nodes"]
    assert cpu.l3_bytes is None and "cpu.l3_bytes" in unknown


def test_missing_and_binary_cpuinfo(tmp_path):
    cpu, unknown = detect_cpu(tmp_path / "proc", tmp_path / "sys")
    assert cpu.threads is None
    assert "missing or unreadable" in unknown["cpu.model_name"]

    write(tmp_path / "proc" / "cpuinfo", b"\xff\xfe\x00binary")
    cpu, unknown = detect_cpu(tmp_path / "proc", tmp_path / "sys")
    assert "missing or unreadable" in unknown["cpu.threads"]


def test_corrupt_sysfs_lists_are_reported(tmp_path):
    proc, sys = grace_aarch64(tmp_path)
    write(sys / "devices" / "system" / "node" / "node0" / "cpulist", "0-x\n")
    write_sys_cpu(sys, 3, package=0, core_cpus="garbage")
    cpu, unknown = detect_cpu(proc, sys)
    assert "unreadable" in unknown["cpu.numa_nodes"]
    assert cpu.numa_nodes[0].memory_total_bytes == 480 * GIB
    # One CPU's sibling list is unreadable, so sysfs cannot be trusted for the core count.
    assert cpu.physical_cores is None and "cpu.physical_cores" in unknown


def test_macos_through_sysctl():
    values = {
        "machdep.cpu.brand_string": "Apple M3 Max",
        "hw.optional.arm64": "1",
        "hw.packages": "1",
        "hw.physicalcpu": "16",
        "hw.logicalcpu": "16",
        "hw.optional.neon": "1",
        "hw.optional.arm.FEAT_DotProd": "1",
        "hw.optional.arm.FEAT_BF16": "1",
        "hw.optional.arm.FEAT_SVE": "0",
    }
    cpu, unknown = detect_cpu(sysctl=values.get)
    assert cpu.model_name == "Apple M3 Max" and cpu.arch == "arm64"
    assert (cpu.physical_cores, cpu.threads) == (16, 16)
    assert cpu.features == ("neon", "dotprod", "bf16")
    assert "no L3" in unknown["cpu.l3_bytes"]


def test_an_intel_mac_through_sysctl_reports_what_the_avx2_kernels_need():
    values = {
        "machdep.cpu.brand_string": "Intel(R) Xeon(R) W-3245 CPU @ 3.20GHz",
        "hw.machine": "x86_64",
        "hw.packages": "1",
        "hw.physicalcpu": "16",
        "hw.logicalcpu": "32",
        "hw.optional.avx2_0": "1",
        "hw.optional.fma": "1",
        "hw.optional.f16c": "1",
        "hw.optional.avx512f": "1",
        "hw.optional.avx512bw": "1",
        "hw.optional.avx512vl": "1",
        "hw.optional.avx512dq": "1",
        "hw.optional.avx512vbmi": "0",
    }
    cpu, _ = detect_cpu(sysctl=values.get)
    assert cpu.features == ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq")
    assert native_kernel_set(cpu.features) == "avx2"
