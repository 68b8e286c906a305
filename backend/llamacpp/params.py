"""The rest of the Plan's llama.cpp settings as llama_model_params / llama_context_params.

Keys of ``plan.llama_cpp`` (made by backend/plan/llamacpp.py) and what they become:

    n_gpu_layers            model.n_gpu_layers (blocks offloaded, last ones first; +1 = output)
    tensor_split            model.tensor_split (share per GPU, padded to llama_max_devices())
    n_ctx / n_parallel      context.n_ctx = n_ctx / n_parallel: a Session is one conversation,
                            and the plan sized n_ctx for n_parallel of them (llama-server's -c)
    n_threads               context.n_threads and n_threads_batch (physical cores: hyper-threads
                            only add contention to memory-bound expert matmuls)
    n_batch, n_ubatch       context.n_batch, n_ubatch (<= n_batch); a large micro-batch is what
                            lets llama.cpp copy host-resident experts to the GPU for big prompt
                            batches instead of computing them on the CPU ("op offload")
    op_offload              context.op_offload (default on)
    use_mmap                model.load_mode (default: llama.cpp's, mmap); false = --no-mmap
    flash_attn              context.flash_attn_type: true -> enabled, false -> disabled,
                            "auto"/absent -> llama.cpp decides per device
    cache_type_k/v          context.type_k / type_v ("f16", "q8_0", ...)

Settings the installed llama-cpp-python's structs lack are skipped, so older builds load.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.llamacpp.placement import OverrideArray
from hybridmoe.backend.plan.plan import Plan

# ggml_type values of the KV cache types llama.cpp accepts (-ctk / -ctv names).
CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
FLASH_ATTN = {True: 1, False: 0, "on": 1, "off": 0, "enabled": 1, "disabled": 0, "auto": -1, None: -1}


@dataclass
class LlamaParams:
    """Filled parameter structs plus every object their pointers refer to."""

    model: Any  # llama_model_params
    context: Any  # llama_context_params
    keep: list[Any] = field(default_factory=list)


def build(bindings, plan: Plan, overrides: OverrideArray, progress: Callable[[float], bool] | None) -> LlamaParams:
    s = plan.llama_cpp or {}
    keep: list[Any] = [overrides]

    mp = bindings.llama_model_default_params()
    mp.n_gpu_layers = _int(s, "n_gpu_layers", 0)
    mp.tensor_buft_overrides = overrides.pointer
    split = s.get("tensor_split")
    if split:
        n = bindings.llama_max_devices()
        if len(split) > n:
            raise UsageError(f"the plan splits tensors over {len(split)} GPUs; this llama.cpp build handles at most {n}")
        arr = (ctypes.c_float * n)(*[float(x) for x in split])
        keep.append(arr)
        mp.tensor_split = arr
    if not s.get("use_mmap", True):
        # --no-mmap: read the weights into allocated buffers. llama.cpp suggests it when
        # experts are overridden to the CPU on a GPU build (they may then go to pinned host
        # memory, which the GPU reads faster during op offload); it costs that host RAM.
        if not _set(mp, "load_mode", bindings.LLAMA_LOAD_MODE_NONE):
            _set(mp, "use_mmap", False)
    if progress is not None:
        callback = bindings.llama_progress_callback(lambda fraction, _user: bool(progress(float(fraction))))
        keep.append(callback)
        mp.progress_callback = callback

    cp = bindings.llama_context_default_params()
    parallel = max(_int(s, "n_parallel", 1), 1)
    cp.n_ctx = max(_int(s, "n_ctx", plan.workload.context * parallel) // parallel, 1)
    cp.n_batch = _int(s, "n_batch", cp.n_batch)
    cp.n_ubatch = min(_int(s, "n_ubatch", cp.n_ubatch), cp.n_batch)
    cp.n_seq_max = 1
    threads = _int(s, "n_threads", 0) or plan.threads or _physical_cores()
    # A plan made for a described machine may ask for more threads than this one has; spinning
    # workers on oversubscribed CPUs slow llama.cpp down many times over.
    cp.n_threads = cp.n_threads_batch = max(min(threads, _usable_cpus()), 1)
    _set(cp, "op_offload", bool(s.get("op_offload", True)))
    fa = s.get("flash_attn", "auto")
    if fa not in FLASH_ATTN:
        raise UsageError(f"flash_attn {fa!r} in the plan is not one of true, false, \"auto\"")
    if not _set(cp, "flash_attn_type", FLASH_ATTN[fa]):
        _set(cp, "flash_attn", FLASH_ATTN[fa] == 1)  # llama-cpp-python before flash_attn_type
    for key, attr in (("cache_type_k", "type_k"), ("cache_type_v", "type_v")):
        name = str(s.get(key, "f16")).lower()
        if name not in CACHE_TYPES:
            raise UsageError(f"{key} {name!r} in the plan is not a KV cache type llama.cpp knows ({', '.join(CACHE_TYPES)})")
        setattr(cp, attr, CACHE_TYPES[name])
    return LlamaParams(mp, cp, keep)


def _int(s: Mapping[str, Any], key: str, default: int) -> int:
    value = s.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise UsageError(f"{key} in the plan's llama.cpp settings must be a whole number (got {value!r})")
    return int(value)


def _set(struct: Any, name: str, value: Any) -> bool:
    if any(f[0] == name for f in struct._fields_):
        setattr(struct, name, value)
        return True
    return False


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _physical_cores() -> int:
    from hybridmoe.backend.hardware.cpu import detect_cpu

    cores = detect_cpu()[0].physical_cores  # never raises: unknown facts come back as None
    return cores or max((os.cpu_count() or 2) // 2, 1)
