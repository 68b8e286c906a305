"""The Hugging Face cache on disk, as far as pulls need it.

Layout (huggingface-hub's, shared with every tool that uses it)::

    <cache>/models--org--name/blobs/<etag>            file contents (etag: sha256 for LFS
                                                      files, the git blob id for others)
    <cache>/models--org--name/blobs/<etag>.incomplete  a download in progress (ours resume it)
    <cache>/models--org--name/snapshots/<commit>/<path> symlinks into blobs/
    <cache>/models--org--name/refs/<revision>         the commit a branch or tag pointed to

The cache is the model store of ``hybridmoe.backend.settings`` (default: HF_HUB_CACHE, so HF_HOME
moves it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from huggingface_hub.file_download import repo_folder_name

from hybridmoe.backend.files import write_atomic
from hybridmoe.backend.hub.selection import RepoFile

COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")


def default_cache_dir() -> Path:
    from hybridmoe.backend import settings

    return settings.load().model_store_path


def repo_dir(cache_dir: Path, repo_id: str) -> Path:
    return Path(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")


def snapshot_dir(cache_dir: Path, repo_id: str, commit: str) -> Path:
    return repo_dir(cache_dir, repo_id) / "snapshots" / commit


def blob_path(cache_dir: Path, repo_id: str, etag: str) -> Path:
    return repo_dir(cache_dir, repo_id) / "blobs" / etag


def partial_path(blob: Path) -> Path:
    """Where a download of ``blob`` in progress lives. The name huggingface-hub's own scan
    (``scan_cache_dir().incomplete_files``) reports; huggingface-hub 2.x itself writes to
    ``<etag>.<random>.incomplete`` and deletes that on failure, so the two never collide."""
    return blob.with_name(blob.name + ".incomplete")


def expected_etag(f: RepoFile) -> str | None:
    """The blob name the Hub will give this file: its sha256 if in LFS, else its git id."""
    return f.sha256 or f.blob_id


def on_disk(cache_dir: Path, repo_id: str, commit: str, f: RepoFile) -> tuple[bool, int]:
    """(complete, partial bytes) of ``f`` in the cache, judged without asking the Hub."""
    pointer = snapshot_dir(cache_dir, repo_id, commit) / f.path
    if pointer.is_file() and (f.size is None or pointer.stat().st_size == f.size):
        return True, 0
    etag = expected_etag(f)
    if etag:
        blob = blob_path(cache_dir, repo_id, etag)
        if blob.is_file() and (f.size is None or blob.stat().st_size == f.size):
            return True, 0
        try:
            partial = partial_path(blob).stat().st_size
        except OSError:
            partial = 0
        if f.size is not None and partial <= f.size:
            return False, partial
    return False, 0


def cached_commit(cache_dir: Path, repo_id: str, revision: str) -> str | None:
    """The commit a revision pointed to when last seen online (None: never cached)."""
    base = repo_dir(cache_dir, repo_id)
    if COMMIT_HASH.match(revision):
        return revision if (base / "snapshots" / revision).is_dir() else None
    try:
        commit = (base / "refs" / revision).read_text().strip()
    except OSError:
        return None
    return commit if (base / "snapshots" / commit).is_dir() else None


def snapshot_files(snapshot: Path) -> list[RepoFile]:
    """The files of a cached snapshot (broken links, i.e. missing blobs, left out)."""
    files = []
    for root, _dirs, names in os.walk(snapshot):
        for name in names:
            full = Path(root) / name
            try:
                size = full.stat().st_size
            except OSError:
                continue
            files.append(RepoFile(full.relative_to(snapshot).as_posix(), size))
    return sorted(files, key=lambda f: f.path)


def write_ref(cache_dir: Path, repo_id: str, revision: str, commit: str) -> None:
    """Record which commit ``revision`` resolved to, so an offline pull of "main" finds it.
    Written last: huggingface-hub's cache scan calls a repo corrupt if a ref names a
    snapshot that does not exist."""
    if revision == commit:
        return
    ref = repo_dir(cache_dir, repo_id) / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    try:
        if ref.read_text() == commit:
            return
    except OSError:
        pass
    write_atomic(ref, commit)
