"""What the installed llama.cpp build can do, for `hybridmoe doctor`.

A CPU-only wheel of llama-cpp-python runs every model, with nothing offloaded; only a build
with a GPU backend (CUDA, ROCm/HIP, Vulkan, Metal, SYCL) can keep layers and experts on a GPU.
ggml's backend registry says which backends this build has, its device list what they found.
"""

from __future__ import annotations

from typing import Any

from hybridmoe.backend.llamacpp.library import LlamaCppUnavailable, ggml, llama


def system_info() -> dict[str, Any]:
    """``available`` and, when available: ``version`` (llama-cpp-python), ``backends``
    (compiled-in ggml backends, e.g. ["CPU"] or ["CUDA", "CPU"]), ``devices`` (name,
    description, type, memory), ``gpu_offload`` (llama_supports_gpu_offload) and ``cpu``
    (llama_print_system_info: the CPU features the build uses). When not available,
    ``error`` says why."""
    try:
        b = llama()
        g = ggml()
    except LlamaCppUnavailable as exc:
        return {"available": False, "error": str(exc)}
    import llama_cpp

    devices = [
        {k: v for k, v in d.items() if k != "buffer_type_handle"}
        for d in g.devices()
    ]
    return {
        "available": True,
        "version": getattr(llama_cpp, "__version__", "unknown"),
        "backends": g.registry(),
        "devices": devices,
        "gpu_offload": bool(b.llama_supports_gpu_offload()),
        "cpu": (b.llama_print_system_info() or b"").decode("utf-8", errors="replace").strip(),
    }


def summary(info: dict[str, Any] | None = None) -> str:
    """One line: "llama-cpp-python 0.3.36, backends CPU (no GPU offload: a CPU-only build)"."""
    info = system_info() if info is None else info
    if not info.get("available"):
        return f"not available ({info.get('error', 'unknown reason').splitlines()[0]})"
    text = f"llama-cpp-python {info['version']}, backends {', '.join(info['backends']) or 'none'}"
    gpus = [d["name"] for d in info["devices"] if d["type"] in ("GPU", "IGPU")]
    if info["gpu_offload"] and gpus:
        return text + f" (GPU offload to {', '.join(gpus)})"
    if info["gpu_offload"]:
        return text + " (GPU backend built in, but it found no GPU)"
    return text + " (no GPU offload: a CPU-only build; see the README to build with CUDA)"
