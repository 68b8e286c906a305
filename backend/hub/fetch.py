"""One file from the Hub into the Hugging Face cache: resumable, verified, never half-visible.

huggingface-hub 2.x's ``hf_hub_download`` writes to a temporary name unique to the call and
deletes it when the call fails, so an interrupted 50 GB shard would start again from zero.
For checkpoints of hundreds of GB we keep the partial file instead:

1. ask the Hub where the file lives (``get_hf_file_metadata``: etag, size, CDN location);
2. append to ``blobs/<etag>.incomplete`` from where it ends (HTTP Range), through
   huggingface-hub's HTTP session (its proxy, TLS and header settings), hashing the bytes as
   they are written; a broken connection, a 5xx or a 429 is retried from where it broke,
   and an expired CDN link is asked for again. Our own loop rather than ``http_get``:
   that hands over 10 MiB at a time, too coarse to stop promptly or to show progress on a
   slow line, and its retries sleep without looking at a cancel request;
3. check size and hash (sha256 for LFS files, the git blob id for small files) against the
   Hub's listing; a mismatch deletes the partial file (nothing corrupt is ever left looking
   complete) and, if the bad bytes may come from an earlier resumed attempt, downloads once
   more from zero;
4. rename into ``blobs/<etag>`` and let ``hf_hub_download`` make the snapshot link, so the
   cache stays exactly what huggingface-hub and other tools expect.

Stop requests (Ctrl-C, Esc, another thread's failure) are honoured after every read from
the network and during retry waits; the partial file stays for the next pull.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlparse

from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import (
    WeakFileLock,
    build_hf_headers,
    get_session,
    hf_raise_for_status,
)

from hybridmoe.backend.errors import HybridMoeError, ModelError
from hybridmoe.backend.hub import cache
from hybridmoe.backend.hub.meter import Stopped, TransferMeter
from hybridmoe.backend.hub.remote import endpoint, httpx, is_connection_error, translate
from hybridmoe.backend.hub.selection import RepoFile

log = logging.getLogger(__name__)

_READ_BLOCK = 8 << 20
# Attempts in a row without receiving a byte before a file's download gives up; HTTP
# statuses worth retrying (the Hub and CDNs answer these under load).
RETRIES = 5
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
RETRY_DELAY_S = 1.0


class QuietBar:
    """Stands in for tqdm in huggingface-hub calls: our meter reports progress, and nothing
    else may write to a terminal the TUI owns."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        pass

    def close(self):
        pass


class _Digest:
    """The hash the Hub's listing lets us check for ``f``: sha256 of the content (LFS) or
    the git blob id, sha1 over ``"blob <size>\\0" + content`` (everything else)."""

    def __init__(self, f: RepoFile):
        self.expected: str | None = None
        self.kind = ""
        if f.sha256:
            self.expected, self.kind = f.sha256.lower(), "sha256"
        elif f.blob_id and f.size is not None:
            self.expected, self.kind = f.blob_id.lower(), "git blob id"
        self._size = f.size
        self.reset()

    def reset(self) -> None:
        if self.kind == "sha256":
            self._h = hashlib.sha256()
        elif self.kind:
            self._h = hashlib.sha1(f"blob {self._size}\0".encode())
        else:
            self._h = None

    def update(self, data: bytes) -> None:
        if self._h is not None:
            self._h.update(data)

    def hexdigest(self) -> str | None:
        return self._h.hexdigest() if self._h is not None else None


def _hash_prefix(fh: BinaryIO, digest: _Digest, length: int, meter: TransferMeter) -> None:
    """Hash the first ``length`` bytes already on disk (a resumed download)."""
    digest.reset()
    if digest.kind == "":
        return
    fh.seek(0)
    left = length
    while left > 0:
        meter.check()
        block = fh.read(min(_READ_BLOCK, left))
        if not block:
            break
        digest.update(block)
        left -= len(block)


def fetch_file(repo_id: str, commit: str, f: RepoFile, *, cache_dir: Path, meter: TransferMeter,
               counted: int = 0, token: str | None = None) -> Path:
    """Make ``f`` of ``repo_id@commit`` present in the cache; returns its snapshot path.

    ``counted`` is what the meter already counts as on disk for this file (the plan's view);
    the meter is corrected if the disk says otherwise by now.
    """
    pointer = cache.snapshot_dir(cache_dir, repo_id, commit) / f.path
    if pointer.is_file() and (f.size is None or pointer.stat().st_size == f.size):
        meter.add(pointer.stat().st_size - counted, f.path)
        meter.file_finished(f.path)
        return pointer
    meter.check()
    url = hf_hub_url(repo_id, f.path, revision=commit, endpoint=endpoint())
    try:
        meta = get_hf_file_metadata(url, token=token, endpoint=endpoint())
    except Exception as error:
        raise translate(error, repo_id, filename=f.path) from error
    if not meta.etag:
        raise ModelError(f"The Hub gave no ETag for {repo_id}/{f.path}.",
                         "Check HF_ENDPOINT: it must point to a Hugging Face Hub (or a mirror of it).")
    if f.size is not None and meta.size is not None and meta.size != f.size:
        raise ModelError(
            f"The Hub lists {repo_id}/{f.path} as {f.size:,} bytes but serves {meta.size:,}.",
            "The repository may be changing right now; run the command again later.",
        )
    size = f.size if f.size is not None else meta.size
    blob = cache.blob_path(cache_dir, repo_id, meta.etag)
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock = Path(cache_dir) / ".locks" / cache.repo_dir(cache_dir, repo_id).name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    # The lock huggingface-hub takes for this blob: two pulls (or a pull and `hf download`) of
    # one repository never write the same file at once.
    with WeakFileLock(lock):
        if blob.is_file() and (size is None or blob.stat().st_size == size):
            meter.add(blob.stat().st_size - counted, f.path)
        else:
            _download_blob(repo_id, url, meta.location, blob, f, size, meter, counted, token)
    try:
        path = hf_hub_download(repo_id, f.path, revision=commit, cache_dir=cache_dir, token=token,
                               endpoint=endpoint(), tqdm_class=QuietBar)
    except Exception as error:
        raise translate(error, repo_id, filename=f.path) from error
    meter.file_finished(f.path)
    return Path(path)


def _download_blob(repo_id: str, url: str, location: str, blob: Path, f: RepoFile, size: int | None,
                   meter: TransferMeter, counted: int, token: str | None) -> None:
    partial = cache.partial_path(blob)
    for attempt in (1, 2):
        digest = _Digest(f)
        with open(partial, "ab+") as fh:
            resume = fh.seek(0, os.SEEK_END)
            meter.add(resume - counted, f.path)
            counted = 0
            if size is not None and resume > size:  # longer than the file: not a prefix of it
                fh.truncate(0)
                meter.add(-resume, f.path)
                resume = 0
            _hash_prefix(fh, digest, resume, meter)
            fh.seek(resume)
            try:
                _transfer(repo_id, url, location, fh, digest, start=resume, size=size, meter=meter, name=f.path,
                          token=token)
            except Exception as error:
                if fh.tell() == 0:  # nothing to resume: leave no empty partial file behind
                    partial.unlink(missing_ok=True)
                raise _transfer_error(error, repo_id, f, partial) from error
            got = fh.tell()
            fh.flush()
            os.fsync(fh.fileno())
        problem = _verify(f, size, got, digest)
        if problem is None:
            os.replace(partial, blob)
            return
        partial.unlink(missing_ok=True)
        meter.add(-got, f.path)
        if resume == 0 or attempt == 2:
            raise ModelError(
                f"{repo_id}/{f.path} arrived corrupt ({problem}); it was deleted.",
                "Run the command again; if this keeps happening the Hub or a proxy is serving a damaged file.",
            )
        # The bad bytes may be the partial file's, from an earlier interrupted pull: once more from zero.
        log.warning("%s failed verification after resuming (%s); downloading it again", f.path, problem)


def _transfer(repo_id: str, url: str, location: str, fh: BinaryIO, digest: _Digest, *, start: int,
              size: int | None, meter: TransferMeter, name: str, token: str | None) -> None:
    """Append the file's bytes from ``start`` to ``fh``: Range requests, retried from where
    they broke (RETRIES times in a row without a byte before giving up)."""
    pos = start
    failures = 0
    while size is None or pos < size:
        meter.check()
        headers = build_hf_headers(token=token)
        headers["Accept-Encoding"] = "identity"  # byte ranges of the file itself, not of a gzip stream
        if _origin(location) != _origin(url):
            headers.pop("authorization", None)  # the token goes to the Hub, never to a CDN
        if pos:
            headers["Range"] = f"bytes={pos}-"
        received = 0
        try:
            with get_session().stream("GET", location, headers=headers, follow_redirects=True,
                                      timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as response:
                if response.status_code in (401, 403) and _origin(location) != _origin(url) and failures < RETRIES:
                    # A signed CDN link expires (hours into a big file): ask the Hub for a fresh one.
                    location = get_hf_file_metadata(url, token=token, endpoint=endpoint()).location
                    failures += 1
                    continue
                hf_raise_for_status(response)
                if pos and response.status_code != 206:  # the server ignored the Range: start over
                    fh.seek(0)
                    fh.truncate(0)
                    meter.add(-pos, name)
                    digest.reset()
                    pos = 0
                for chunk in response.iter_bytes():  # as the network delivers: prompt stops and progress
                    meter.check()
                    fh.write(chunk)
                    digest.update(chunk)
                    pos += len(chunk)
                    received += len(chunk)
                    meter.add(len(chunk), name)
                    if size is not None and pos > size:
                        return  # more than the Hub lists: _verify reports it
            if size is None:
                return
            if pos < size and received == 0:
                raise httpx.RemoteProtocolError(f"the server ended the answer at byte {pos:,} of {size:,}")
        except (httpx.TransportError, HfHubHTTPError) as error:
            retryable = isinstance(error, httpx.TransportError) or (
                error.response is not None and error.response.status_code in RETRY_STATUS)
            failures = 0 if received else failures + 1
            if not retryable or failures > RETRIES:
                raise
            log.info("download of %s broke at byte %s (%s); resuming", name, pos, error)
            meter.wait(RETRY_DELAY_S * min(2 ** (failures - 1), 8))


def _verify(f: RepoFile, size: int | None, got: int, digest: _Digest) -> str | None:
    if size is not None and got != size:
        return f"{got:,} bytes instead of {size:,}"
    if digest.expected is not None and digest.hexdigest() != digest.expected:
        return f"{digest.kind} {digest.hexdigest()} instead of {digest.expected}"
    return None


def _transfer_error(error: BaseException, repo_id: str, f: RepoFile, partial: Path) -> BaseException:
    """Network trouble mid-file: the partial file stays and the next pull resumes it."""
    if isinstance(error, (HybridMoeError, Stopped)):
        return error
    translated = translate(error, repo_id, filename=f.path)
    if isinstance(translated, HybridMoeError) and not is_connection_error(error):
        return translated
    have = partial.stat().st_size if partial.exists() else 0
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ModelError(
        f"The download of {repo_id}/{f.path} stopped after {have:,} bytes ({reason}).",
        "Check the network and run the same command again: it resumes where this one stopped.",
    )


def _origin(url: str) -> tuple[str, str, int | None]:
    u = urlparse(url)
    return u.scheme, (u.hostname or "").lower(), u.port
