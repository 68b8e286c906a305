"""detect() as a whole: fake machines end to end, the real machine, the probe, the disk."""

from __future__ import annotations

import json
import os
import sys

import pytest

from hybridmoe.backend.hardware import HardwareProfile, detect
from hybridmoe.backend.hardware import gpu as gpu_module
from hybridmoe.backend.hardware.bandwidth import HOST_PROBES, measure_host_read_bandwidth, probe_buffer_bytes, probe_threads
from hybridmoe.backend.hardware.disk import detect_disk
from tests.hardware.fakes import (
    GIB,
    H200,
    MIB,
    FakeDevice,
    NVMLError_LibraryNotFound,
    epyc_two_socket,
    fake_nvml,
    fake_torch,
    write,
)


@pytest.fixture(autouse=True)
def no_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_detect_a_fake_epyc_with_two_h200(tmp_path):
    proc, sys = epyc_two_socket(tmp_path)
    nvml = fake_nvml([FakeDevice(**H200), FakeDevice(**{**H200, "uuid": "GPU-2"})])
    profile = detect(measure_bandwidth=False, model_dir=tmp_path / "models" / "not-yet", proc_root=proc,
                     sys_root=sys, dev_root=tmp_path / "dev", nvml=nvml)

    assert profile.cpu.sockets == 2 and len(profile.cpu.numa_nodes) == 2
    assert profile.memory.bandwidth_bytes_per_s == pytest.approx(1_228.8e9)
    assert [g.nvlink_links for g in profile.served_gpus] == [18, 18]
    assert profile.disk.path.endswith("not-yet") and profile.disk.free_bytes > 0
    assert profile.unknown == {"memory.bandwidth_measured_bytes_per_s": "bandwidth probe not run (opted out)"}
    assert HardwareProfile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_detect_survives_an_empty_machine(tmp_path, monkeypatch):
    """No /proc, no /sys, no NVML, no torch: a profile of unknowns, each with a reason."""
    monkeypatch.setattr(gpu_module, "_import_torch", lambda: fake_torch(available=False, cuda=None))
    write(tmp_path / "proc" / "cpuinfo", "processor : 0\nthis is : not\n\ngarbage\n")
    write(tmp_path / "dev" / "nvidiactl", "")  # so that the (fake) torch fallback is asked
    profile = detect(measure_bandwidth=False, model_dir=tmp_path, proc_root=tmp_path / "proc",
                     sys_root=tmp_path / "sys", dev_root=tmp_path / "dev",
                     nvml=fake_nvml([], init_error=NVMLError_LibraryNotFound(12)))
    assert profile.gpus == ()
    assert "no CUDA support" in profile.unknown["gpus"]
    for fact in ("cpu.model_name", "cpu.features", "memory.total_bytes", "memory.cgroup_limit_bytes",
                 "memory.bandwidth_theoretical_bytes_per_s", "gpus"):
        assert profile.unknown[fact], fact
    assert profile.memory.bandwidth_bytes_per_s is None


def test_a_detector_bug_costs_only_its_part(tmp_path, monkeypatch):
    import hybridmoe.backend.hardware as hardware

    def broken(*args, **kwargs):
        raise KeyError("surprise")

    monkeypatch.setattr(hardware, "detect_cpu", broken)
    profile = detect(measure_bandwidth=False, model_dir=tmp_path, proc_root=tmp_path, sys_root=tmp_path,
                     dev_root=tmp_path, nvml=fake_nvml([FakeDevice(**H200)]))
    assert "KeyError" in profile.unknown["cpu"]
    assert len(profile.gpus) == 1


def test_detect_on_this_machine(tmp_path):
    """The real thing: must succeed on any CI box, GPU or not."""
    profile = detect(measure_bandwidth=False, model_dir=tmp_path)
    assert profile.cpu.threads and profile.cpu.threads >= 1
    assert profile.memory.total_bytes and profile.memory.total_bytes > 256 * MIB
    assert profile.memory.usable_bytes <= profile.memory.total_bytes
    assert profile.disk.free_bytes > 0
    if not profile.served_gpus:
        assert profile.unknown["gpus"]  # says why there is none
    json.dumps(profile.to_dict())


def test_bandwidth_probe_with_a_tiny_buffer():
    measured = measure_host_read_bandwidth(buffer_bytes=4 * MIB, threads=1, passes=2)
    assert 1e8 < measured < 1e13


def test_bandwidth_probe_needs_no_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes "import torch" raise ImportError
    assert measure_host_read_bandwidth(buffer_bytes=1 * MIB, passes=1) > 0


def test_detect_wires_the_probe_to_the_cpu_facts(tmp_path, monkeypatch):
    import hybridmoe.backend.hardware as hardware

    asked = {}

    def fake_probe(*, buffer_bytes, threads, probes):
        asked.update(buffer_bytes=buffer_bytes, threads=threads, probes=probes)
        return 123e9

    monkeypatch.setattr(hardware, "measure_host_read_bandwidth", fake_probe)
    proc, sys_root = epyc_two_socket(tmp_path)
    profile = detect(model_dir=tmp_path, proc_root=proc, sys_root=sys_root,
                     dev_root=tmp_path / "dev", nvml=fake_nvml([]))
    assert profile.memory.bandwidth_measured_bytes_per_s == 123e9
    assert asked["buffer_bytes"] == 512 * MIB  # 4 × 128 MiB of L3
    assert asked["threads"] == min(8, len(os.sched_getaffinity(0)))
    # Several probes, the best kept, and the profile says so (a bound from one probe taken at
    # a noisy moment once promised 34 tokens/s for a model the engine decoded at 50).
    assert asked["probes"] == HOST_PROBES > 1
    assert profile.memory.bandwidth_measured_note == f"best of {HOST_PROBES} probes 0.1 s apart"
    # The theoretical figure is still the one planned with; the measured one is reported.
    assert profile.memory.bandwidth_bytes_per_s == pytest.approx(1_228.8e9)

    def failing_probe(**_):
        raise MemoryError("no room")

    monkeypatch.setattr(hardware, "measure_host_read_bandwidth", failing_probe)
    profile = detect(model_dir=tmp_path, proc_root=proc, sys_root=sys_root,
                     dev_root=tmp_path / "dev", nvml=fake_nvml([]))
    assert "MemoryError" in profile.unknown["memory.bandwidth_measured_bytes_per_s"]


def test_probe_sizing():
    assert probe_buffer_bytes(32 * MIB, 24 * GIB) == 256 * MIB  # floor
    assert probe_buffer_bytes(512 * MIB, 1024 * GIB) == 2 * GIB  # 4 × L3
    assert probe_buffer_bytes(2 * GIB, 1024 * GIB) == 4 * GIB  # ceiling
    assert probe_buffer_bytes(None, 512 * MIB) == 128 * MIB  # a quarter of what is free
    assert 1 <= probe_threads(10_000) <= len(os.sched_getaffinity(0))
    assert probe_threads(1) == 1


def test_disk_walks_up_to_an_existing_parent(tmp_path):
    disk, unknown = detect_disk(tmp_path / "a" / "b" / "c")
    assert disk.path == str(tmp_path / "a" / "b" / "c")
    assert disk.free_bytes > 0 and disk.total_bytes >= disk.free_bytes and unknown == {}


def test_the_bandwidth_is_read_once_per_process(monkeypatch):
    """Every plan of a process rests on one probe reading (each screen once showed its own
    speed); a new reading only when asked (the Hardware screen's Ctrl+D)."""
    from hybridmoe.backend import hardware

    readings = iter([50e9, 60e9, 70e9])
    monkeypatch.setattr(hardware, "measure_host_read_bandwidth", lambda **_: next(readings))
    monkeypatch.setattr(hardware, "_probe_reading", None)
    first = detect(nvml=fake_nvml([]))
    again = detect(nvml=fake_nvml([]))
    assert first.memory.bandwidth_measured_bytes_per_s == again.memory.bandwidth_measured_bytes_per_s == 50e9
    assert "measured once in this process" in again.memory.bandwidth_measured_note
    assert detect(nvml=fake_nvml([]), remeasure=True).memory.bandwidth_measured_bytes_per_s == 60e9
    assert detect(nvml=fake_nvml([])).memory.bandwidth_measured_bytes_per_s == 60e9
