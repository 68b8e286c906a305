"""Hugging Face safetensors checkpoints to GGUF files (llama.cpp's format), quantized.

    to_gguf(model_dir, out_path, quant="q8_0", on_progress=None, cancel=None, overwrite=False) -> Path
    stored_types(path, quant) -> StoredTypes   (which tensors took `quant`, which kept another type)
    is_current_conversion(out_path, model_dir) -> bool   (written after every file of the checkpoint)

``quant`` is one of ``QUANTS``: "bf16", "q8_0", "q4_0" (encoded here) or "q4_k_m" (through
llama.cpp's quantizer). See ``converter`` for the steps and the modules doing each.

The names are imported on first use: the converter pulls in torch, and the quantizer's child
process (``python -m hybridmoe.backend.convert.kquants``) should not pay for that.
"""

from __future__ import annotations

from typing import Any

__all__ = ["QUANTS", "default_output_path", "is_current_conversion", "stored_types", "to_gguf"]


def __getattr__(name: str) -> Any:
    if name == "QUANTS":
        from hybridmoe.backend.convert.tensor_types import QUANTS

        return QUANTS
    if name in ("default_output_path", "is_current_conversion", "stored_types", "to_gguf"):
        from hybridmoe.backend.convert import converter

        return getattr(converter, name)
    raise AttributeError(f"module 'hybridmoe.backend.convert' has no attribute {name!r}")
