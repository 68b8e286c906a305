"""A hardware profile in plain words, and the warnings about it that change what to expect.

The doctor's table (hybridmoe.app.render.hardware_text) lists every fact; the wizard's first page
says what they mean for running these models: where the experts can go, and what will be
slow.
"""

from __future__ import annotations

from hybridmoe.backend.hardware.profile import HardwareProfile
from hybridmoe.backend.units import fmt_bytes, fmt_rate


def summary_lines(hw: HardwareProfile) -> list[str]:
    cpu, mem = hw.cpu, hw.memory
    lines = []
    cores = f"{cpu.physical_cores} cores" if cpu.physical_cores else "an unknown number of cores"
    sockets = f" in {cpu.sockets} sockets" if cpu.sockets and cpu.sockets > 1 else ""
    isa = _best_isa(cpu.features)
    lines.append(f"Processor: {cpu.model_name or 'unknown model'}, {cores}{sockets}" + (f", {isa}" if isa else ""))
    ram = f"Memory: {fmt_bytes(mem.usable_bytes)} usable for models"
    if mem.available_bytes is not None:
        ram += f" ({fmt_bytes(mem.available_bytes)} free now)"
    lines.append(ram)
    bandwidth = mem.bandwidth_bytes_per_s
    if bandwidth:
        how = "measured" if bandwidth == mem.bandwidth_measured_bytes_per_s else "theoretical"
        lines.append(f"Memory bandwidth: {fmt_rate(bandwidth)} ({how}); it sets the speed of the experts on the CPU")
    skipped = hw.unknown.get("memory.bandwidth_measured_bytes_per_s", "")
    if skipped.startswith("not measured"):  # the model was busy: say so, with how to measure it
        lines.append(f"Memory bandwidth {skipped}")
    served = hw.served_gpus
    if served:
        names = sorted({g.name for g in served})
        total = sum(g.total_bytes or 0 for g in served)
        lines.append(f"GPUs: {len(served)} × {' / '.join(names)}, {fmt_bytes(total)} in all: "
                     "attention and as many experts as fit go there")
    else:
        lines.append("GPUs: none the engine can use: everything runs on the CPU")
    unserved = [g for g in hw.gpus if not g.served]
    if unserved:
        lines.append(f"Also seen, not used: {', '.join(g.name for g in unserved)}")
    if hw.disk and hw.disk.free_bytes is not None:
        lines.append(f"Model store: {hw.disk.path}, {fmt_bytes(hw.disk.free_bytes)} free")
    return lines


def warnings(hw: HardwareProfile, smallest_model_bytes: int | None = None) -> list[str]:
    """The facts that change what a person should expect, most serious first."""
    out = []
    cpu, mem = hw.cpu, hw.memory
    if not hw.served_gpus:
        out.append("No GPU: CPU-only will be slow — a few tokens per second for the large models, "
                   "limited by memory bandwidth.")
    if cpu.arch in ("x86_64", "amd64") and "avx2" not in cpu.features:
        out.append("This CPU has no AVX2: the expert kernels fall back to portable code, several times slower.")
    if mem.cgroup_limit_bytes is not None and mem.total_bytes and mem.cgroup_limit_bytes < mem.total_bytes:
        out.append(f"Container memory limit: this process may use {fmt_bytes(mem.cgroup_limit_bytes)} of the "
                   f"machine's {fmt_bytes(mem.total_bytes)}; models are sized against the limit.")
    if smallest_model_bytes is not None and mem.usable_bytes is not None:
        room = mem.usable_bytes + sum(g.total_bytes or 0 for g in hw.served_gpus)
        if room < smallest_model_bytes:
            out.append(f"Memory ({fmt_bytes(room)} with the GPUs) is smaller than any model in the catalogue "
                       f"(the smallest needs {fmt_bytes(smallest_model_bytes)}); "
                       "a smaller model on disk may still run.")
    return out


def _best_isa(features: tuple[str, ...]) -> str:
    f = set(features)
    if {"amx_tile", "amx_bf16"} <= f:
        return "AMX"
    if "avx512f" in f:
        return "AVX-512" + (" with VNNI" if "avx512_vnni" in f else "")
    if "avx2" in f:
        return "AVX2"
    if "sve" in f:
        return "SVE"
    if "neon" in f:
        return "NEON"
    return ""
