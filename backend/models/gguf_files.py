"""Reading GGUF files (single or split ``-0000k-of-0000N.gguf`` sets): metadata and tensor
infos only, through the project's GGUF reader (``hybridmoe.backend.models.gguf_reader``), which
checks the header and every tensor's place in the file, so a truncated or damaged file is
one ``ModelError`` naming the file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from hybridmoe.backend.models.formats import ggml_type_name
from hybridmoe.backend.models.gguf_reader import SPLIT_NAME, GGUFFile, open_gguf_file, open_gguf_set, split_parts
from hybridmoe.backend.models.safetensors_files import TensorRecord

__all__ = ["SPLIT_NAME", "GGUFArray", "GGUFContents", "metadata_of", "open_reader", "read_gguf", "split_parts"]

# Arrays longer than this (token lists, merges, scores) are not decoded: nothing here needs
# their contents, and decoding 150k strings costs more than reading the rest of the header.
_MAX_DECODED_ARRAY = 1024


@dataclass(frozen=True)
class GGUFArray:
    """Stands in for a long metadata array: its element type and length (``len()`` works)."""

    item_type: str
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class GGUFContents:
    files: tuple[Path, ...]
    metadata: dict[str, Any]  # the first file's key/values
    tensors: tuple[TensorRecord, ...]  # dtype: storage format name; shape in PyTorch order


def open_reader(path: Path) -> GGUFFile:
    """One GGUF file, parsed (``ModelError`` naming it if it is missing, empty, not GGUF,
    truncated or damaged). Big-endian files are read: inspecting one needs no tensor data."""
    return open_gguf_file(path, allow_big_endian=True)


def metadata_of(reader: GGUFFile) -> dict[str, Any]:
    """The file's key/values; arrays longer than 1024 elements as ``GGUFArray`` (undecoded),
    float32 values as the shortest decimal that round-trips in float32 (1e-06, not 9.99999997e-07)."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.is_array and field.count > _MAX_DECODED_ARRAY:
            metadata[key] = GGUFArray(field.item_type.name.lower(), field.count)
        elif field.type == GGUFValueType.FLOAT32 or field.item_type == GGUFValueType.FLOAT32:
            value = reader[key]
            metadata[key] = ([float(str(np.float32(v))) for v in value] if isinstance(value, list)
                             else float(str(np.float32(value))))
        else:
            metadata[key] = reader[key]
    return metadata


def read_gguf(path: str | os.PathLike[str]) -> GGUFContents:
    """Metadata of the first file of the set and the tensor infos of every file."""
    files = open_gguf_set(path, allow_big_endian=True)
    try:
        metadata = metadata_of(files[0])
        tensors = tuple(
            TensorRecord(name=t.name, dtype=ggml_type_name(t.ggml_type), shape=t.shape, nbytes=t.nbytes, file=str(g.path))
            for g in files for t in g.tensors
        )
    finally:
        for g in files:
            g.close()  # release the mappings
    return GGUFContents(tuple(g.path for g in files), metadata, tensors)
