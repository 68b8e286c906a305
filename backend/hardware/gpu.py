"""GPUs: the NVIDIA cards the hybrid backend serves, and other accelerators it can only see.

NVIDIA cards are read through NVML (the library behind ``nvidia-smi``), which answers
without creating a CUDA context and so costs no GPU memory. Where NVML is missing or fails
(no driver library in a container, driver not loaded) torch.cuda is asked instead. AMD
(ROCm) and Apple GPUs are reported with ``served=False`` so the user sees why they are not
used. Nothing here raises: every failure becomes an ``unknown`` entry with its reason.
"""

from __future__ import annotations

import os
import platform as platform_module
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from hybridmoe.backend.hardware.profile import GPU
from hybridmoe.backend.hardware.sysfs import numbered_dirs, read_int, read_text

__all__ = ["detect_gpus", "theoretical_gpu_bandwidth", "GPU_MEMORY_BANDWIDTH"]

# Datasheet memory bandwidth by card, matched as regular expressions against the lower-case
# NVML/torch name with dashes turned into spaces. First match wins, so variants come before
# the family name ("gh200" before "h200", "h100 nvl" before "h100").
GPU_MEMORY_BANDWIDTH: tuple[tuple[str, float], ...] = (
    (r"\bb300\b", 8.0e12),
    (r"\bg?b200\b", 8.0e12),
    (r"\bgh200 144g", 4.9e12),  # HBM3e version
    (r"\bgh200\b", 4.0e12),  # HBM3 version ("GH200 480GB": 96 GB HBM3 + 480 GB LPDDR5X)
    (r"\bh200\b", 4.8e12),  # SXM and NVL alike
    (r"\bh100 nvl\b", 3.9e12),
    (r"\bh100 pcie\b", 2.0e12),
    (r"\bh100\b", 3.35e12),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"\ba100 sxm4 80gb\b", 2.039e12),
    (r"\ba100 80gb pcie\b", 1.935e12),
    (r"\ba100\b", 1.555e12),  # 40 GB versions
    (r"\brtx pro 6000\b", 1.792e12),  # Blackwell: Workstation, Max-Q and Server editions
    (r"\brtx 6000 ada\b", 960e9),
    (r"\brtx a6000\b", 768e9),
    (r"\bl40s?\b", 864e9),
    (r"\bl4\b", 300e9),
    (r"\ba40\b", 696e9),
    (r"\ba10\b", 600e9),
    (r"\brtx 5090\b", 1.792e12),
    (r"\brtx 5080\b", 960e9),
    (r"\brtx 4090\b", 1.008e12),
    (r"\brtx 3090 ti\b", 1.008e12),
    (r"\brtx 3090\b", 936e9),
)

_ENABLED = 1  # NVML_FEATURE_ENABLED, for fake modules that do not define it


def theoretical_gpu_bandwidth(name: str) -> float | None:
    """Datasheet memory bandwidth of a card by its reported name, or None if not in the table."""
    normalized = name.lower().replace("-", " ")
    for pattern, bandwidth in GPU_MEMORY_BANDWIDTH:
        if re.search(pattern, normalized):
            return bandwidth
    return None


def detect_gpus(
    nvml: ModuleType | Any | None = None,
    *,
    env: Mapping[str, str] | None = None,
    sys_root: str | os.PathLike[str] = "/sys",
    dev_root: str | os.PathLike[str] = "/dev",
    system: str | None = None,
    machine: str | None = None,
) -> tuple[tuple[GPU, ...], dict[str, str]]:
    """All GPUs of this machine and ``{"gpus...": reason}`` for what could not be read.

    ``nvml``: the pynvml module (imported when None); tests pass a fake with the same
    functions and exception classes. ``env`` supplies CUDA_VISIBLE_DEVICES (os.environ by
    default). ``sys_root``/``dev_root`` locate the ROCm device nodes, ``system``/``machine``
    (sys.platform, platform.machine()) identify Apple silicon.
    """
    env = os.environ if env is None else env
    system = sys.platform if system is None else system
    machine = platform_module.machine() if machine is None else machine
    unknown: dict[str, str] = {}

    gpus, nvml_reason = _nvml_gpus(nvml, env, unknown)
    if gpus is None:
        nodes_missing = _no_gpu_device_nodes(Path(dev_root)) if system.startswith("linux") else None
        if nodes_missing:
            # Importing torch takes seconds and hundreds of MiB; without a device node
            # torch.cuda cannot see a GPU anyway.
            gpus, torch_reason = [], nodes_missing
        else:
            gpus, torch_reason = _torch_gpus()
        if not any(g.served for g in gpus):
            unknown["gpus"] = f"no GPU the hybrid backend can use: NVML: {nvml_reason}; torch.cuda: {torch_reason}"

    others = []
    if not any(g.vendor == "amd" for g in gpus):
        others.extend(_rocm_gpus(Path(sys_root), Path(dev_root)))
    if system == "darwin" and machine == "arm64":
        others.append(GPU(index=0, name="Apple GPU (Metal)", vendor="apple", served=False, source="platform"))
    return tuple(gpus) + tuple(others), unknown


# --- NVML -----------------------------------------------------------------------------------


def _nvml_failure(nvml: Any, error: BaseException) -> str:
    """Why NVML could not start, in words a user can act on."""

    def is_a(name: str) -> bool:
        kind = getattr(nvml, name, None)
        return isinstance(kind, type) and isinstance(error, kind)

    if is_a("NVMLError_LibraryNotFound"):
        return "libnvidia-ml not found (no NVIDIA driver installed, or not mounted into this container)"
    if is_a("NVMLError_DriverNotLoaded"):
        return "the NVIDIA driver is not loaded (no NVIDIA GPU, or its kernel module failed to load)"
    if is_a("NVMLError_NoPermission"):
        return "no permission to open the NVIDIA device files (/dev/nvidia*)"
    return f"NVML failed to start: {error}"


def _nvml_gpus(
    nvml: Any | None, env: Mapping[str, str], unknown: dict[str, str]
) -> tuple[list[GPU] | None, str]:
    """NVIDIA GPUs from NVML: (gpus, "") or (None, why NVML could not be used)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None, "nvidia-ml-py (pynvml) is not installed"
    try:
        nvml.nvmlInit()
    except Exception as error:  # NVMLError subclasses, or OSError from a broken library
        return None, _nvml_failure(nvml, error)
    try:
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as error:
            return None, f"nvmlDeviceGetCount failed: {error}"
        handles = []
        for nvml_index in range(count):
            try:
                handles.append((nvml_index, nvml.nvmlDeviceGetHandleByIndex(nvml_index)))
            except Exception as error:
                unknown[f"gpus.nvml[{nvml_index}]"] = f"NVML could not open GPU {nvml_index}: {error}"
        visible = _apply_visible_devices(nvml, handles, env, unknown)
        return [_nvml_gpu(nvml, cuda_index, handle, unknown) for cuda_index, handle in enumerate(visible)], ""
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass  # shutting down a library that failed is not worth reporting


def _apply_visible_devices(
    nvml: Any, handles: list[tuple[int, Any]], env: Mapping[str, str], unknown: dict[str, str]
) -> list[Any]:
    """The handles CUDA will see, in CUDA's order, honouring CUDA_VISIBLE_DEVICES.

    NVML sees every GPU; a user who runs us with CUDA_VISIBLE_DEVICES=2,3 must get a plan
    for two cards. Like CUDA, parsing stops at the first entry that names no device. Integer
    entries are taken as NVML (PCI bus) indices, which is CUDA's order for identical cards.
    """
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return [handle for _, handle in handles]
    by_index = dict(handles)
    uuids: dict[int, str] = {}
    for nvml_index, handle in handles:
        try:
            uuid = nvml.nvmlDeviceGetUUID(handle)
            uuids[nvml_index] = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        except Exception:
            pass
    chosen: list[int] = []
    for token in (t.strip() for t in spec.split(",")):
        match: int | None = None
        if re.fullmatch(r"\d+", token):
            match = int(token) if int(token) in by_index else None
        elif token.startswith("GPU-"):
            found = [i for i, u in uuids.items() if u.startswith(token)]
            match = found[0] if len(found) == 1 else None
        elif token.startswith("MIG-"):
            unknown["gpus.visible_devices"] = (
                f"CUDA_VISIBLE_DEVICES names a MIG instance ({token}); MIG slices are not sized here"
            )
        if match is None or match in chosen:
            break
        chosen.append(match)
    return [by_index[i] for i in chosen]


def _nvml_gpu(nvml: Any, index: int, handle: Any, unknown: dict[str, str]) -> GPU:
    not_supported = getattr(nvml, "NVMLError_NotSupported", None)

    def query(field: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as error:
            if isinstance(not_supported, type) and isinstance(error, not_supported):
                unknown[f"gpus[{index}].{field}"] = "not supported by this GPU or driver"
            else:
                unknown[f"gpus[{index}].{field}"] = f"NVML: {error}"
            return None

    name = query("name", lambda: nvml.nvmlDeviceGetName(handle))
    name = name.decode() if isinstance(name, bytes) else (str(name) if name is not None else "NVIDIA GPU")
    memory = query("total_bytes", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    if memory is None:
        unknown[f"gpus[{index}].free_bytes"] = unknown[f"gpus[{index}].total_bytes"]
    capability = query("compute_capability", lambda: nvml.nvmlDeviceGetCudaComputeCapability(handle))
    return GPU(
        index=index,
        name=name,
        vendor="nvidia",
        total_bytes=int(memory.total) if memory is not None else None,
        free_bytes=int(memory.free) if memory is not None else None,
        compute_capability=tuple(int(v) for v in capability) if capability is not None else None,
        # "Max" is the fastest link this card and this slot can train to; the current
        # generation drops when the card idles, so it is reported but not planned with.
        pcie_generation=query("pcie_generation", lambda: nvml.nvmlDeviceGetMaxPcieLinkGeneration(handle)),
        pcie_width=query("pcie_width", lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle)),
        pcie_generation_current=query(
            "pcie_generation_current", lambda: nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        ),
        pcie_width_current=query("pcie_width_current", lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)),
        nvlink_links=_nvlink_links(nvml, handle, index, unknown),
        memory_bandwidth_bytes_per_s=_nvml_bandwidth(nvml, handle, name),
        served=True,
        source="nvml",
    )


def _nvlink_links(nvml: Any, handle: Any, index: int, unknown: dict[str, str]) -> int | None:
    """Active NVLink links; 0 for cards without NVLink (NVML answers NotSupported for them)."""
    not_supported = getattr(nvml, "NVMLError_NotSupported", None)
    links = 0
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except Exception as error:
            if isinstance(not_supported, type) and isinstance(error, not_supported):
                continue  # this link (or NVLink altogether) does not exist on this card
            if link == 0:
                unknown[f"gpus[{index}].nvlink_links"] = f"NVML: {error}"
                return None
            break  # past the last link some drivers answer InvalidArgument
        if state == getattr(nvml, "NVML_FEATURE_ENABLED", _ENABLED):
            links += 1
    return links


def _nvml_bandwidth(nvml: Any, handle: Any, name: str) -> float | None:
    """Datasheet figure, else bus width × maximum memory clock × 2 (double data rate).

    NVML reports the memory clock so that this product gives the datasheet figure for HBM
    and GDDR alike (H100 SXM: 5120 bit × 2619 MHz × 2 = 3.35 TB/s).
    """
    known = theoretical_gpu_bandwidth(name)
    if known is not None:
        return known
    try:
        bus_bits = nvml.nvmlDeviceGetMemoryBusWidth(handle)
        clock_mhz = nvml.nvmlDeviceGetMaxClockInfo(handle, getattr(nvml, "NVML_CLOCK_MEM", 2))
    except Exception:
        return None
    if not bus_bits or not clock_mhz:
        return None
    return float(clock_mhz) * 1e6 * 2 * bus_bits / 8


# --- torch.cuda fallback -------------------------------------------------------------------------


# Device nodes through which CUDA (or ROCm, or WSL's GPU paravirtualization) reaches a GPU.
_GPU_DEVICE_NODES = ("nvidiactl", "nvidia0", "kfd", "dxg")


def _no_gpu_device_nodes(dev_root: Path) -> str | None:
    """Why torch.cuda cannot see a GPU here, or None when it might."""
    if any((dev_root / name).exists() for name in _GPU_DEVICE_NODES):
        return None
    return f"not tried: none of {', '.join(str(dev_root / n) for n in _GPU_DEVICE_NODES)} exists"


def _import_torch() -> Any | None:
    try:
        import torch
    except Exception:  # ImportError, or a broken install raising OSError on its libraries
        return None
    return torch


def _torch_gpus() -> tuple[list[GPU], str]:
    """GPUs through torch.cuda: ([...], "") or ([], why none).

    Costs a CUDA context (some hundred MiB) per card for mem_get_info, which is why it is
    only the fallback.
    """
    torch = _import_torch()
    if torch is None:
        return [], "torch is not importable"
    hip = getattr(torch.version, "hip", None)
    try:
        if not torch.cuda.is_available():
            if not hip and not getattr(torch.version, "cuda", None):
                return [], f"this torch build ({torch.__version__}) has no CUDA support"
            return [], "torch.cuda.is_available() is False"
        count = torch.cuda.device_count()
    except Exception as error:
        return [], f"torch.cuda failed: {error}"
    gpus = []
    problems = []
    for index in range(count):
        try:
            props = torch.cuda.get_device_properties(index)
            free, total = torch.cuda.mem_get_info(index)
        except Exception as error:
            problems.append(f"device {index}: {error}")
            continue
        name = str(props.name)
        gpus.append(
            GPU(
                index=index,
                name=name,
                vendor="amd" if hip else "nvidia",
                total_bytes=int(total or props.total_memory),
                free_bytes=int(free),
                # On ROCm major/minor are the gfx version, not a CUDA capability.
                compute_capability=None if hip else (int(props.major), int(props.minor)),
                memory_bandwidth_bytes_per_s=None if hip else theoretical_gpu_bandwidth(name),
                # The hybrid backend's GPU path is CUDA-only for now; ROCm cards are shown
                # so the user knows they were seen.
                served=not hip,
                source="torch",
            )
        )
    return gpus, "; ".join(problems) if problems else ("no devices" if not gpus else "")


# --- other accelerators -----------------------------------------------------------------------


_AMD_PCI_VENDOR = 0x1002


def _rocm_gpus(sys_root: Path, dev_root: Path) -> list[GPU]:
    """AMD GPUs driven by amdgpu with the ROCm compute interface (kfd) present."""
    if not ((sys_root / "class" / "kfd").exists() or (dev_root / "kfd").exists()):
        return []
    gpus = []
    for _, card in numbered_dirs(sys_root / "class" / "drm", "card"):
        device = card / "device"
        vendor = (read_text(device / "vendor") or "").strip()
        try:
            if int(vendor, 16) != _AMD_PCI_VENDOR:
                continue
        except ValueError:
            continue
        name = (read_text(device / "product_name") or "").strip() or "AMD GPU"
        gpus.append(
            GPU(
                index=len(gpus),
                name=f"{name} (ROCm)",
                vendor="amd",
                total_bytes=read_int(device / "mem_info_vram_total"),
                served=False,
                source="sysfs",
            )
        )
    if not gpus:
        gpus.append(GPU(index=0, name="AMD GPU (ROCm)", vendor="amd", served=False, source="sysfs"))
    return gpus
