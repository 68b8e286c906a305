"""Reading the tensor list of safetensors checkpoints from their headers only.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor
names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end
of the header), then the data. We read the length and the header and never the data, and
check everything a truncated or damaged download breaks, so that sizing never rests on a
file that cannot be loaded.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.formats import SAFETENSORS_DTYPES

# safetensors itself refuses headers above 100 MB; a larger length is a damaged file.
MAX_HEADER_BYTES = 100_000_000

_REDOWNLOAD = "The download is incomplete or damaged; delete the file and download it again."


@dataclass(frozen=True)
class TensorRecord:
    """One tensor as a file describes it: name, storage dtype/type, shape (PyTorch order for
    safetensors, ``[..., ne1, ne0]`` for GGUF) and the bytes it occupies."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str


def read_header(path: str | os.PathLike[str]) -> list[TensorRecord]:
    """The tensors a safetensors file holds, validated against the file's size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ModelError(f"{path} is truncated: {size} bytes, too short for a safetensors header.",
                                 _REDOWNLOAD)
            (length,) = struct.unpack("<Q", prefix)
            if length > size - 8:
                raise ModelError(
                    f"{path} is truncated: its header claims {length:,} bytes but the file has only "
                    f"{size - 8:,} after the length field.",
                    _REDOWNLOAD,
                )
            if length > MAX_HEADER_BYTES:
                raise ModelError(f"{path} declares a {length:,}-byte header, more than safetensors allows.",
                                 _REDOWNLOAD)
            raw = fh.read(length)
    except OSError as exc:
        raise ModelError(f"Cannot read {path}: {exc.strerror or exc}.",
                         "Check that the file exists and is readable.") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} is not a safetensors file: its header is not valid JSON ({exc}).",
                         _REDOWNLOAD) from exc
    if not isinstance(header, dict):
        raise ModelError(f"{path} is not a safetensors file: its header is not a JSON object.", _REDOWNLOAD)

    data_size = size - 8 - length
    records = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        records.append(_record(path, name, info, data_size))
    return records


def _record(path: Path, name: str, info: object, data_size: int) -> TensorRecord:
    def bad(why: str) -> ModelError:
        return ModelError(f"{path}: tensor '{name}' {why}.", _REDOWNLOAD)

    if not isinstance(info, dict):
        raise bad("has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not all(
        isinstance(d, int) and d >= 0 for d in shape
    ):
        raise bad(f"has a malformed dtype or shape ({dtype!r}, {shape!r})")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has malformed data_offsets {offsets!r}")
    begin, end = offsets
    if end > data_size:
        raise ModelError(
            f"{path} is truncated: tensor '{name}' ends at byte {end:,} of the data section, "
            f"which holds only {data_size:,} bytes.",
            _REDOWNLOAD,
        )
    nbytes = end - begin
    itemsize = SAFETENSORS_DTYPES.get(dtype, (None, None))[0]
    if itemsize is not None and nbytes != math.prod(shape) * itemsize:
        raise bad(f"takes {nbytes:,} bytes but {dtype} {shape} needs {math.prod(shape) * itemsize:,}")
    return TensorRecord(name, dtype, tuple(shape), nbytes, str(path))


def checkpoint_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The safetensors shards of a checkpoint directory, in order.

    With ``model.safetensors.index.json`` the shards are the files its weight_map names, and
    all must be there; without it, every ``*.safetensors`` file in the directory.
    """
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return sorted(directory.glob("*.safetensors"))
    weight_map = read_index(index)
    names = sorted(set(weight_map.values()))
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ModelError(
            f"{directory} is missing {missing[0]}{more}, listed in model.safetensors.index.json.",
            "The download is incomplete; resume it (hybridmoe pull, or huggingface-cli download).",
        )
    return [directory / n for n in names]


def read_index(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{index} cannot be read as JSON ({exc}).", _REDOWNLOAD) from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ModelError(f"{index} has no valid 'weight_map'.", _REDOWNLOAD)
    return weight_map


def read_checkpoint(directory: str | os.PathLike[str]) -> tuple[list[Path], list[TensorRecord]]:
    """The shards of a checkpoint and the tensors of all of them, cross-checked with the index."""
    directory = Path(directory)
    files = checkpoint_files(directory)
    records = [r for f in files for r in read_header(f)]
    index = directory / "model.safetensors.index.json"
    if index.exists():
        where = {r.name: Path(r.file).name for r in records}
        for tensor, shard in read_index(index).items():
            if where.get(tensor) != shard:
                raise ModelError(
                    f"{directory / shard} does not hold tensor '{tensor}', which "
                    "model.safetensors.index.json places there.",
                    "The shard is from another revision or damaged; download it again.",
                )
    return files, records
