"""``pull``: a model repository from the Hugging Face Hub into the local cache.

    plan_pull(repo, quant=, revision=) -> PullPlan    what would be downloaded, how much is here
    pull(repo, quant=, revision=, on_progress=, cancel=) -> LocalModel

Before the first byte: the Hub's listing (sizes and hashes of every file), the selection
(hybridmoe.backend.hub.selection), the bytes already in the cache (finished files and partial ones),
and the free disk space, with a margin, against what is left to download. Then the files go
down a few at a time (``max_workers``; small files first, so a gated or broken repository
fails in the first second), each resumable and verified (hybridmoe.backend.hub.fetch), with one
progress stream for the whole pull (hybridmoe.backend.hub.meter).

Offline (HF_HUB_OFFLINE=1, or the Hub cannot be reached): the cached copy is used if it is
complete, and the returned model says so in its ``note``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

from hybridmoe.backend.errors import HybridMoeError, ModelError
from hybridmoe.backend.hardware.disk import detect_disk
from hybridmoe.backend.hub import cache
from hybridmoe.backend.hub.fetch import fetch_file
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.hub.meter import Stopped, TransferMeter
from hybridmoe.backend.hub.remote import HubUnreachable, fetch_repo, offline_mode
from hybridmoe.backend.hub.selection import RepoFile, Selection, select
from hybridmoe.backend.session import Cancelled, CancelToken, ProgressCallback
from hybridmoe.backend.units import GiB, fmt_bytes

log = logging.getLogger(__name__)

DEFAULT_REVISION = "main"
# Kept free after the download: a file system that fills up fails in ugly ways, and the
# engine writes plans, statistics and logs next to the models.
MIN_FREE_MARGIN = 1 * GiB
FREE_MARGIN_FRACTION = 0.01
# Parallel file downloads: one HTTP stream rarely fills a fast link; more than a few only
# multiplies partial files when a pull is interrupted.
MAX_WORKERS = 4


@dataclass(frozen=True)
class PullPlan:
    repo_id: str
    revision: str
    commit: str
    selection: Selection
    cache_dir: Path
    present_bytes: int  # already in the cache: finished files plus partial downloads
    present_by_file: dict[str, int]  # what of each file is present
    free_bytes: int | None  # on the cache's file system; None when it cannot be measured
    gated: bool = False

    @property
    def files(self) -> tuple[RepoFile, ...]:
        return self.selection.files

    @property
    def total_bytes(self) -> int:
        return self.selection.total_bytes

    @property
    def download_bytes(self) -> int:
        return max(self.total_bytes - self.present_bytes, 0)

    @property
    def margin_bytes(self) -> int:
        return max(MIN_FREE_MARGIN, int(FREE_MARGIN_FRACTION * self.download_bytes))

    @property
    def snapshot(self) -> Path:
        return cache.snapshot_dir(self.cache_dir, self.repo_id, self.commit)

    def label(self) -> str:
        q = f" {self.selection.quantization}" if self.selection.quantization else ""
        return f"{self.repo_id}{q}"


def plan_pull(repo_id: str, *, quant: str | None = None, revision: str | None = None,
              cache_dir: str | Path | None = None, token: str | None = None) -> PullPlan:
    """What ``pull`` would download. Asks the Hub (raises HubUnreachable when it cannot)."""
    revision = revision or DEFAULT_REVISION
    cache_dir = Path(cache_dir) if cache_dir is not None else cache.default_cache_dir()
    remote = fetch_repo(repo_id, revision, token=token)
    selection = select(remote.files, quant, repo_id)
    if selection.kind == "gguf" and len(selection.files) != selection.expected_parts:
        raise ModelError(
            f"{repo_id} lists {len(selection.files)} of the {selection.expected_parts} parts of "
            f"{selection.quantization} ({selection.weights_path}).",
            "The upload is incomplete; choose another quantization or try again later.",
        )
    present = {}
    for f in selection.files:
        complete, partial = cache.on_disk(cache_dir, repo_id, remote.commit, f)
        present[f.path] = (f.size or 0) if complete else partial
    disk, _unknown = detect_disk(cache_dir)
    return PullPlan(
        repo_id=repo_id,
        revision=revision,
        commit=remote.commit,
        selection=selection,
        cache_dir=cache_dir,
        present_bytes=sum(present.values()),
        present_by_file=present,
        free_bytes=disk.free_bytes,
        gated=remote.gated,
    )


def check_disk_space(plan: PullPlan) -> None:
    """Refuse, with the numbers, a pull that would not fit (before any byte is written)."""
    if plan.free_bytes is None or plan.download_bytes == 0:
        return
    needed = plan.download_bytes + plan.margin_bytes
    if plan.free_bytes < needed:
        already = f" ({fmt_bytes(plan.present_bytes)} of it is already there)" if plan.present_bytes else ""
        raise ModelError(
            f"Not enough disk space for {plan.label()}: it is {fmt_bytes(plan.total_bytes)}{already}, "
            f"so {fmt_bytes(plan.download_bytes)} more plus a {fmt_bytes(plan.margin_bytes)} margin are needed, "
            f"and {plan.cache_dir} has {fmt_bytes(plan.free_bytes)} free.",
            f"Free {fmt_bytes(needed - plan.free_bytes)} there, or store models on a larger disk: "
            "set HF_HOME (or HF_HUB_CACHE), or model_store in the settings file.",
        )


def pull(repo_id: str, *, quant: str | None = None, revision: str | None = None,
         on_progress: ProgressCallback | None = None, cancel: CancelToken | None = None,
         on_plan: Callable[[PullPlan], None] | None = None, cache_dir: str | Path | None = None,
         token: str | None = None, max_workers: int = MAX_WORKERS) -> LocalModel:
    """Download ``repo_id`` (one GGUF quantization with ``quant``) into the cache.

    ``on_plan`` sees the plan before the disk check and the first byte (the CLI lists the
    files there). ``on_progress`` gets ``DownloadProgress`` events from the download threads
    (never two at once; a UI marshals them to its own thread). Cancelling raises
    ``Cancelled``; the partial files stay and the next pull of the same repository resumes them.
    """
    revision = revision or DEFAULT_REVISION
    cache_dir = Path(cache_dir) if cache_dir is not None else cache.default_cache_dir()
    try:
        plan = plan_pull(repo_id, quant=quant, revision=revision, cache_dir=cache_dir, token=token)
    except HubUnreachable as offline:
        return cached_model(repo_id, quant=quant, revision=revision, cache_dir=cache_dir, reason=offline.what)
    if on_plan is not None:
        on_plan(plan)
    check_disk_space(plan)
    download(plan, on_progress=on_progress, cancel=cancel, token=token, max_workers=max_workers)
    cache.write_ref(cache_dir, repo_id, revision, plan.commit)
    return _local_model(repo_id, plan.commit, plan.snapshot, plan.selection)


def download(plan: PullPlan, *, on_progress: ProgressCallback | None = None, cancel: CancelToken | None = None,
             token: str | None = None, max_workers: int = MAX_WORKERS) -> None:
    """Fetch every file of the plan; the first failure stops the others and is raised."""
    meter = TransferMeter(
        total=plan.total_bytes, already=plan.present_bytes, files_total=len(plan.files),
        on_progress=on_progress, cancel=cancel, what=f"the download of {plan.label()}",
    )
    meter.emit()
    # Smallest first: config and tokenizer in the first second (a gated repository or a bad
    # token shows at once), and the shards in the order the parallel workers finish them.
    files = sorted(plan.files, key=lambda f: (f.size or 0, f.path))
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(f: RepoFile) -> None:
        try:
            fetch_file(plan.repo_id, plan.commit, f, cache_dir=plan.cache_dir, meter=meter,
                       counted=plan.present_by_file.get(f.path, 0), token=token)
        except Stopped:
            pass
        except BaseException as error:
            with lock:
                errors.append(error)
            meter.stop()
            raise

    pool = ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix="hub-pull")
    futures = [pool.submit(one, f) for f in files]
    try:
        wait(futures, return_when=FIRST_EXCEPTION)
    except BaseException:  # KeyboardInterrupt in the waiting thread: stop the workers too
        meter.stop()
        raise
    finally:
        # Workers notice the stop at their next chunk; queued files are not started.
        pool.shutdown(wait=True, cancel_futures=bool(errors) or meter.stopped)
    if errors:
        error = _first_to_report(errors)
        if isinstance(error, Cancelled):
            raise Cancelled(
                f"{error.what}; {fmt_bytes(meter.done)} of {fmt_bytes(meter.total)} are on disk",
                "Run the same command again to resume where it stopped.",
            ) from None
        raise error
    meter.emit()


def _first_to_report(errors: list[BaseException]) -> BaseException:
    """A cancel wins (the user asked); then our errors; then whatever came first."""
    for kind in (Cancelled, HybridMoeError):
        for e in errors:
            if isinstance(e, kind):
                return e
    return errors[0]


def cached_model(repo_id: str, *, quant: str | None = None, revision: str | None = None,
                 cache_dir: str | Path | None = None, reason: str = "") -> LocalModel:
    """The cached copy of ``repo_id`` when the Hub cannot be asked; a clear error if there
    is none or it is incomplete."""
    revision = revision or DEFAULT_REVISION
    cache_dir = Path(cache_dir) if cache_dir is not None else cache.default_cache_dir()
    why = f" ({reason})" if reason else ""
    commit = cache.cached_commit(cache_dir, repo_id, revision)
    if commit is None:
        raise ModelError(
            f"Cannot download {repo_id}: the Hub cannot be reached{why}, and {cache_dir} holds no copy of it"
            + ("" if revision == DEFAULT_REVISION else f" at revision {revision}") + ".",
            # HF_HUB_OFFLINE named only when it is what keeps the Hub away.
            "Unset HF_HUB_OFFLINE (offline mode is on) and run the command again." if offline_mode()
            else "Connect to the network and run the command again.",
        )
    snapshot = cache.snapshot_dir(cache_dir, repo_id, commit)
    selection = select(cache.snapshot_files(snapshot), quant, f"the cached copy of {repo_id}")
    _check_complete(snapshot, selection, repo_id)
    model = _local_model(repo_id, commit, snapshot, selection)
    return replace(model, note=f"offline{why}: using the cached copy from {snapshot}")


def _check_complete(snapshot: Path, selection: Selection, repo_id: str) -> None:
    hint = "Connect to the network and run `hybridmoe pull` again to finish the download."
    if selection.kind == "gguf":
        if len(selection.files) != selection.expected_parts:
            raise ModelError(
                f"The cached copy of {repo_id} has {len(selection.files)} of the {selection.expected_parts} "
                f"parts of {selection.quantization}, and the Hub cannot be reached.", hint)
        return
    from hybridmoe.backend.models.safetensors_files import checkpoint_files

    try:
        checkpoint_files(snapshot)  # raises naming the first shard the index lists but the cache lacks
    except ModelError as error:
        raise ModelError(f"The cached copy of {repo_id} is incomplete: {error.what}", hint) from error


def _local_model(repo_id: str, commit: str, snapshot: Path, selection: Selection) -> LocalModel:
    path = snapshot / selection.weights_path if selection.weights_path else snapshot
    files = tuple(snapshot / f.path for f in selection.files)
    quant = selection.quantization
    family = problem = None
    try:
        from hybridmoe.backend.models import inspect_model

        inspected = inspect_model(path)
        family = inspected.spec.family
        quant = quant or inspected.spec.expert_format
    except HybridMoeError as error:  # downloaded fine, but not a model we can serve as it is
        problem = str(error)
    name = f"{repo_id}:{selection.quantization}" if selection.quantization else repo_id
    return LocalModel(
        name=name, path=path, kind=selection.kind, size_bytes=selection.total_bytes, source="hf-cache",
        quantization=quant, family=family, repo_id=repo_id, revision=commit, files=files, problem=problem,
    )
