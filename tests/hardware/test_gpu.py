"""GPU detection through a fake NVML module, the torch.cuda fallback, and other vendors."""

from __future__ import annotations

import pytest

from hybridmoe.backend.hardware import gpu as gpu_module
from hybridmoe.backend.hardware.gpu import detect_gpus, theoretical_gpu_bandwidth
from tests.hardware.fakes import (
    GIB,
    H200,
    MIB,
    RTX_PRO_6000,
    FakeDevice,
    NVMLError,
    NVMLError_DriverNotLoaded,
    NVMLError_LibraryNotFound,
    fake_nvml,
    fake_torch,
    write,
)

LINUX = dict(env={}, system="linux", machine="x86_64")


@pytest.fixture
def no_rocm(tmp_path):
    """No ROCm in sysfs; /dev has the NVIDIA control node, so torch.cuda is worth asking."""
    write(tmp_path / "dev" / "nvidiactl", "")
    return dict(sys_root=tmp_path / "sys", dev_root=tmp_path / "dev")


def test_two_gpus_with_nvlink_and_pcie_facts(no_rocm):
    nvml = fake_nvml([FakeDevice(**H200), FakeDevice(**RTX_PRO_6000)])
    gpus, unknown = detect_gpus(nvml, **LINUX, **no_rocm)

    assert unknown == {}
    assert nvml.calls == ["init", "shutdown"]
    h200, rtx = gpus
    assert (h200.index, h200.name, h200.vendor, h200.source) == (0, "NVIDIA H200", "nvidia", "nvml")
    assert h200.total_bytes == 143_771 * MIB and h200.free_bytes == 143_000 * MIB
    assert h200.compute_capability == (9, 0)
    assert h200.nvlink_links == 18
    assert h200.memory_bandwidth_bytes_per_s == 4.8e12
    # Planned with the link's maximum; the idle card's current Gen1 is only reported.
    assert (h200.pcie_generation, h200.pcie_width) == (5, 16)
    assert (h200.pcie_generation_current, h200.pcie_width_current) == (1, 16)
    assert h200.pcie_bandwidth_bytes_per_s == pytest.approx(63.0e9, rel=0.01)

    assert rtx.name == "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"  # bytes decoded
    assert rtx.nvlink_links == 0  # NotSupported means no NVLink, not an error
    assert rtx.compute_capability == (12, 0)
    assert rtx.memory_bandwidth_bytes_per_s == 1.792e12
    assert all(g.served for g in gpus)


def test_unknown_card_bandwidth_from_bus_width_and_memory_clock(no_rocm):
    card = FakeDevice(name="NVIDIA Future GPU", total=80 * GIB, free=80 * GIB, capability=(10, 0),
                      uuid="GPU-1", bus_bits=5120, mem_clock_mhz=2619)
    (gpu,), _ = detect_gpus(fake_nvml([card]), **LINUX, **no_rocm)
    assert gpu.memory_bandwidth_bytes_per_s == pytest.approx(3.352e12, rel=1e-3)


def test_a_failing_query_costs_one_fact_and_nvml_is_still_shut_down(no_rocm):
    card = FakeDevice(**RTX_PRO_6000, fail={"memory": NVMLError(999)})
    nvml = fake_nvml([card])
    (gpu,), unknown = detect_gpus(nvml, **LINUX, **no_rocm)
    assert gpu.total_bytes is None and gpu.free_bytes is None
    assert "Unknown Error" in unknown["gpus[0].total_bytes"]
    assert gpu.compute_capability == (12, 0)
    assert nvml.calls[-1] == "shutdown"


@pytest.mark.parametrize(
    "visible, expected",
    [
        ("1", ["NVIDIA RTX PRO 6000 Blackwell Workstation Edition"]),
        ("1,0", ["NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA H200"]),
        ("GPU-8a1c", ["NVIDIA H200"]),
        ("0,7,1", ["NVIDIA H200"]),  # like CUDA, an invalid entry hides the rest
        ("", []),
        ("-1", []),
    ],
)
def test_cuda_visible_devices(visible, expected, no_rocm):
    nvml = fake_nvml([FakeDevice(**H200), FakeDevice(**RTX_PRO_6000)])
    gpus, _ = detect_gpus(nvml, env={"CUDA_VISIBLE_DEVICES": visible}, system="linux", machine="x86_64", **no_rocm)
    assert [g.name for g in gpus] == expected
    assert [g.index for g in gpus] == list(range(len(expected)))  # CUDA ordinals


def test_nvml_missing_falls_back_to_torch_which_has_no_cuda(monkeypatch, no_rocm):
    monkeypatch.setattr(gpu_module, "_import_torch", lambda: fake_torch(available=False, cuda=None))
    nvml = fake_nvml([], init_error=NVMLError_LibraryNotFound(12))
    gpus, unknown = detect_gpus(nvml, **LINUX, **no_rocm)
    assert gpus == ()
    assert "libnvidia-ml not found" in unknown["gpus"]
    assert "no CUDA support" in unknown["gpus"]
    assert nvml.calls == ["init"]  # nothing to shut down after a failed init


def test_driver_not_loaded_and_torch_absent(monkeypatch, no_rocm):
    monkeypatch.setattr(gpu_module, "_import_torch", lambda: None)
    gpus, unknown = detect_gpus(fake_nvml([], init_error=NVMLError_DriverNotLoaded(9)), **LINUX, **no_rocm)
    assert gpus == ()
    assert "driver is not loaded" in unknown["gpus"] and "torch is not importable" in unknown["gpus"]


def test_torch_fallback_finds_cuda_gpus(monkeypatch, no_rocm):
    torch = fake_torch(available=True, devices=[("NVIDIA GeForce RTX 4090", 24 * GIB, 23 * GIB, (8, 9))])
    monkeypatch.setattr(gpu_module, "_import_torch", lambda: torch)
    (gpu,), unknown = detect_gpus(fake_nvml([], init_error=NVMLError(999)), **LINUX, **no_rocm)
    assert (gpu.name, gpu.source, gpu.served) == ("NVIDIA GeForce RTX 4090", "torch", True)
    assert (gpu.total_bytes, gpu.free_bytes, gpu.compute_capability) == (24 * GIB, 23 * GIB, (8, 9))
    assert gpu.memory_bandwidth_bytes_per_s == 1.008e12
    assert "gpus" not in unknown


def test_no_device_nodes_means_torch_is_not_imported(monkeypatch, tmp_path):
    def must_not_import():
        raise AssertionError("torch imported although no GPU device node exists")

    monkeypatch.setattr(gpu_module, "_import_torch", must_not_import)
    gpus, unknown = detect_gpus(fake_nvml([], init_error=NVMLError_LibraryNotFound(12)), **LINUX,
                                sys_root=tmp_path / "sys", dev_root=tmp_path / "dev")
    assert gpus == ()
    assert "nvidiactl" in unknown["gpus"]


def test_rocm_gpus_are_seen_but_not_served(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_module, "_import_torch", lambda: None)
    sys = tmp_path / "sys"
    (sys / "class" / "kfd").mkdir(parents=True)
    write(sys / "class" / "drm" / "card0" / "device" / "vendor", "0x1002\n")
    write(sys / "class" / "drm" / "card0" / "device" / "mem_info_vram_total", f"{192 * GIB}\n")
    write(sys / "class" / "drm" / "card1" / "device" / "vendor", "0x1a03\n")  # a BMC's VGA
    gpus, unknown = detect_gpus(fake_nvml([], init_error=NVMLError_LibraryNotFound(12)), **LINUX,
                                sys_root=sys, dev_root=tmp_path / "dev")
    (amd,) = gpus
    assert (amd.vendor, amd.served, amd.total_bytes) == ("amd", False, 192 * GIB)
    assert "no GPU the hybrid backend can use" in unknown["gpus"]


def test_rocm_torch_gpus_are_not_served(monkeypatch, no_rocm):
    torch = fake_torch(available=True, devices=[("AMD Instinct MI300X", 192 * GIB, 190 * GIB, (9, 4))], hip="6.2")
    monkeypatch.setattr(gpu_module, "_import_torch", lambda: torch)
    (gpu,), unknown = detect_gpus(fake_nvml([], init_error=NVMLError_LibraryNotFound(12)), **LINUX, **no_rocm)
    assert (gpu.vendor, gpu.served, gpu.compute_capability) == ("amd", False, None)
    assert "gpus" in unknown


def test_apple_silicon_gpu_is_seen_but_not_served(monkeypatch, no_rocm):
    monkeypatch.setattr(gpu_module, "_import_torch", lambda: None)
    gpus, _ = detect_gpus(fake_nvml([], init_error=NVMLError_LibraryNotFound(12)), env={},
                          system="darwin", machine="arm64", **no_rocm)
    assert [(g.name, g.vendor, g.served) for g in gpus] == [("Apple GPU (Metal)", "apple", False)]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H200 NVL", 4.8e12),
        ("NVIDIA GH200 480GB", 4.0e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H100 NVL", 3.9e12),
        ("NVIDIA A100-SXM4-80GB", 2.039e12),
        ("NVIDIA A100-PCIE-40GB", 1.555e12),
        ("NVIDIA L40S", 864e9),
        ("NVIDIA L4", 300e9),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 1.792e12),
        ("NVIDIA RTX 6000 Ada Generation", 960e9),
        ("NVIDIA GeForce RTX 5090", 1.792e12),
        ("NVIDIA GeForce RTX 4090", 1.008e12),
        ("NVIDIA Quadro P400", None),
    ],
)
def test_gpu_bandwidth_table(name, expected):
    assert theoretical_gpu_bandwidth(name) == expected
