"""The project's one reader of GGUF files: metadata and tensor infos, parsed from a read-only
mmap with ``struct`` and numpy, and the tensors' bytes as zero-copy views of that mapping.

gguf-py's ``GGUFReader`` builds a numpy view for every metadata element, which takes tens of
seconds for a 150k-token vocabulary; this reader walks the header once (a string array costs
one ``struct`` call per element) and decodes arrays only when asked for them, so opening any
GGUF takes a small fraction of a second. Everything that reads GGUF headers uses it:
``gguf_files`` (inspection), ``formats.gguf_weights`` (weights, whose mapping also gives the
engine's tokenizer its vocabulary), ``text.tokenizer`` (vocabularies of a bare GGUF) and
``llamacpp.header`` (the llama.cpp backend's checks). Which file a path means is not decided
here but in ``model_files.resolve_model_files``.

Layout (versions 2 and 3, which differ only in that 3 may be big-endian)::

    "GGUF" | u32 version | u64 tensor count | u64 key count
    key count    × ( string key | u32 value type | value )
    tensor count × ( string name | u32 n_dims | n_dims × u64 ne | u32 ggml type | u64 offset )
    padding to general.alignment (default 32) | tensor data (offsets count from here)

A string is a u64 byte length and UTF-8 bytes; an array a u32 element type, a u64 count and
the elements. Nothing read from the file is trusted: every length and count is checked
against the bytes left in the file before anything is allocated or looped over, so a damaged
or truncated file fails at once with a ``GGUFError`` (a ``ModelError``) naming the file and
what is wrong with it.
"""

from __future__ import annotations

import glob
import math
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from hybridmoe.backend.errors import ModelError, UnsupportedModelError

__all__ = [
    "GGUF_MAGIC",
    "REDOWNLOAD",
    "SPLIT_NAME",
    "GGUFError",
    "GGUFField",
    "GGUFFile",
    "GGUFTensorInfo",
    "UnsupportedGGUFError",
    "open_gguf_file",
    "open_gguf_set",
    "read_metadata",
    "split_parts",
]

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml refuses tensors with more
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

REDOWNLOAD = "The download is incomplete or damaged; delete the file and download it again."

# Value types (GGUFValueType) as plain ints: the parser compares them in its inner loops.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR_CODES = {_UINT8: "B", _INT8: "b", _UINT16: "H", _INT16: "h", _UINT32: "I", _INT32: "i",
                 _FLOAT32: "f", _BOOL: "?", _UINT64: "Q", _INT64: "q", _FLOAT64: "d"}
_SCALAR_SIZES = {t: struct.calcsize("<" + c) for t, c in _SCALAR_CODES.items()}
# The fewest bytes one element of an array can take: a string is at least its u64 length,
# a nested array its u32 type and u64 count.
_MIN_ITEM_SIZE = {**_SCALAR_SIZES, _STRING: 8, _ARRAY: 12}
_MIN_KV_SIZE = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_SIZE = 8 + 4 + 4 + 8  # name length, n_dims, type, offset


class GGUFError(ModelError):
    """A GGUF file that cannot be read. ``path`` is the file, ``problem`` what is wrong with it
    (without the file's name), for callers that word the message their own way; ``damaged``
    tells a truncated or inconsistent file from one that is missing, unreadable or not GGUF."""

    def __init__(self, path: str | os.PathLike[str], problem: str, what: str | None = None,
                 hint: str | None = REDOWNLOAD):
        self.path = Path(path)
        self.problem = problem
        self.damaged = what is None  # truncated or inconsistent, as opposed to missing, not GGUF, ...
        super().__init__(what or f"{path} cannot be read as GGUF: it is truncated or damaged ({problem}).", hint)


class UnsupportedGGUFError(GGUFError, UnsupportedModelError):
    """A well-formed GGUF this reader does not read (big-endian, version 1, unknown ggml type)."""


class _Damaged(Exception):
    """Raised inside the parser, turned into a GGUFError naming the file."""


@dataclass(frozen=True, slots=True)
class GGUFField:
    """Where one metadata value lies in the file, and its type."""

    key: str
    type: GGUFValueType
    item_type: GGUFValueType | None  # arrays: the type of their elements
    count: int | None  # arrays: how many elements
    offset: int  # the value's first byte (for arrays: the first element)
    end: int  # one past its last byte

    @property
    def is_array(self) -> bool:
        return self.type == GGUFValueType.ARRAY


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One entry of the tensor directory. ``ne`` is GGUF's order (the contiguous row first),
    ``shape`` PyTorch's (outermost first); ``offset`` is absolute, from the start of the file."""

    name: str
    ggml_type: GGMLQuantizationType | int  # an int only for types gguf-py does not know
    ne: tuple[int, ...]
    offset: int
    nbytes: int | None  # None only for types gguf-py does not know
    file: Path

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return math.prod(self.ne)

    @property
    def type_name(self) -> str:
        """``q8_0``, ``f16``, ... (``type42`` for a type gguf-py does not know)."""
        t = self.ggml_type
        return t.name.lower() if isinstance(t, GGMLQuantizationType) else f"type{t}"


class GGUFFile:
    """One GGUF file, mapped read-only; see the module doc. Made by ``open_gguf_file``.

    Metadata: ``fields`` (key -> ``GGUFField``, in file order), ``get``/``[]``/``in`` for
    decoded values (scalars are decoded while parsing, arrays on each access, into a new
    list), ``metadata`` for all of them as one dict, ``numeric_array`` for a numeric array as
    a numpy view. Values are what gguf-py's ``ReaderField.contents()`` gives: Python ints,
    floats (a float32 widened exactly), bools, strings and lists; nested arrays are nested
    lists. Tensors: ``tensors`` (``GGUFTensorInfo``), ``tensor(name)``, and ``tensor_bytes``
    for a tensor's data as a uint8 view of the mapping (``data`` is the whole file).
    """

    def __init__(self, path: Path, mapping: mmap.mmap, *, tensors: bool = True, allow_big_endian: bool = False,
                 allow_unknown_types: bool = False):
        self.path = path
        self._mm: mmap.mmap | None = mapping
        self.size = len(mapping)
        self.version = 0
        self.byte_order = "<"  # struct's notation: "<" little-endian, ">" big-endian
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset: int | None = None  # start of the tensor data (None if tensors were not read)
        self.fields: dict[str, GGUFField] = {}
        self.tensors: tuple[GGUFTensorInfo, ...] = ()
        self._values: dict[str, Any] = {}
        self._by_name: dict[str, GGUFTensorInfo] | None = None
        self._data: np.ndarray | None = None
        self._where: str | None = None  # what the parser is reading, for its error messages
        self._parse(tensors, allow_big_endian, allow_unknown_types)

    # ---- metadata ----------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self.fields

    def keys(self) -> list[str]:
        return list(self.fields)

    def __getitem__(self, key: str) -> Any:
        f = self.fields[key]  # KeyError for a missing key
        if not f.is_array:
            return self._values[key]  # scalars and strings were decoded by the parser
        # Arrays are decoded on each access, into a new list (as GGUFReader's contents() does):
        # nothing decodes a 150k-token vocabulary that does not ask for it.
        return _decode_array(self._mapping(), self.byte_order, int(f.item_type), f.count, f.offset)[0]

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self.fields else default

    @property
    def metadata(self) -> dict[str, Any]:
        """Every key with its decoded value, in file order (decodes every array)."""
        return {key: self[key] for key in self.fields}

    def numeric_array(self, key: str) -> np.ndarray:
        """A numeric array as a read-only numpy view of the mapping (no copy, no decoding)."""
        f = self.fields[key]
        if not f.is_array or int(f.item_type) not in _SCALAR_CODES:
            raise TypeError(f"GGUF key {key!r} is not an array of numbers")
        dtype = np.dtype(self.byte_order + _SCALAR_CODES[int(f.item_type)])
        return np.frombuffer(self._mapping(), dtype=dtype, count=f.count, offset=f.offset)

    # ---- tensors -----------------------------------------------------------------------

    def tensor(self, name: str) -> GGUFTensorInfo:
        if self._by_name is None:
            self._by_name = {t.name: t for t in self.tensors}
        return self._by_name[name]

    @property
    def data(self) -> np.ndarray:
        """The whole file as a read-only uint8 numpy array over the mapping."""
        if self._data is None:
            self._data = np.frombuffer(self._mapping(), dtype=np.uint8)
        return self._data

    def tensor_bytes(self, tensor: GGUFTensorInfo | str) -> np.ndarray:
        """A tensor's data as a uint8 view of the mapping (zero-copy)."""
        t = self.tensor(tensor) if isinstance(tensor, str) else tensor
        if t.nbytes is None:
            raise UnsupportedGGUFError(self.path, f"tensor '{t.name}' has ggml type {t.ggml_type}",
                                       f"{self.path}: tensor '{t.name}' has ggml type {t.ggml_type}, which gguf-py "
                                       "does not know, so its size is unknown.", _UNKNOWN_TYPE_HINT)
        return self.data[t.offset:t.offset + t.nbytes]

    # ---- lifetime ----------------------------------------------------------------------

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"{self.path} has been closed")
        return self._mm

    def close(self) -> None:
        """Release the mapping. Views handed out (``data``, ``tensor_bytes``, tensors made
        from them) stay valid: the mapping then goes when the last of them does."""
        mm, self._mm, self._data = self._mm, None, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views exist; the mapping closes when they are gone
                pass

    @property
    def closed(self) -> bool:
        return self._mm is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path.name!r}, v{self.version}, {len(self.fields)} keys, {len(self.tensors)} tensors)"

    # ---- parsing -----------------------------------------------------------------------

    def _parse(self, read_tensors: bool, allow_big_endian: bool, allow_unknown_types: bool) -> None:
        buf, size, path = self._mm, self.size, self.path
        if buf[:4] != GGUF_MAGIC:
            if size < 4 and GGUF_MAGIC.startswith(buf[:size]):
                raise GGUFError(path, f"the file has only {size} bytes")
            raise GGUFError(path, "no GGUF magic", f"{path} is not a GGUF file (it does not start with 'GGUF').",
                            "Pick a .gguf file written by llama.cpp's tools, or a model folder.")
        if size < 24:
            raise GGUFError(path, f"the file has {size} bytes, less than the 24 of a GGUF header")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in SUPPORTED_VERSIONS and version != 1:
            (swapped,) = struct.unpack_from(">I", buf, 4)
            if swapped in (1, *SUPPORTED_VERSIONS):
                if not allow_big_endian:
                    raise UnsupportedGGUFError(
                        path, "big-endian", f"{path} is a big-endian GGUF.",
                        "Use the little-endian file of this model (big-endian GGUFs are made for s390x machines).")
                self.byte_order = ">"
                version = swapped
        if version == 1:
            raise UnsupportedGGUFError(path, "GGUF version 1", f"{path} is a GGUF of version 1 (2023), which is no longer read.",
                                       "Download or convert the model again; current files are GGUF version 3.")
        if version not in SUPPORTED_VERSIONS:
            raise GGUFError(path, f"unknown GGUF version {version}")
        self.version = version
        order = self.byte_order
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        where = "the header"
        try:
            pos = 24
            if n_kv > (size - pos) // _MIN_KV_SIZE:
                raise _Damaged(f"it claims {n_kv} metadata keys, more than its {size} bytes can hold")
            pos = self._parse_kv(n_kv, pos)
            if not read_tensors:
                return
            where = "the tensor directory"
            if n_tensors > (size - pos) // _MIN_TENSOR_INFO_SIZE:
                raise _Damaged(f"it claims {n_tensors} tensors, more than its {size - pos} bytes left can hold")
            raw, pos = self._parse_tensor_infos(n_tensors, pos)
        except (struct.error, OverflowError):
            # struct.unpack_from read past the end (or at an offset beyond any file, which a
            # damaged length gives): the file stops inside `where`.
            raise GGUFError(path, f"the file ends inside {self._where or where}") from None
        except _Damaged as exc:
            raise GGUFError(path, str(exc)) from None
        self._place_tensors(raw, pos, allow_unknown_types)

    def _parse_kv(self, n_kv: int, pos: int) -> int:
        buf, size, order = self._mm, self.size, self.byte_order
        u32 = struct.Struct(order + "I").unpack_from
        fields, values = self.fields, self._values
        for i in range(n_kv):
            self._where = f"metadata key #{i + 1} of {n_kv}"
            key, pos = _read_string(buf, size, order, pos, self._where)
            self._where = f"the value of metadata key '{key}'"
            (vtype,) = u32(buf, pos)
            pos += 4
            if key in fields:
                raise _Damaged(f"metadata key '{key}' appears twice")
            start = pos
            if vtype == _ARRAY:
                (itype, count) = struct.unpack_from(order + "IQ", buf, pos)
                pos += 12
                if itype not in _MIN_ITEM_SIZE:
                    raise _Damaged(f"metadata key '{key}' is an array of unknown value type {itype}")
                if count > (size - pos) // _MIN_ITEM_SIZE[itype]:
                    raise _Damaged(f"metadata array '{key}' claims {count} elements, more than the "
                                   f"{size - pos} bytes left in the file can hold")
                end = _skip_array(buf, size, order, itype, count, pos, key)
                fields[key] = GGUFField(key, GGUFValueType.ARRAY, GGUFValueType(itype), count, pos, end)
                pos = end
                continue
            if vtype == _STRING:
                values[key], pos = _read_string(buf, size, order, pos, f"metadata string '{key}'")
            elif vtype in _SCALAR_CODES:
                (values[key],) = struct.unpack_from(order + _SCALAR_CODES[vtype], buf, pos)
                pos += _SCALAR_SIZES[vtype]
            else:
                raise _Damaged(f"metadata key '{key}' has unknown value type {vtype}")
            fields[key] = GGUFField(key, GGUFValueType(vtype), None, None, start, pos)
        self._where = None
        return pos

    def _parse_tensor_infos(self, n_tensors: int, pos: int) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
        buf, size, order = self._mm, self.size, self.byte_order
        u32 = struct.Struct(order + "I").unpack_from
        type_offset = struct.Struct(order + "IQ").unpack_from
        raw = []
        for i in range(n_tensors):
            self._where = f"tensor info #{i + 1} of {n_tensors}"
            name, pos = _read_string(buf, size, order, pos, self._where + "'s name")
            self._where = f"the tensor info of '{name}'"
            (n_dims,) = u32(buf, pos)
            pos += 4
            if n_dims > MAX_DIMS:
                raise _Damaged(f"tensor '{name}' has {n_dims} dimensions (ggml allows at most {MAX_DIMS})")
            ne = struct.unpack_from(f"{order}{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            gtype, offset = type_offset(buf, pos)
            pos += 12
            raw.append((name, ne, gtype, offset))
        self._where = None
        return raw, pos

    def _place_tensors(self, raw: list[tuple[str, tuple[int, ...], int, int]], pos: int, allow_unknown_types: bool) -> None:
        path, size = self.path, self.size
        f = self.fields.get("general.alignment")
        if f is not None:
            if f.type != GGUFValueType.UINT32:
                raise GGUFError(path, f"general.alignment is a {f.type.name.lower()}, not a uint32")
            alignment = self._values["general.alignment"]
            if alignment == 0 or alignment & (alignment - 1):
                raise GGUFError(path, f"general.alignment is {alignment}, not a power of two")
            self.alignment = alignment
        self.data_offset = data_offset = pos + (-pos % self.alignment)
        tensors = []
        seen: set[str] = set()
        for name, ne, gtype, offset in raw:
            if name in seen:
                raise GGUFError(path, f"tensor '{name}' appears twice")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(gtype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                if not allow_unknown_types:
                    raise UnsupportedGGUFError(
                        path, f"tensor '{name}' has unknown ggml type {gtype}",
                        f"{path}: tensor '{name}' has ggml type {gtype}, which gguf-py does not know.",
                        _UNKNOWN_TYPE_HINT) from None
                tensors.append(GGUFTensorInfo(name, gtype, ne, data_offset + offset, None, path))
                continue
            if ne and ne[0] % block:
                raise GGUFError(path, f"tensor '{name}' has rows of {ne[0]} values, not whole {qtype.name} "
                                      f"blocks of {block}")
            n = math.prod(ne)
            if n >= 1 << 62:
                raise GGUFError(path, f"tensor '{name}' has an impossible shape {list(ne)}")
            nbytes = n // block * type_size
            if offset % self.alignment:
                raise GGUFError(path, f"tensor '{name}' has data offset {offset}, not a multiple of the "
                                      f"alignment {self.alignment}")
            start = data_offset + offset
            if start + nbytes > size:
                raise GGUFError(path, f"tensor '{name}' data is not within the file bounds: it ends at byte "
                                      f"{start + nbytes}, the file has {size}")
            tensors.append(GGUFTensorInfo(name, qtype, ne, start, nbytes, path))
        self.tensors = tuple(tensors)


_UNKNOWN_TYPE_HINT = ("The file is damaged, or uses a quantization newer than this installation: update the gguf "
                      "package (pip install -U gguf), or run the model with the llama.cpp backend.")


def _read_string(buf: mmap.mmap, size: int, order: str, pos: int, what: str) -> tuple[str, int]:
    (n,) = struct.unpack_from(order + "Q", buf, pos)
    pos += 8
    if n > size - pos:
        raise _Damaged(f"{what} is {n} bytes long, but only {size - pos} bytes are left in the file")
    return buf[pos:pos + n].decode("utf-8", errors="replace"), pos + n


def _skip_array(buf: mmap.mmap, size: int, order: str, itype: int, count: int, pos: int, key: str) -> int:
    """The end of an array's elements (its count already checked against the bytes left)."""
    if itype in _SCALAR_SIZES:
        return pos + count * _SCALAR_SIZES[itype]
    if itype == _STRING:
        # One struct call per string: a 150k-token vocabulary is walked in tens of milliseconds.
        # A damaged length sends `pos` past the end, where the next unpack raises struct.error.
        u64 = struct.Struct(order + "Q").unpack_from
        for _ in range(count):
            pos += 8 + u64(buf, pos)[0]
        if pos > size:
            raise _Damaged(f"the last string of metadata array '{key}' ends past the end of the file")
        return pos
    for _ in range(count):  # arrays of arrays
        (sub, n) = struct.unpack_from(order + "IQ", buf, pos)
        pos += 12
        if sub not in _MIN_ITEM_SIZE:
            raise _Damaged(f"metadata array '{key}' holds an array of unknown value type {sub}")
        if n > (size - pos) // _MIN_ITEM_SIZE[sub]:
            raise _Damaged(f"an array inside metadata array '{key}' claims {n} elements, more than the "
                           f"{size - pos} bytes left in the file can hold")
        pos = _skip_array(buf, size, order, sub, n, pos, key)
    return pos


def _decode_array(buf: mmap.mmap, order: str, itype: int, count: int, pos: int) -> tuple[list[Any], int]:
    """An array already validated by ``_skip_array``, as a list; and the position after it."""
    if itype in _SCALAR_CODES:
        dtype = np.dtype(order + _SCALAR_CODES[itype])
        return np.frombuffer(buf, dtype=dtype, count=count, offset=pos).tolist(), pos + count * dtype.itemsize
    if itype == _STRING:
        u64 = struct.Struct(order + "Q").unpack_from
        out: list[Any] = []
        append = out.append  # a local name: this loop runs 10^5 times for a vocabulary
        for _ in range(count):
            (n,) = u64(buf, pos)
            pos += 8
            append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        return out, pos
    out = []
    for _ in range(count):
        (sub, n) = struct.unpack_from(order + "IQ", buf, pos)
        value, pos = _decode_array(buf, order, sub, n, pos + 12)
        out.append(value)
    return out, pos


# --------------------------------------------------------------------------------------
# Opening files and split sets
# --------------------------------------------------------------------------------------


def open_gguf_file(path: str | os.PathLike[str], *, tensors: bool = True, allow_big_endian: bool = False,
                   allow_unknown_types: bool = False) -> GGUFFile:
    """Map and parse one GGUF file. Raises ``GGUFError`` (a ``ModelError``) if it is missing,
    empty, not GGUF, truncated or damaged; ``UnsupportedGGUFError`` for big-endian files
    (unless ``allow_big_endian``: metadata and tensor infos are then read, the data is not
    usable as little-endian), version 1, or a ggml type gguf-py does not know (unless
    ``allow_unknown_types``: such tensors then have ``nbytes`` None). ``tensors=False``
    reads the metadata only (the tensor directory is then neither read nor checked)."""
    path = Path(path)
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise GGUFError(path, "missing", f"{path} does not exist.", "Check the path.") from None
    except IsADirectoryError:
        raise GGUFError(path, "a directory", f"{path} is a directory, not a GGUF file.", "Give the path of the .gguf file.") from None
    except OSError as exc:
        raise GGUFError(path, str(exc), f"{path} cannot be read: {exc.strerror or exc}.",
                        "Check that the file is readable.") from None
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise GGUFError(path, "empty", f"{path} is empty.", REDOWNLOAD)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise GGUFError(path, str(exc), f"{path} cannot be read: {exc.strerror or exc}.",
                            "Check that the file is readable.") from None
    try:
        return GGUFFile(path, mapping, tensors=tensors, allow_big_endian=allow_big_endian,
                        allow_unknown_types=allow_unknown_types)
    except BaseException:
        mapping.close()
        raise


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key/value metadata of one GGUF file, every array decoded (its tensors are not read).
    Big-endian files are read too: decoded values do not depend on the byte order."""
    with open_gguf_file(path, tensors=False, allow_big_endian=True) as g:
        return g.metadata


# A name that means a split part but is not written as llama.cpp writes them (other digit
# counts, another case): "Model-1-of-3.gguf", "model-00001-OF-00003.GGUF".
_SPLIT_LIKE = re.compile(r"^(?P<stem>.*)-(?P<no>\d+)-of-(?P<count>\d+)\.gguf$", re.IGNORECASE)
SPLIT_NAME_HINT = ("llama.cpp finds the parts of a split set by their names, NAME-00001-of-0000N.gguf to "
                   "NAME-0000N-of-0000N.gguf (five digits each) in one folder: give the parts those names, "
                   "or merge them into one file with llama-gguf-split --merge.")


def split_parts(path: str | os.PathLike[str]) -> list[Path]:
    """All files of the set `path` belongs to (just `path` if it is not part of a split), by
    their names. A part missing, a name whose numbers make no sense, or parts of another split
    of the same name beside them: one ``ModelError`` saying which."""
    path = Path(path)
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    no, count = int(m.group("no")), int(m.group("count"))
    if not 1 <= no <= count:
        raise ModelError(f"{path.name} is named as part {no} of a {count}-file GGUF set, which cannot be.",
                         SPLIT_NAME_HINT)
    parts = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        others = sorted({int(o.group("count")) for f in path.parent.glob(f"{glob.escape(m.group('stem'))}-*-of-*.gguf")
                         if (o := SPLIT_NAME.match(f.name)) and o.group("stem") == m.group("stem")} - {count})
        other_sets = (f" The folder also holds parts of a {' and a '.join(map(str, others))}-file split of the same "
                      "name: those belong to another set (another download or another split of the model)."
                      if others else "")
        raise ModelError(
            f"{path.name} is part of a {count}-file GGUF set, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {path.parent}.{other_sets}",
            "Download every part of the set into the same folder.",
        )
    return parts


def open_gguf_set(path: str | os.PathLike[str], **options: Any) -> list[GGUFFile]:
    """Every part of the GGUF set `path` belongs to (one file if it is not split), opened with
    ``open_gguf_file(part, **options)`` and checked against each other: split.no/split.count
    against the file names, split.tensors.count against the tensors found, and no tensor name
    twice. Close the files (or let them go) when done."""
    parts = split_parts(path)
    files: list[GGUFFile] = []
    try:
        for i, part in enumerate(parts):
            g = open_gguf_file(part, **options)
            files.append(g)
            if len(parts) > 1:
                _check_split(g, i, len(parts))
                _check_same_set(files[0], g)
        if len(parts) == 1:
            _check_not_a_part(files[0])
        if options.get("tensors", True):
            _check_set_tensors(files)
    except BaseException:
        for g in files:
            g.close()
        raise
    return files


def _check_split(g: GGUFFile, index: int, count: int) -> None:
    no, total = g.get("split.no"), g.get("split.count")
    if not isinstance(no, int) or not isinstance(total, int):
        return  # older split tools did not write split.* keys into every part
    if no != index or total != count:
        raise ModelError(
            f"{g.path.name} says it is part {no + 1} of {total}, but its name makes it part {index + 1} of {count}.",
            "The parts come from different downloads; download every part again.",
        )


def _check_same_set(first: GGUFFile, g: GGUFFile) -> None:
    """A part whose split.tensors.count differs from the first part's is from another set (the
    same name pattern and count, another model or another split of it)."""
    mine, theirs = g.get("split.tensors.count"), first.get("split.tensors.count")
    if g is first or not isinstance(mine, int) or not isinstance(theirs, int) or mine == theirs:
        return
    raise ModelError(
        f"{g.path.name} belongs to another GGUF set than {first.path.name}: it says the set holds {mine} tensors, "
        f"{first.path.name} says {theirs} (split.tensors.count).",
        "The parts come from different models or downloads; download every part of the set again into one folder.",
    )


def _check_not_a_part(g: GGUFFile) -> None:
    """A file that says it is one part of a split set (split.count > 1) but whose name does not
    lead to the others: the model would be missing most of its tensors."""
    no, count = g.get("split.no"), g.get("split.count")
    if not isinstance(count, int) or count <= 1:
        return
    part = f"part {no + 1} of a {count}-file" if isinstance(no, int) else f"one part of a {count}-file"
    loose = _SPLIT_LIKE.match(g.path.name)
    named = (f"its name is not written as llama.cpp writes split names (five digits: "
             f"{loose.group('stem')}-{int(loose.group('no')):05d}-of-{int(loose.group('count')):05d}.gguf)"
             if loose else "its name does not follow the NAME-00001-of-0000N.gguf pattern")
    raise ModelError(f"{g.path} is {part} split GGUF set (its split.count key), but {named}, so the other "
                     "parts cannot be found.", SPLIT_NAME_HINT)


def _check_set_tensors(files: list[GGUFFile]) -> None:
    first = files[0]
    where: dict[str, Path] = {}
    for g in files:
        for t in g.tensors:
            if t.name in where:
                raise ModelError(f"Tensor '{t.name}' appears twice in the GGUF set {first.path.name} "
                                 f"({where[t.name].name} and {g.path.name}).", REDOWNLOAD)
            where[t.name] = g.path
    expected = first.get("split.tensors.count")
    if len(files) > 1 and isinstance(expected, int) and expected != len(where):
        raise ModelError(f"The GGUF set {first.path.name} lists {expected} tensors but its parts hold {len(where)}.",
                         "A part is from another download; download every part again.")
