"""Changing a profile by hand: "this machine, but with 1.5 TB of RAM" for sizing before purchase.

Any override turns the profile into a described one: its numbers are what the user says,
so the planner uses the sizing rule for GPU memory rather than measured free memory.
"""

from __future__ import annotations

from dataclasses import replace

from hybridmoe.backend.errors import HardwareDescriptionError
from hybridmoe.backend.hardware.profile import GPU, HardwareProfile


def apply_overrides(
    profile: HardwareProfile,
    *,
    gpu_memory: int | None = None,
    gpus: int | None = None,
    ram: int | None = None,
    host_bandwidth: float | None = None,
    cores: int | None = None,
) -> HardwareProfile:
    if all(v is None for v in (gpu_memory, gpus, ram, host_bandwidth, cores)):
        return profile
    for name, value in (("--gpu-memory", gpu_memory), ("--ram", ram), ("--host-bandwidth", host_bandwidth), ("--cores", cores)):
        if value is not None and value <= 0:
            raise HardwareDescriptionError(f"{name} must be positive, got {value}")
    if gpus is not None and gpus < 0:
        raise HardwareDescriptionError(f"--gpus must be 0 or more, got {gpus}")

    cards = list(profile.served_gpus)
    if gpus is not None:
        if gpus == 0 and gpu_memory is not None:
            raise HardwareDescriptionError(
                "--gpu-memory was given for 0 GPUs", "Drop --gpu-memory, or pass --gpus 1 or more."
            )
        template = cards[0] if cards else GPU(index=0, name="GPU", source="described")
        cards = [replace(template, index=i) for i in range(gpus)]
    if gpu_memory is not None:
        if not cards:
            raise HardwareDescriptionError(
                "--gpu-memory was given but the machine has no GPU", "Add --gpus N to describe how many cards."
            )
        cards = [replace(g, total_bytes=gpu_memory, free_bytes=gpu_memory) for g in cards]
    cards = [replace(g, source="described") for g in cards]

    memory = profile.memory
    if ram is not None:
        memory = replace(memory, total_bytes=ram, available_bytes=ram, cgroup_limit_bytes=None)
    if host_bandwidth is not None:
        memory = replace(
            memory,
            bandwidth_theoretical_bytes_per_s=host_bandwidth,
            bandwidth_note="given on the command line",
        )
    cpu = replace(profile.cpu, physical_cores=cores) if cores is not None else profile.cpu
    unserved = [g for g in profile.gpus if not g.served]
    return replace(
        profile,
        cpu=cpu,
        memory=memory,
        gpus=tuple(cards) + tuple(unserved),
        described=True,
        name=f"{profile.name} (with overrides)",
    )
