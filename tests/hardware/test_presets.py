"""Machines being sized before purchase: presets, describe(), TOML descriptions."""

from __future__ import annotations

import pytest

from hybridmoe.backend.errors import HardwareDescriptionError, UsageError
from hybridmoe.backend.hardware import HardwareProfile, describe, load_described, preset, preset_names
from hybridmoe.backend.units import GiB, MiB, fmt_bytes


def test_required_presets_exist():
    for name in ("4x RTX PRO 6000", "8x RTX PRO 6000", "4x H200 NVL", "8x H200 NVL", "cpu-only"):
        assert name in preset_names()


@pytest.mark.parametrize(
    "name, count, per_card, ram",
    [
        ("4x RTX PRO 6000", 4, 97_887 * MiB, 768 * GiB),
        ("8x RTX PRO 6000", 8, 97_887 * MiB, 1536 * GiB),
        ("4x H200 NVL", 4, 143_771 * MiB, 768 * GiB),
        ("8x H200 NVL", 8, 143_771 * MiB, 1536 * GiB),
        ("cpu-only", 0, None, 768 * GiB),
    ],
)
def test_presets_describe_the_driver_view(name, count, per_card, ram):
    machine = preset(name)
    assert machine.described and machine.name == name
    assert len(machine.gpus) == count
    assert all(g.total_bytes == per_card == g.free_bytes for g in machine.gpus)
    assert machine.memory.total_bytes == ram
    assert machine.memory.bandwidth_bytes_per_s == pytest.approx(1_228.8e9)
    assert (machine.cpu.sockets, machine.cpu.physical_cores, machine.cpu.threads) == (2, 64, 128)
    assert "avx512_bf16" in machine.cpu.features
    assert len(machine.cpu.numa_nodes) == 2 and len(machine.cpu.numa_nodes[1].cpus) == 64


def test_preset_gpu_memory_matches_sizing_doc():
    assert fmt_bytes(preset("8x RTX PRO 6000").gpus[0].total_bytes) == "95.6 GiB"
    h200 = preset("4x H200 NVL").gpus[0]
    assert fmt_bytes(h200.total_bytes) == "140.4 GiB"
    assert h200.memory_bandwidth_bytes_per_s == 4.8e12 and h200.compute_capability == (9, 0)


def test_preset_names_are_forgiving_and_unknown_ones_list_the_known():
    assert preset("8×rtx pro 6000").name == "8x RTX PRO 6000"
    assert preset("CPU only").name == "cpu-only"
    with pytest.raises(HardwareDescriptionError) as caught:
        preset("16x B200")
    assert "'16x B200'" in str(caught.value)
    assert "8x H200 NVL" in caught.value.hint


def test_preset_round_trips_through_dict():
    machine = preset("4x H200 NVL")
    assert HardwareProfile.from_dict(machine.to_dict()) == machine


def test_describe_from_explicit_numbers():
    machine = describe(gpu_count=2, gpu_memory="48GiB", gpu_model="Some Card", host_ram="256GiB",
                       host_bandwidth="460.8GB/s", cores=32, sockets=1)
    assert [g.total_bytes for g in machine.gpus] == [48 * GiB, 48 * GiB]
    assert machine.gpus[0].name == "Some Card" and machine.gpus[0].source == "described"
    assert "gpus[0].compute_capability" in machine.unknown
    assert machine.memory.bandwidth_bytes_per_s == pytest.approx(460.8e9)
    assert machine.cpu.numa_nodes[0].cpus == tuple(range(32))


def test_describe_derives_host_bandwidth_from_cpu():
    machine = describe(host_ram="1TiB", cpu_model="AMD EPYC 9655", sockets=2, cores=192)
    assert machine.memory.bandwidth_bytes_per_s == pytest.approx(1_228.8e9)
    assert machine.gpus == () and machine.cpu.arch == "x86_64"


@pytest.mark.parametrize(
    "kwargs, what, hint",
    [
        (dict(gpu_count=0, gpu_memory="96GiB", host_ram="768GiB"), "0 GPUs", "gpu_count"),
        (dict(gpu_count=2, gpu_memory="-96GiB", host_ram="768GiB"), "negative", "unit"),
        (dict(gpu_count=2, gpu_memory=0, host_ram="768GiB"), "more than 0", "unit"),
        (dict(gpu_count=-1, host_ram="768GiB"), "at least 0", ""),
        (dict(gpu_count=2.5, host_ram="768GiB"), "whole number", ""),
        (dict(gpu_count=4, gpu_model="Voodoo 5", host_ram="768GiB"), "unknown GPU model", "RTX PRO 6000"),
        (dict(gpu_count=4, host_ram="768GiB"), "neither their model nor their memory", ""),
        (dict(gpu_count=1, gpu_model="H200 NVL", host_ram="96"), "only 96 B", "96GiB"),
        (dict(host_ram="0GiB"), "more than 0", ""),
        (dict(), "host RAM is missing", "768GiB"),
        (dict(host_ram="1TiB", host_bandwidth="1229"), "only 1.2 kB/s", "GB/s"),
        (dict(host_ram="1TiB", cores=63, sockets=2), "evenly", ""),
        (dict(host_ram="1TiB", cores=64, threads=32), "fewer than", ""),
    ],
)
def test_describe_refuses_nonsense(kwargs, what, hint):
    with pytest.raises(HardwareDescriptionError) as caught:
        describe(**kwargs)
    error = caught.value
    assert isinstance(error, UsageError) and error.exit_code == 2
    assert error.what.startswith("describe(): ")
    assert what in error.what
    assert hint in (error.hint or "")


def _write(tmp_path, text):
    path = tmp_path / "lab.toml"
    path.write_text(text)
    return path


def test_load_described_machine(tmp_path):
    path = _write(tmp_path, """
# two cards on a workstation
[gpu]
model = "RTX PRO 6000"
count = 2

[host]
ram = "512GiB"
cpu = "AMD Ryzen Threadripper PRO 7995WX 96-Cores"
cores = 96
sockets = 1
""")
    machine = load_described(path)
    assert machine.name == "lab" and machine.described
    assert [g.total_bytes for g in machine.gpus] == [97_887 * MiB] * 2
    assert machine.memory.total_bytes == 512 * GiB
    assert machine.memory.bandwidth_bytes_per_s == pytest.approx(8 * 5200e6 * 8)


def test_malformed_toml_names_file_and_line(tmp_path):
    path = _write(tmp_path, '[gpu]\ncount = 4\nmodel = RTX PRO 6000\n')
    with pytest.raises(HardwareDescriptionError) as caught:
        load_described(path)
    assert f"{path}:3: malformed TOML" in caught.value.what
    assert "[gpu]" in caught.value.hint  # shows what a description looks like


def test_semantic_errors_point_at_the_key(tmp_path):
    path = _write(tmp_path, 'name = "box"\n[gpu]\ncount = 0\nmemory = "96GiB"\n[host]\nram = "768GiB"\n')
    with pytest.raises(HardwareDescriptionError) as caught:
        load_described(path)
    assert caught.value.what.startswith(f"{path}:4: [gpu] memory: ")
    assert "0 GPUs" in caught.value.what and "[gpu] count" in caught.value.hint

    path = _write(tmp_path, '[gpu]\ncount = 1\nmodel = "H200 NVL"\n[host]\nram = "-1TiB"\n')
    with pytest.raises(HardwareDescriptionError, match=r"lab.toml:5: \[host\] ram: .*negative"):
        load_described(path)

    path = _write(tmp_path, '[gpu]\ncount = 1\nmodel = "H200 NVL"\n[host]\ncores = 8\n')
    with pytest.raises(HardwareDescriptionError, match=r"lab.toml:4: \[host\] ram: host RAM is missing"):
        load_described(path)


def test_unknown_keys_and_tables_are_refused(tmp_path):
    path = _write(tmp_path, '[gpu]\ncount = 1\nmemroy = "96GiB"\n[host]\nram = "1TiB"\n')
    with pytest.raises(HardwareDescriptionError) as caught:
        load_described(path)
    assert "lab.toml:3: unknown key [gpu] memroy" in caught.value.what
    assert "memory" in caught.value.hint

    path = _write(tmp_path, '[cpu]\ncores = 8\n')
    with pytest.raises(HardwareDescriptionError, match="lab.toml:1: unknown entry 'cpu'"):
        load_described(path)


def test_missing_description_file(tmp_path):
    with pytest.raises(HardwareDescriptionError, match="no such machine description"):
        load_described(tmp_path / "absent.toml")


def test_flat_files_use_describe_parameter_names(tmp_path):
    path = _write(tmp_path, 'gpu_count = 2\ngpu_memory = "96GiB"\nhost_ram = "1.5TB"\nhost_bandwidth = "1229GB/s"\n')
    machine = load_described(path)
    assert [g.total_bytes for g in machine.gpus] == [96 * GiB] * 2
    assert machine.memory.total_bytes == 1_500_000_000_000
    assert machine.memory.bandwidth_bytes_per_s == pytest.approx(1229e9)

    path = _write(tmp_path, 'host_ram = "1TiB"\n[gpu]\ncount = 0\n[host]\nram = "2TiB"\n')
    with pytest.raises(HardwareDescriptionError, match=r"lab.toml:5: \[host\] ram repeats host_ram"):
        load_described(path)

    path = _write(tmp_path, 'gpu_count = 0\ngpu_memory = "96GiB"\nhost_ram = "1TiB"\n')
    with pytest.raises(HardwareDescriptionError, match=r"lab.toml:2: gpu_memory: GPU memory is given for .*0 GPUs"):
        load_described(path)


def test_flat_files_also_take_the_host_table_keys(tmp_path):
    """The README's example writes `ram = "768GiB"` at the top level, as [host] names it."""
    path = _write(tmp_path, 'gpu_model = "RTX PRO 6000"\ngpu_count = 2\nram = "768GiB"\n'
                            'cpu = "AMD EPYC 9355 32-Core Processor"\ncores = 64\nsockets = 1\n')
    machine = load_described(path)
    assert machine.memory.total_bytes == 768 * GiB
    assert machine.cpu.model_name == "AMD EPYC 9355 32-Core Processor"

    path = _write(tmp_path, 'ram = "1TiB"\nhost_ram = "2TiB"\n')
    with pytest.raises(HardwareDescriptionError, match=r"lab.toml:2: host_ram repeats ram"):
        load_described(path)
    path = _write(tmp_path, 'ram = "1TiB"\ngpu_count = 0\ngpu_memory = "96GiB"\n')
    with pytest.raises(HardwareDescriptionError, match=r"lab.toml:3: gpu_memory: GPU memory is given for .*0 GPUs"):
        load_described(path)


def test_an_unknown_entry_lists_the_keys_not_internal_names(tmp_path):
    path = _write(tmp_path, 'memory = "768GiB"\n')
    with pytest.raises(HardwareDescriptionError) as caught:
        load_described(path)
    assert "lab.toml:1: unknown entry 'memory'" in caught.value.what
    assert "describe" not in str(caught.value)
    assert "ram" in caught.value.hint and "[host]" in caught.value.hint
