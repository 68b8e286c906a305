"""What this machine has (``detect``) or what a machine being sized has (presets, descriptions).

``detect()`` never raises: a fact it cannot determine is ``None`` in the profile and its
reason is in ``HardwareProfile.unknown``, so the planner can say what it assumed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from hybridmoe.backend.hardware.bandwidth import (
    HOST_PROBES,
    measure_host_read_bandwidth,
    probe_buffer_bytes,
    probe_threads,
    probes_note,
)
from hybridmoe.backend.hardware.cpu import detect_cpu
from hybridmoe.backend.hardware.disk import default_model_dir, detect_disk
from hybridmoe.backend.hardware.gpu import detect_gpus
from hybridmoe.backend.hardware.memory import detect_memory
from hybridmoe.backend.hardware.presets import GPU_MODELS, describe, load_described, preset, preset_names
from hybridmoe.backend.hardware.profile import CPU, GPU, Disk, HardwareProfile, Memory, NumaNode

__all__ = [
    "detect",
    "describe",
    "load_described",
    "preset",
    "preset_names",
    "GPU_MODELS",
    "default_model_dir",
    "HardwareProfile",
    "CPU",
    "GPU",
    "Disk",
    "Memory",
    "NumaNode",
]

log = logging.getLogger(__name__)

# The host read probe's figure for this process: one reading per process, so that every plan
# made in it (the wizard's, the catalogue's, the chat's) rests on the same bandwidth and shows
# the same speed; ``detect(remeasure=True)`` takes a new one (the hardware screen's Ctrl+D).
_probe_reading: tuple[float, str] | None = None

T = TypeVar("T")


def _guarded(part: str, unknown: dict[str, str], default: T, call: Callable[[], tuple[T, dict[str, str]]]) -> T:
    """Run one detector; a bug in it costs that part of the profile, not the whole app."""
    try:
        value, reasons = call()
    except Exception as error:
        log.warning("hardware detection of %s failed", part, exc_info=True)
        unknown[part] = f"detection failed ({type(error).__name__}: {error}); please report this"
        return default
    unknown.update(reasons)
    return value


def probe_reading() -> float | None:
    """This process's host read probe figure (bytes/s), if it has taken one."""
    return _probe_reading[0] if _probe_reading else None


def detect(
    *,
    measure_bandwidth: bool = True,
    model_dir: str | os.PathLike[str] | None = None,
    proc_root: str | os.PathLike[str] = "/proc",
    sys_root: str | os.PathLike[str] = "/sys",
    dev_root: str | os.PathLike[str] = "/dev",
    nvml: ModuleType | Any | None = None,
    remeasure: bool = False,
) -> HardwareProfile:
    """Profile this machine: CPU, host memory (with cgroup limit and bandwidth), GPUs, disk.

    ``measure_bandwidth`` runs the ~1 s host read-bandwidth probe (the best of ``HOST_PROBES``). ``model_dir`` is where
    models will be stored (default: ``default_model_dir()``). ``proc_root``, ``sys_root``,
    ``dev_root`` and ``nvml`` (a pynvml-like module) let tests substitute fake trees and
    drivers. The probe runs once per process: later calls reuse its figure unless
    ``remeasure`` (a bandwidth that moves within minutes would give every screen its own speed).
    """
    global _probe_reading
    unknown: dict[str, str] = {}
    cpu = _guarded("cpu", unknown, CPU(), lambda: detect_cpu(proc_root, sys_root))
    memory = _guarded(
        "memory",
        unknown,
        Memory(),
        lambda: detect_memory(
            proc_root, sys_root, cpu_model=cpu.model_name, sockets=cpu.sockets, physical_cores=cpu.physical_cores
        ),
    )

    if not measure_bandwidth:
        unknown["memory.bandwidth_measured_bytes_per_s"] = "bandwidth probe not run (opted out)"
    elif _probe_reading is not None and not remeasure and proc_root == "/proc":
        measured, note = _probe_reading
        memory = dataclasses.replace(memory, bandwidth_measured_bytes_per_s=measured,
                                     bandwidth_measured_note=f"{note}, measured once in this process")
    else:
        try:
            measured = measure_host_read_bandwidth(
                buffer_bytes=probe_buffer_bytes(cpu.l3_bytes, memory.available_bytes),
                threads=probe_threads(cpu.physical_cores),
                probes=HOST_PROBES,
            )
            memory = dataclasses.replace(memory, bandwidth_measured_bytes_per_s=measured,
                                         bandwidth_measured_note=probes_note(HOST_PROBES))
            if proc_root == "/proc":  # this machine, not a test's fake tree
                _probe_reading = (measured, probes_note(HOST_PROBES))
        except Exception as error:  # MemoryError, a broken torch: the probe is optional
            unknown["memory.bandwidth_measured_bytes_per_s"] = f"bandwidth probe failed: {type(error).__name__}: {error}"

    gpus = _guarded("gpus", unknown, (), lambda: detect_gpus(nvml, sys_root=sys_root, dev_root=dev_root))
    disk = _guarded("disk", unknown, None, lambda: detect_disk(model_dir))
    return HardwareProfile(cpu=cpu, memory=memory, gpus=gpus, disk=disk, unknown=unknown)
