"""Checkpoint tensors by their Hugging Face names, read lazily through mmap.

``WeightSource`` is the one interface model code reads weights through; a GGUF file is
exposed through it too (``gguf_weights``), with the same HF names. A safetensors
checkpoint (one ``model.safetensors`` or shards listed in ``model.safetensors.index.json``)
is opened with ``safe_open(framework="pt")``, which maps each file once and returns tensors
that are views of that mapping: nothing is copied until a page is touched, so host memory
holds what the CPU-resident experts need and the page cache, never a second full copy.

Quantized weights are stored as several tensors; the source folds them into one object of
``hybridmoe.backend.formats.quant`` under the logical name, and hides the companions from ``keys()``:

    fp8 block (DeepSeek-V3)        X.weight (float8_e4m3fn) + X.weight_scale_inv  -> X.weight
    int4 pack-quantized (Kimi K2)  X.weight_packed + X.weight_scale + X.weight_shape -> X.weight
    mxfp4 (GPT-OSS)                X_blocks + X_scales                              -> X
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models.model_files import is_gguf_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@runtime_checkable
class WeightSource(Protocol):
    """Tensors of one checkpoint under their HF names (plain tensors or quant objects).

    ``SafetensorsWeights`` here and ``gguf_weights.GGUFWeights`` implement it; model code
    uses only these three methods, through ``require`` below for checked reads.
    """

    def get(self, name: str) -> Any:
        """The tensor (or quantized object) called `name`."""

    def keys(self) -> Iterable[str]:
        """Logical tensor names (quantization companions folded in)."""

    def __contains__(self, name: object) -> bool: ...


def checkpoint_kind(source: WeightSource) -> str:
    """"gguf" for a GGUF model, else "safetensors" (also for tensors handed over in a mapping)."""
    return getattr(source, "checkpoint", "safetensors")


def location(source: WeightSource) -> str:
    """Where a source reads from (a directory or file), for messages."""
    loc = getattr(source, "location", None)
    if loc:
        return str(loc)
    files = getattr(source, "files", None)
    return str(files[0]) if files else repr(source)


def missing_tensor(source: WeightSource, name: str) -> ModelError:
    return ModelError(
        f"tensor {name} is missing from {location(source)}",
        "The checkpoint is incomplete or does not match its config.json; download it again.",
    )


def require(source: WeightSource, name: str, shape: tuple[int, ...] | None = None) -> Any:
    """`source.get(name)`, as ModelError naming the tensor and the checkpoint when it is
    missing or (with `shape`) when its logical shape differs."""
    if name not in source:
        raise missing_tensor(source, name)
    t = source.get(name)
    if shape is not None and tuple(t.shape) != tuple(shape):
        where = source.file_of(name) if hasattr(source, "file_of") else location(source)
        raise ModelError(
            f"tensor {name} in {where} has shape {tuple(t.shape)}, expected {tuple(shape)}",
            "The checkpoint does not match its config.json; download it again.",
        )
    return t


@dataclass(frozen=True)
class _Entry:
    kind: str  # "plain", "fp8", "int4", "mxfp4"
    parts: tuple[str, ...]  # stored tensor names, main one first


def fold_quantized(stored: Iterable[str]) -> dict[str, _Entry]:
    """Map logical names to the stored tensors that make them up."""
    stored = set(stored)
    entries: dict[str, _Entry] = {}
    companions: set[str] = set()
    for name in stored:
        if name.endswith(".weight_packed"):
            base = name[: -len(".weight_packed")]
            parts = (name, f"{base}.weight_scale", f"{base}.weight_shape")
            entries[f"{base}.weight"] = _Entry("int4", parts)
            companions.update(parts)
        elif name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            entries[base] = _Entry("mxfp4", (name, f"{base}_scales"))
            companions.update((name, f"{base}_scales"))
        elif name.endswith(".weight_scale_inv"):
            base = name[: -len("_scale_inv")]
            entries[base] = _Entry("fp8", (base, name))
            companions.update((base, name))
    for name in stored - companions:
        entries.setdefault(name, _Entry("plain", (name,)))
    # An incomplete group (int4 without weight_shape, ...) stays listed: reading it raises a
    # ModelError naming the missing part.
    return entries


def _quant():
    # Imported on first use: float checkpoints need nothing from the quant module.
    from hybridmoe.backend.formats import quant

    return quant


class SafetensorsWeights:
    """A Hugging Face safetensors checkpoint (a directory, or a single .safetensors file)."""

    checkpoint = "safetensors"

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        self.location = str(path)
        self._file_of = self._tensor_files(path)  # stored name -> file
        self._entries = fold_quantized(self._file_of)
        self._handles: dict[Path, Any] = {}

    @staticmethod
    def _tensor_files(path: Path) -> dict[str, Path]:
        from safetensors import safe_open

        if path.is_file():
            files = [path]
        elif (path / INDEX_NAME).is_file():
            try:
                index = json.loads((path / INDEX_NAME).read_text())
                weight_map = index["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelError(f"{path / INDEX_NAME} is not a valid safetensors index: {e}") from None
            file_of = {name: path / fname for name, fname in weight_map.items()}
            for f in set(file_of.values()):
                if not f.is_file():
                    raise ModelError(
                        f"{f.name}, listed in {path / INDEX_NAME}, is missing from {path}",
                        "The download is incomplete; download the model again.",
                    )
            return file_of
        elif (path / SINGLE_NAME).is_file():
            files = [path / SINGLE_NAME]
        elif path.is_dir():
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ModelError(f"{path} holds no .safetensors files", "Point at a Hugging Face model directory.")
        else:
            raise ModelError(f"{path} does not exist")
        file_of: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for name in h.keys():
                        file_of[name] = f
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ModelError(f"{f} is not a readable safetensors file: {e}", "Download it again.") from None
        return file_of

    def keys(self) -> Iterable[str]:
        return self._entries.keys()

    def __iter__(self):
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def _stored(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self._file_of.get(name)
        if f is None:
            raise missing_tensor(self, name)
        handle = self._handles.get(f)
        if handle is None:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as e:
                raise ModelError(f"{f} is not a readable safetensors file: {e}", "Download it again.") from None
            self._handles[f] = handle
        try:
            return handle.get_tensor(name)
        except Exception as e:  # a header naming bytes beyond the end of a truncated file
            raise ModelError(f"tensor {name} in {f} cannot be read: {e}", "The file is damaged; download it again.") from None

    def get(self, name: str) -> Any:
        entry = self._entries.get(name)
        if entry is None:
            raise missing_tensor(self, name)
        parts = [self._stored(p) for p in entry.parts]
        if entry.kind == "plain":
            return parts[0]
        if entry.kind == "fp8":
            return _quant().from_fp8_block(*parts)
        if entry.kind == "int4":
            return _quant().from_compressed_int4(*parts)
        return _quant().from_mxfp4(*parts)

    def file_of(self, name: str) -> str:
        """The file holding `name` (its main stored tensor), for messages."""
        entry = self._entries.get(name)
        return str(self._file_of[entry.parts[0]]) if entry else self.location


class PrefixedWeights:
    """A view of another source under a name prefix (Kimi K2.5 keeps its text model under
    ``language_model.``), so model code can use the plain HF text-model names."""

    def __init__(self, inner: WeightSource, prefix: str):
        self.inner = inner
        self.prefix = prefix
        self.location = location(inner)
        self.checkpoint = checkpoint_kind(inner)

    def get(self, name: str) -> Any:
        return self.inner.get(self.prefix + name)

    def keys(self) -> Iterable[str]:
        n = len(self.prefix)
        return [k[n:] for k in self.inner.keys() if k.startswith(self.prefix)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (self.prefix + name) in self.inner


def open_weights(path: str | os.PathLike) -> WeightSource:
    """The weight source for a checkpoint path: a safetensors directory or file, or a GGUF model
    (a file, whatever its name, or a folder without safetensors: ``gguf_weights.open_gguf``
    picks the GGUF by the rule every loader follows)."""
    p = Path(path)
    gguf_folder = p.is_dir() and not any(p.glob("*.safetensors")) and any(p.glob("*.gguf"))
    if p.suffix == ".gguf" or is_gguf_file(p) or gguf_folder:
        try:
            from hybridmoe.backend.formats import gguf_weights
        except ImportError:
            raise UnsupportedModelError(
                f"{p}: GGUF files are not readable by the embedded engine in this build",
                "Run this model with `--backend llamacpp`.",
            ) from None
        # The GGUF source exposes the same HF names (its module maps GGUF names to them).
        return gguf_weights.open_gguf(p)
    return SafetensorsWeights(p)


def text_model_weights(weights: WeightSource) -> WeightSource:
    """The text model's tensors under plain names, whatever wrapper the checkpoint uses."""
    prefix = "language_model."
    if f"{prefix}model.embed_tokens.weight" in weights:
        return PrefixedWeights(weights, prefix)
    return weights


def dense(t: Any, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """A plain tensor in `dtype` on `device` from a stored tensor or a quant object.

    A stored tensor already in that dtype and on that device is returned as is (still a
    view of the mapped file), so nothing is copied on a CPU-only machine.
    """
    if isinstance(t, torch.Tensor):
        return t.to(device=device, dtype=dtype)
    return t.dequantize(dtype, device=device)
