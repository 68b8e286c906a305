"""Writing tiny GGUF files with gguf.GGUFWriter for the weight-source tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf import quants as gq


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, tuple[np.ndarray, T]],
    kv: dict[str, Any] | None = None,
    split_max_tensors: int = 0,
) -> dict[str, np.ndarray]:
    """Write `tensors` (name -> (float array in torch order, GGML type)) and return what
    each stored tensor dequantizes to (gguf-py's numpy reference), by GGUF name."""
    w = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    for key, val in (kv or {}).items():
        if isinstance(val, bool):
            w.add_bool(key, val)
        elif isinstance(val, int):
            w.add_uint32(key, val)
        elif isinstance(val, float):
            w.add_float32(key, val)
        elif isinstance(val, str):
            w.add_string(key, val)
        else:
            w.add_array(key, val)
    stored: dict[str, np.ndarray] = {}
    for name, (arr, qtype) in tensors.items():
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if qtype == T.F32:
            w.add_tensor(name, arr)
            stored[name] = arr
        elif qtype == T.F16:
            w.add_tensor(name, arr.astype(np.float16))
            stored[name] = arr.astype(np.float16).astype(np.float32)
        else:
            data = gq.quantize(arr, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
            stored[name] = gq.dequantize(data, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def rand(rng: np.random.Generator, *shape: int, scale: float = 0.5) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute (what llama.cpp does to HF Q/K rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
