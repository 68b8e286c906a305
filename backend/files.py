"""Writing files so that no reader ever sees half of one: the bytes go to a temporary name
beside the file, which is then renamed over it.

``write_atomic`` does it for small text files (settings, plans, statistics, registries).
Large files written for minutes or hours (converted models) go through ``partial_path``: a
hidden name carrying the writer's process id, so that two writers never collide and the
leftovers of a writer that was killed (SIGKILL, a power cut) can be told from a file still
being written, and removed by ``sweep_stale_partials`` when the same file is written again.
``set_aside`` moves a file the app cannot use out of the way without deleting it.
``write_error`` says in words why a file could not be written (a full disk, a read-only
folder), naming the file the user asked for rather than a temporary one.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
from datetime import datetime
from pathlib import Path

from hybridmoe.backend.errors import HybridMoeError

log = logging.getLogger(__name__)

# Seconds of slack when comparing a process's start with a file's last write: psutil derives
# the start from the boot time and clock ticks, which can be off by a second or so.
_CLOCK_SLACK_S = 5.0


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path`, creating its directory; a crash leaves the old file or none.
    An OSError names `path` itself, not the temporary file beside it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_error(path: str | os.PathLike, exc: OSError, *, disk_full: bool = False) -> HybridMoeError:
    """Why `path` could not be written, as one message with what to do. `disk_full`: the caller
    found the disk full although the error does not say so (numpy's short writes carry no errno)."""
    path = Path(path)
    if disk_full or exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return HybridMoeError(f"cannot write {path}: the disk is full",
                              f"Free some space in {path.parent}, or write the file somewhere else.")
    if exc.errno == errno.EROFS:
        return HybridMoeError(f"cannot write {path}: {path.parent} is on a read-only file system",
                              "Choose a folder on a writable disk.")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return HybridMoeError(f"cannot write {path}: permission denied",
                              f"Choose a folder you can write to, or change the permissions of {path.parent}.")
    return HybridMoeError(f"cannot write {path}: {exc.strerror or exc}",
                          "Check that the folder exists, is writable and has free space.")


def set_aside(path: Path, why: str) -> Path:
    """Rename a file the app cannot use to ``NAME.<why>-<time>`` beside it, and return the new
    path. The user's data is never deleted, and an earlier copy set aside is never replaced."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    target, n = path.with_name(f"{path.name}.{why}-{stamp}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{why}-{stamp}-{n}")
    path.rename(target)
    return target


def partial_path(target: str | os.PathLike) -> Path:
    """The hidden name ``.NAME.PID.partial`` beside `target` that this process writes it under."""
    target = Path(target)
    return target.with_name(f".{target.name}.{os.getpid()}.partial")


def sweep_stale_partials(target: str | os.PathLike) -> list[Path]:
    """Delete the partial files of `target`, and of names extending it (an intermediate
    ``NAME.bf16``, the partial of a partial), whose writer no longer runs; return them.

    A file is left alone while the process named by its id runs and could be its writer.
    Process ids are reused (a container's process often gets the same small id every run),
    so a live process that started after the file was last written is not its writer either.
    """
    target = Path(target)
    pattern = re.compile(rf"^\.+{re.escape(target.name)}(?:\..*)?\.(\d+)\.partial$")
    removed = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return removed  # an unreadable folder: the write itself will say what is wrong
    for entry in entries:
        match = pattern.match(entry.name)
        if not match:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            if _writer_is_gone(int(match.group(1)), entry.stat(follow_symlinks=False).st_mtime):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
                log.info("removed %s, left by a process that no longer runs", entry.path)
        except OSError as exc:  # gone meanwhile, or not ours to delete: keep going
            log.info("could not remove %s: %s", entry.path, exc)
    return removed


def _writer_is_gone(pid: int, last_written: float) -> bool:
    import psutil  # only here: the settings and plan writers above do not need it

    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped by its parent
            return True
        started = process.create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # e.g. access denied: cannot tell, so it may be writing
        return False
    return started > last_written + _CLOCK_SLACK_S
