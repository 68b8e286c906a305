"""Free space where models are stored: a 600 GB checkpoint plus its GGUF conversion must fit."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import platformdirs

from hybridmoe.backend.hardware.profile import Disk

__all__ = ["default_model_dir", "detect_disk"]


def default_model_dir() -> Path:
    """Where models go when the user has not chosen a place (the per-user data directory)."""
    return platformdirs.user_data_path("hybridmoe", appauthor=False) / "models"


def _nearest_existing(path: Path) -> Path | None:
    """``path`` or its closest existing parent: the store may not have been created yet,
    and the file system it will be created on is the one whose free space counts."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return None


def detect_disk(path: str | os.PathLike[str] | None = None) -> tuple[Disk, dict[str, str]]:
    """Free and total bytes of the file system holding ``path`` (default: the model store).

    ``Disk.path`` is the path asked about, not the parent that was measured, so messages
    name the directory the user knows.
    """
    target = Path(path).expanduser() if path is not None else default_model_dir()
    target = target.absolute()
    existing = _nearest_existing(target)
    if existing is None:
        reason = f"neither {target} nor any parent exists"
        return Disk(path=str(target)), {"disk.free_bytes": reason, "disk.total_bytes": reason}
    try:
        usage = shutil.disk_usage(existing)
    except OSError as error:
        reason = f"cannot stat the file system of {existing}: {error.strerror or error}"
        return Disk(path=str(target)), {"disk.free_bytes": reason, "disk.total_bytes": reason}
    return Disk(path=str(target), free_bytes=usage.free, total_bytes=usage.total), {}
