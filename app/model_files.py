"""Removing a model from disk: exactly the files that make it up, nothing around them.

A model is a list of files (``LocalModel.files``), not a directory: a registered folder may
hold the user's other files next to it, and a Hugging Face cache snapshot is a tree of
symlinks into ``blobs/`` that other snapshots (and other tools) share. So: unlink each
listed file; for a cache symlink also its blob, unless another snapshot of the same
repository still points to it; then prune the directories this left empty, stopping at
the first one that is not. LM Studio's and Ollama's stores belong to those programs and
are refused (Ollama shares one blob between tags).
"""

from __future__ import annotations

import os
from pathlib import Path

from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.hub.local import LocalModel

FOREIGN_STORES = {
    "ollama": "Remove it with `ollama rm {name}`.",
    "lmstudio": "Remove it in LM Studio (My Models).",
}


def deletable(model: LocalModel) -> str | None:
    """Why ``model`` cannot be deleted from here, or None when it can."""
    if model.source in FOREIGN_STORES:
        return f"{model.name} belongs to {model.source}. " + FOREIGN_STORES[model.source].format(name=model.name)
    if not model.files:
        return f"hybridmoe does not know which files make up {model.name}; delete {model.path} yourself."
    return None


def delete_model_files(model: LocalModel) -> int:
    """Delete the files of ``model``; returns the bytes freed."""
    reason = deletable(model)
    if reason:
        raise HybridMoeError(f"cannot delete {model.name}", reason)
    freed = 0
    touched: set[Path] = set()
    for f in model.files:
        path = Path(f)
        touched.add(path.parent)
        try:
            if path.is_symlink():
                blob = path.resolve()
                path.unlink()
                if blob.exists() and not _still_linked(blob, path):
                    freed += blob.stat().st_size
                    blob.unlink()
            elif path.exists():
                freed += path.stat().st_size
                path.unlink()
        except OSError as error:
            raise HybridMoeError(f"cannot delete {path}: {error.strerror or error}",
                                 "Check the permissions of the folder, then try again.") from error
    for directory in sorted(touched, key=lambda p: len(p.parts), reverse=True):
        _prune_empty(directory, stop=_cache_repo_root(directory))
    return freed


def _cache_repo_root(path: Path) -> Path | None:
    """``.../models--org--name`` for a path inside a Hugging Face cache snapshot."""
    for parent in path.parents:
        if parent.name.startswith("models--"):
            return parent
    return None


def _still_linked(blob: Path, removed: Path) -> bool:
    """Does another snapshot of the same cached repository point to ``blob``?"""
    root = _cache_repo_root(removed)
    if root is None:
        return False
    for directory, _dirs, names in os.walk(root / "snapshots"):
        for name in names:
            link = Path(directory) / name
            if link.is_symlink() and link.resolve() == blob:
                return True
    return False


def _prune_empty(directory: Path, stop: Path | None) -> None:
    """Remove ``directory`` and its parents while empty; within a cache repository only up
    to its ``snapshots`` folder (refs/ and blobs/ stay for huggingface-hub)."""
    limit = stop / "snapshots" if stop is not None else None
    current = directory
    while limit is not None and current != limit and limit in current.parents:
        try:
            current.rmdir()
        except OSError:
            return
        current = current.parent
