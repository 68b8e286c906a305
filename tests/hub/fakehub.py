"""A local stand-in for the Hugging Face Hub, speaking what huggingface-hub 2.4 asks.

Two HTTP servers on 127.0.0.1 (random ports): the *hub* answers the API and ``/resolve/``
URLs; the *cdn* serves LFS contents, as the real Hub redirects LFS files to a CDN host.
Being a different origin matters: huggingface-hub follows redirects on the Hub's own host
but stops at a foreign one and takes the file's metadata from the redirect itself.

Endpoints (as huggingface_hub.hf_api.model_info and file_download.get_hf_file_metadata /
http_get call them):

* ``GET /api/models/{repo}[/revision/{rev}]?blobs=true`` -> ``{"id", "sha", "gated",
  "private", "siblings": [{"rfilename", "size", "blobId", "lfs": {"size", "sha256",
  "pointerSize"}}]}`` (sizes and hashes only with ``blobs=true``)
* ``HEAD|GET /{repo}/resolve/{rev}/{path}``: small files with ``X-Repo-Commit``, ``ETag``
  (the git blob id), ``Content-Length``; LFS files: 302 to the CDN with ``X-Repo-Commit``,
  ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``
* ``HEAD|GET /lfs/{sha256}`` on the CDN, with ``Range: bytes=N-`` (206 + Content-Range)

Errors carry ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo)
as the Hub sends them. No ``X-Xet-*`` header is ever sent, so huggingface-hub never
switches to the Xet protocol.

Faults, queued per repo file and consumed one per data request: ``("cut", n)`` sends the
headers of the whole answer and ``n`` body bytes, then drops the connection; ``("short",
n)`` answers with only the first ``n`` bytes as if that were the whole file; ``("status",
code)`` answers ``code``. ``FakeFile.rate`` throttles a file (bytes per second). Per-file permanent faults: ``corrupt`` (one byte flipped in what
is served), ``listed_size`` (what the API claims), ``serve_size`` (what resolve claims and sends).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeFile:
    data: bytes
    lfs: bool
    corrupt: bool = False
    listed_size: int | None = None  # overrides the size the API reports
    serve_size: int | None = None  # the server sends this many bytes (and says so)
    rate: float | None = None  # bytes per second the server sends this file at (None: at once)
    faults: list[tuple[str, int]] = field(default_factory=list)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def blob_id(self) -> str:
        return git_blob_id(self.pointer if self.lfs else self.data)

    @property
    def pointer(self) -> bytes:
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
                f"size {len(self.data)}\n").encode()

    def served(self) -> bytes:
        data = self.data
        if self.serve_size is not None:
            data = (data * (self.serve_size // max(len(data), 1) + 1))[: self.serve_size]
        if self.corrupt and data:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        return data


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, FakeFile]
    commit: str
    gated: bool = False
    private: bool = False


@dataclass
class Request:
    server: str  # "hub" or "cdn"
    method: str
    path: str
    range: str | None
    authorization: str | None


class FakeHub:
    LFS_THRESHOLD = 1024  # files this big or bigger are LFS files

    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self.tokens: set[str] = {"hf_good"}  # tokens allowed into gated and private repos
        self._by_sha: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()
        self.hub = self._serve("hub")
        self.cdn = self._serve("cdn")
        self.endpoint = f"http://127.0.0.1:{self.hub.server_address[1]}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"

    # ---- set-up ------------------------------------------------------------------------

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, gated: bool = False, private: bool = False,
                 lfs: set[str] | None = None) -> FakeRepo:
        fake_files = {
            path: FakeFile(data, lfs=(path in lfs) if lfs is not None else len(data) >= self.LFS_THRESHOLD)
            for path, data in files.items()
        }
        digest = hashlib.sha1(repo_id.encode())
        for path in sorted(files):
            digest.update(path.encode() + hashlib.sha256(files[path]).digest())
        commit = digest.hexdigest()
        repo = FakeRepo(repo_id, fake_files, commit, gated=gated, private=private)
        self.repos[repo_id] = repo
        for path, f in fake_files.items():
            if f.lfs:
                self._by_sha[f.sha256] = (repo_id, path)
        return repo

    def file(self, repo_id: str, path: str) -> FakeFile:
        return self.repos[repo_id].files[path]

    def data_requests(self, path_suffix: str) -> list[Request]:
        """GETs that carried file contents for a repo path (resolve or CDN)."""
        out = []
        for r in self.requests:
            if r.method != "GET" or "/api/" in r.path:
                continue
            if r.server == "cdn":
                sha = r.path.rsplit("/", 1)[-1]
                repo_path = self._by_sha.get(sha, ("", ""))[1]
            else:
                repo_path = r.path.split("/resolve/", 1)[-1].split("/", 1)[-1]
            if repo_path == path_suffix:
                out.append(r)
        return out

    def close(self) -> None:
        for server in (self.hub, self.cdn):
            server.shutdown()
            server.server_close()

    # ---- serving -----------------------------------------------------------------------

    def _serve(self, role: str) -> ThreadingHTTPServer:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet test output
                pass

            def do_HEAD(self):
                hub._handle(self, role, head=True)

            def do_GET(self):
                hub._handle(self, role, head=False)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return server

    def _handle(self, h: BaseHTTPRequestHandler, role: str, head: bool) -> None:
        with self._lock:
            self.requests.append(Request(role, h.command, h.path, h.headers.get("Range"),
                                         h.headers.get("Authorization")))
        url = urlparse(h.path)
        path = unquote(url.path)
        if role == "cdn":
            return self._lfs(h, path, head)
        if path.startswith("/api/models/"):
            return self._api(h, path.removeprefix("/api/models/"), parse_qs(url.query))
        if "/resolve/" in path:
            repo_id, rest = path.lstrip("/").split("/resolve/", 1)
            rev, _, file_path = rest.partition("/")
            return self._resolve(h, repo_id, rev, file_path, head)
        self._error(h, 404, "NotFound", "no such endpoint")

    def _authorized(self, h, repo: FakeRepo) -> bool:
        auth = h.headers.get("Authorization") or ""
        return auth.removeprefix("Bearer ") in self.tokens

    def _api(self, h, rest: str, query) -> None:
        repo_id, _, rev = rest.partition("/revision/")
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self._authorized(h, repo)):
            # The Hub answers 401 for unknown and private repos alike when not authorized.
            return self._error(h, 401 if not h.headers.get("Authorization") else 404, "RepoNotFound",
                               "Repository not found")
        if rev and rev not in ("main", repo.commit):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for p, f in sorted(repo.files.items()):
            s = {"rfilename": p}
            if blobs:
                size = f.listed_size if f.listed_size is not None else len(f.data)
                s.update(size=size, blobId=f.blob_id)  # the Hub gives LFS files' real size here too
                if f.lfs:
                    s["lfs"] = {"size": size, "sha256": f.sha256, "pointerSize": len(f.pointer)}
            siblings.append(s)
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": repo.private,
                           "gated": "manual" if repo.gated else False, "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _resolve(self, h, repo_id: str, rev: str, file_path: str, head: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self._authorized(h, repo)):
            return self._error(h, 401 if not h.headers.get("Authorization") else 404, "RepoNotFound",
                               "Repository not found")
        if rev not in ("main", repo.commit):
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if repo.gated and not self._authorized(h, repo):
            status = 403 if h.headers.get("Authorization") else 401
            return self._error(h, status, "GatedRepo",
                               f"Access to model {repo_id} is restricted. You must have access to it and be "
                               "authenticated to access it. Please log in.")
        f = repo.files.get(file_path)
        if f is None:
            return self._error(h, 404, "EntryNotFound", f"{file_path} does not exist", commit=repo.commit)
        served = f.served()
        if f.lfs:
            h.send_response(302)
            h.send_header("Location", f"{self.cdn_url}/lfs/{f.sha256}")
            h.send_header("X-Repo-Commit", repo.commit)
            h.send_header("X-Linked-Etag", f'"{f.sha256}"')
            h.send_header("X-Linked-Size", str(len(served)))
            h.send_header("ETag", f'"{f.blob_id}"')
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        self._send_data(h, f, served, head, {"X-Repo-Commit": repo.commit, "ETag": f'"{f.blob_id}"'})

    def _lfs(self, h, path: str, head: bool) -> None:
        sha = path.rsplit("/", 1)[-1]
        if sha not in self._by_sha:
            return self._error(h, 404, None, "no such object")
        repo_id, file_path = self._by_sha[sha]
        f = self.repos[repo_id].files[file_path]
        self._send_data(h, f, f.served(), head, {"ETag": f'"{sha}"'})

    def _send_data(self, h, f: FakeFile, data: bytes, head: bool, headers: dict[str, str]) -> None:
        fault = None
        if not head:
            with self._lock:
                fault = f.faults.pop(0) if f.faults else None
        if fault and fault[0] == "status":
            return self._error(h, fault[1], None, "injected failure")
        if fault and fault[0] == "short":  # a complete-looking answer that is too short
            data = data[: fault[1]]
        start = 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes="):-1])
        body = data[start:]
        h.send_response(206 if start else 200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(body)))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        if fault and fault[0] == "cut":
            h.wfile.write(body[: fault[1]])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)  # the peer sees the connection end before Content-Length
            return
        if f.rate:
            piece = 4096
            try:
                for k in range(0, len(body), piece):
                    h.wfile.write(body[k:k + piece])
                    h.wfile.flush()
                    time.sleep(piece / f.rate)
            except (BrokenPipeError, ConnectionResetError):  # the client went away (cancelled)
                h.close_connection = True
            return
        h.wfile.write(body)

    def _error(self, h, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)
