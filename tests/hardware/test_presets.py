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


# ---- the cards people own, mixed cards, memory channels (#47) ----------------------------------


@pytest.mark.parametrize("name, card, count, host_cores", [
    ("RTX 4090", "NVIDIA GeForce RTX 4090", 1, 16),
    ("2x RTX 3090", "NVIDIA GeForce RTX 3090", 2, 16),
    ("RTX 4090D", "NVIDIA GeForce RTX 4090 D", 1, 16),
    ("rtx 5080", "NVIDIA GeForce RTX 5080", 1, 16),
    ("4 × RTX 5090", "NVIDIA GeForce RTX 5090", 4, 16),
    ("A6000", "NVIDIA RTX A6000", 1, 32),
    ("RTX PRO 6000 Blackwell Workstation Edition", "NVIDIA RTX PRO 6000 Blackwell", 1, 32),
    ("RTX PRO 6000 Workstation", "NVIDIA RTX PRO 6000 Blackwell", 1, 32),
    ("L40S", "NVIDIA L40S", 1, 32),
    ("H100 PCIe", "NVIDIA H100 PCIe", 1, 32),
])
def test_a_card_name_is_a_preset_with_a_host_of_its_class(name, card, count, host_cores):
    machine = preset(name)
    assert [g.name for g in machine.gpus] == [card] * count
    assert machine.described and machine.cpu.physical_cores == host_cores
    assert machine.memory.bandwidth_bytes_per_s  # the preset host's platform is in the table
    assert "preset host" in machine.name


def test_every_card_alias_is_offered_as_a_preset():
    names = preset_names()
    for alias in ("RTX 3090", "RTX 4090", "RTX 4090D", "RTX 5080", "RTX 5090", "A6000", "L40S", "H100 PCIe"):
        assert alias in names
        preset(alias)


def test_an_unknown_preset_says_how_to_describe_the_machine():
    with pytest.raises(HardwareDescriptionError) as caught:
        preset("RTX 9999")
    hint = caught.value.hint
    assert "--gpus" in hint and "--gpu-memory" in hint and "'RTX 4090'" in hint and ".toml" in hint


def test_mixed_cards_are_one_model_per_card(tmp_path):
    machine = describe(gpu_model=["RTX 5090", "RTX 4090"], host_ram="128GiB")
    assert [g.name for g in machine.gpus] == ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 4090"]
    assert [g.total_bytes for g in machine.gpus] == [32_607 * MiB, 24_564 * MiB]
    path = tmp_path / "mixed.toml"
    path.write_text('[gpu]\nmodel = ["RTX 5090", "RTX 4090"]\n[host]\nram = "128GiB"\n')
    assert [g.name for g in load_described(path).gpus] == [g.name for g in machine.gpus]
    path.write_text('[gpu]\nmodel = ["RTX 5090", "RTX 4090"]\ncount = 3\n[host]\nram = "128GiB"\n')
    with pytest.raises(HardwareDescriptionError, match=r"mixed.toml:3: \[gpu\] count: 3 GPUs but 2 models"):
        load_described(path)


def test_channels_and_speed_set_the_host_bandwidth(tmp_path):
    # Two sockets of 8 channels, but DDR5-4800 DIMMs in only 12 of them.
    machine = describe(host_ram="512GiB", cpu_model="Intel Xeon Gold 6454S", sockets=2, channels=12, mts=4800)
    assert machine.memory.bandwidth_bytes_per_s == 12 * 4800e6 * 8
    assert "12 channels × DDR5-4800" in machine.memory.bandwidth_note
    # The platform's channels with slower DIMMs.
    assert describe(host_ram="64GiB", cpu_model="AMD Ryzen 9 9950X", mts=4800).memory.bandwidth_bytes_per_s == 2 * 4800e6 * 8
    path = tmp_path / "box.toml"
    path.write_text('[host]\nram = "64GiB"\nchannels = 4\nmts = 3200\n')
    assert load_described(path).memory.bandwidth_bytes_per_s == 4 * 3200e6 * 8
    path.write_text('[host]\nram = "64GiB"\nchannels = 4\nmts = 32\n')
    with pytest.raises(HardwareDescriptionError, match=r"box.toml:4: \[host\] mts: memory speed 32 MT/s"):
        load_described(path)


def test_a_one_ccd_ryzen_reads_what_its_ccd_can():
    machine = describe(host_ram="64GiB", cpu_model="AMD Ryzen 7 7800X3D 8-Core Processor")
    assert machine.memory.bandwidth_bytes_per_s == 64e9  # not the channels' 83.2 GB/s
    assert "one CCD" in machine.memory.bandwidth_note and "83.2 GB/s" in machine.memory.bandwidth_note
    two_ccds = describe(host_ram="64GiB", cpu_model="AMD Ryzen 9 7950X 16-Core Processor")
    assert two_ccds.memory.bandwidth_bytes_per_s == 83.2e9  # two CCDs read 128 GB/s: the channels bound


@pytest.mark.parametrize("model, figure", [
    ("Intel(R) Core(TM) i9-14900K", 89.6e9),
    ("Intel(R) Core(TM) i9-10900X CPU @ 3.70GHz", 93.856e9),
    ("AMD Ryzen 9 5950X 16-Core Processor", 51.2e9),
    ("AMD Ryzen Threadripper 3970X 32-Core Processor", 102.4e9),
    ("AMD Ryzen Threadripper PRO 7975WX 32-Cores", 332.8e9),
])
def test_common_desktop_and_workstation_cpus_have_a_bandwidth(model, figure):
    assert describe(host_ram="64GiB", cpu_model=model).memory.bandwidth_bytes_per_s == pytest.approx(figure)


def test_the_readme_lists_every_preset_and_every_description_key():
    """The presets and a description file's keys are the README's to list (#47): a preset or
    key added here and not there fails."""
    from pathlib import Path

    from hybridmoe.backend.hardware.presets import _TOML_KEYS, FLAT_KEYS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    missing = [name for name in preset_names() if f'`"{name}"`' not in readme]
    assert not missing, f"presets missing from the README: {missing}"
    keys = {key for _, key in _TOML_KEYS} | {parameter for parameter in FLAT_KEYS if "_" not in parameter}
    missing = sorted(key for key in keys if f"`{key}`" not in readme and f"\n{key} = " not in readme)
    assert not missing, f"description keys missing from the README: {missing}"
