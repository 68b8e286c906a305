"""Reading GGUF files (single or split ``-0000k-of-0000N.gguf`` sets): metadata and tensor
infos only.

``gguf.GGUFReader`` maps the file and builds views of the tensor data without reading it;
building those views is also what notices a truncated file, so every failure of the reader
becomes one ``ModelError`` naming the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from backend.errors import ModelError
from backend.models.formats import ggml_type_name
from backend.models.safetensors_files import TensorRecord

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# Arrays longer than this (token lists, merges, scores) are not decoded: nothing here needs
# their contents, and decoding 150k strings costs more than reading the rest of the header.
_MAX_DECODED_ARRAY = 1024

_REDOWNLOAD = "The download is incomplete or damaged; delete the file and download it again."


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


def split_parts(path: str | os.PathLike[str]) -> list[Path]:
    """All files of the set `path` belongs to (just `path` if it is not part of a split)."""
    path = Path(path)
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    parts = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelError(
            f"{path.name} is part of a {count}-file GGUF set, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}.",
            "Download every part of the set into the same folder.",
        )
    return parts


def open_reader(path: Path) -> GGUFReader:
    if not path.is_file():
        raise ModelError(f"{path} does not exist.", "Check the path.")
    if path.stat().st_size == 0:
        raise ModelError(f"{path} is empty.", _REDOWNLOAD)
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError) as exc:
        if "magic" in str(exc):
            raise ModelError(f"{path} is not a GGUF file (it does not start with 'GGUF').",
                             "Pick a .gguf file written by llama.cpp's tools, or a model folder.") from exc
        # The reader fails where the file ends early (a header field or a tensor's data cut
        # off); its own wording is kept as a detail for bug reports.
        raise ModelError(f"{path} cannot be read as GGUF: it is truncated or damaged (detail: {exc}).",
                         _REDOWNLOAD) from exc


def metadata_of(reader: GGUFReader) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > _MAX_DECODED_ARRAY:
                metadata[key] = GGUFArray(field.types[-1].name.lower(), len(field.data))
            elif field.types and field.types[-1] == GGUFValueType.FLOAT32:
                # Shortest decimal that round-trips in float32: 1e-06, not 9.99999997e-07.
                value = field.contents()
                metadata[key] = ([float(str(np.float32(v))) for v in value] if isinstance(value, list)
                                 else float(str(np.float32(value))))
            else:
                metadata[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise ModelError(f"GGUF key '{key}' cannot be decoded ({exc}).", _REDOWNLOAD) from exc
    return metadata


def read_gguf(path: str | os.PathLike[str]) -> GGUFContents:
    """Metadata of the first file of the set and the tensor infos of every file."""
    parts = split_parts(path)
    tensors: list[TensorRecord] = []
    metadata: dict[str, Any] = {}
    for i, part in enumerate(parts):
        reader = open_reader(part)
        part_meta = metadata_of(reader)
        if i == 0:
            metadata = part_meta
        if len(parts) > 1:
            _check_split(part, part_meta, i, len(parts))
        for t in reader.tensors:
            tensors.append(TensorRecord(
                name=t.name,
                dtype=ggml_type_name(t.tensor_type),
                shape=tuple(int(d) for d in reversed(t.shape.tolist())),
                nbytes=int(t.n_bytes),
                file=str(part),
            ))
        del reader  # release the mapping
    if len(parts) > 1:
        expected = metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(tensors):
            raise ModelError(
                f"The GGUF set {parts[0].name} lists {expected} tensors but its parts hold {len(tensors)}.",
                "A part is from another download; download every part again.",
            )
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise ModelError(f"Tensor '{t.name}' appears twice in the GGUF set {parts[0].name}.", _REDOWNLOAD)
        seen.add(t.name)
    return GGUFContents(tuple(parts), metadata, tuple(tensors))


def _check_split(part: Path, meta: dict[str, Any], index: int, count: int) -> None:
    no, total = meta.get("split.no"), meta.get("split.count")
    if no is None or total is None:
        return  # older split tools did not write split.* keys into every part
    if int(no) != index or int(total) != count:
        raise ModelError(
            f"{part.name} says it is part {int(no) + 1} of {int(total)}, but its name makes it part "
            f"{index + 1} of {count}.",
            "The parts come from different downloads; download every part again.",
        )
