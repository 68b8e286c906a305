"""Directories the user asked us to search for models (``hybridmoe models --add DIR``).

A small TOML file in the data directory (``<data dir>/models.toml``)::

    directories = ["/data/models", "/mnt/nvme/gguf"]

Kept apart from settings.toml: it is a list the program edits, not a preference a person
writes by hand. Paths are stored absolute, so the list means the same from any working
directory.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import tomli_w

from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.files import write_atomic
from hybridmoe.backend.settings import data_dir


def registry_path() -> Path:
    return data_dir() / "models.toml"


def registered_dirs() -> list[Path]:
    path = registry_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"cannot read the model directory list {path}: {e}",
                         "Fix or delete the file; `hybridmoe models --add DIR` writes a new one.")
    dirs = data.get("directories", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise UsageError(f"{path}: 'directories' must be a list of paths",
                         "Fix or delete the file; `hybridmoe models --add DIR` writes a new one.")
    return [Path(d) for d in dirs]


def _absolute(directory: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(Path(directory).expanduser()))


def add_dir(directory: str | os.PathLike[str]) -> Path:
    """Register ``directory`` (must exist); returns it as stored. Adding twice is harmless."""
    path = _absolute(directory)
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory.", "Give a folder that holds models (or one model).")
    dirs = registered_dirs()
    if path not in dirs:
        _write([*dirs, path])
    return path


def remove_dir(directory: str | os.PathLike[str]) -> Path:
    """Unregister ``directory`` (it need not exist any more); the models in it are untouched."""
    path = _absolute(directory)
    dirs = registered_dirs()
    if path not in dirs:
        known = "\n".join(f"  {d}" for d in dirs) or "  (none)"
        raise UsageError(f"{path} is not a registered model directory. Registered:\n{known}")
    _write([d for d in dirs if d != path])
    return path


def _write(dirs: list[Path]) -> None:
    write_atomic(registry_path(), tomli_w.dumps({"directories": [str(d) for d in dirs]}))
