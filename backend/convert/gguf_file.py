"""Writing a GGUF file as a stream of tensor pieces, complete or not at all.

gguf-py's ``GGUFWriter`` lays out the header, the metadata and the tensor directory; the
tensor data is streamed here piece by piece (one expert, one block of rows) straight to the
file, so the writer never holds a whole tensor. ``GGUFWriter.write_tensor_data`` would need
each tensor whole: a merged ``[E, out, in]`` expert tensor of a 1T-parameter model is
several GB.

The file is written under a hidden temporary name in the target directory (not ending in
``.gguf``, so nothing mistakes it for a model; ``hybridmoe.backend.files.partial_path``) and renamed
over the target only once every byte is written and flushed; on any error, cancel or Ctrl-C
the temporary file is deleted.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.files import partial_path, write_error
from hybridmoe.backend.session import CancelToken, Progress, ProgressCallback
from hybridmoe.backend.units import fmt_bytes

# Room kept free on top of the file's size: the metadata, and a margin so that a disk that
# "just fits" does not end up full for everything else.
DISK_MARGIN_BYTES = 256 * 1024 * 1024
DISK_MARGIN_FRACTION = 0.01
# A write that failed with less than this free in the folder failed for want of space.
_FULL_BELOW_BYTES = 1024 * 1024


@dataclass(frozen=True)
class TensorSlot:
    """One tensor of the file: its directory entry and where its bytes come from."""

    name: str
    shape: tuple[int, ...]  # torch order (outermost first)
    qtype: gguf.GGMLQuantizationType
    nbytes: int
    pieces: Callable[[], Iterator[np.ndarray]]  # uint8 arrays whose bytes, in order, are the data


def padded_size(slots: Sequence[TensorSlot]) -> int:
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    return sum((s.nbytes + align - 1) // align * align for s in slots)


def check_free_space(directory: Path, needed: int, what: str) -> None:
    """Refuse before writing anything when `directory` cannot take `needed` bytes plus margin."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError as exc:
        raise HybridMoeError(f"Cannot check the free space in {directory}: {exc.strerror or exc}.",
                             "Check that the output folder exists and is writable.") from exc
    want = needed + max(DISK_MARGIN_BYTES, int(needed * DISK_MARGIN_FRACTION))
    if free < want:
        raise HybridMoeError(
            f"Not enough disk space in {directory} for {what}: it needs about {fmt_bytes(want)} "
            f"({fmt_bytes(needed)} plus a margin), and {fmt_bytes(free)} is free.",
            "Free some space, or choose another output folder with --out (or a smaller --quant).",
        )


def write_gguf(
    target: Path,
    arch: str,
    write_metadata: Callable[[gguf.GGUFWriter], None],
    slots: Sequence[TensorSlot],
    *,
    on_progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    stage: str = "convert",
) -> Path:
    """Write the GGUF file `target` (atomically); return it."""
    writer = gguf.GGUFWriter(None, arch)
    write_metadata(writer)
    for s in slots:
        # A non-uint8 dtype tells GGUFWriter that `shape` is the logical shape.
        writer.add_tensor_info(s.name, s.shape, np.dtype(np.float32), s.nbytes, raw_dtype=s.qtype)

    tmp = partial_path(target)
    total = sum(s.nbytes for s in slots)
    done = 0
    last_report = 0.0

    def report(message: str, force: bool = False) -> None:
        nonlocal last_report
        now = time.monotonic()
        if on_progress is not None and (force or now - last_report >= 0.1):
            last_report = now
            on_progress(Progress(stage, done, total, "B", message))

    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        report("starting", force=True)
        for s in slots:
            if cancel is not None:
                cancel.raise_if_cancelled("The conversion")
            written = 0
            for piece in s.pieces():
                if cancel is not None:
                    cancel.raise_if_cancelled("The conversion")
                piece = np.ascontiguousarray(piece)
                piece.tofile(fout)
                written += piece.nbytes
                done += piece.nbytes
                report(s.name)
            if written != s.nbytes:
                raise HybridMoeError(
                    f"Internal error converting {s.name}: wrote {written} bytes, expected {s.nbytes}.",
                    "This is a bug in hybridmoe's converter; please report it.",
                )
            writer.write_padding(fout, s.nbytes)
            report(s.name, force=True)
        fout.flush()
        os.fsync(fout.fileno())
        writer.close()
        os.replace(tmp, target)
    except OSError as exc:
        full = _disk_is_full(exc, target.parent)  # before the partial file gives its space back
        _discard(writer, tmp)
        if full:
            raise HybridMoeError(
                f"cannot write {target}: the disk is full ({fmt_bytes(done)} of {fmt_bytes(total)} written)",
                f"The file needs {fmt_bytes(total)} free in {target.parent}: free that much, or choose another "
                "folder with --out.") from exc
        raise write_error(target, exc) from exc
    except BaseException:
        _discard(writer, tmp)
        raise
    report("done", force=True)
    return target


def _disk_is_full(exc: OSError, directory: Path) -> bool:
    """numpy's short write ("262144 requested and 107776 written") carries no errno: a disk
    with almost nothing left free is what made it short."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        return shutil.disk_usage(directory).free < _FULL_BELOW_BYTES
    except OSError:
        return False


def _discard(writer: gguf.GGUFWriter, tmp: Path) -> None:
    try:
        writer.close()
    except OSError:
        pass
    try:
        tmp.unlink(missing_ok=True)
    except OSError:  # a folder we could not write to holds no partial file either
        pass
