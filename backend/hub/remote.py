"""What the Hub says about a repository, and the Hub's failures turned into our errors.

One ``model_info(files_metadata=True)`` call gives the commit a revision points to and,
for every file, its size, git blob id and (LFS files) sha256: enough to choose files, size
the download against the free disk space, and verify every byte, before the first byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hybridmoe.backend.errors import HybridMoeError, ModelError, UsageError
from hybridmoe.backend.hub.selection import RepoFile

try:  # the HTTP client huggingface-hub uses (2.4: httpx2, a fork of httpx; 1.x: httpx)
    import httpx2 as httpx
except ImportError:  # pragma: no cover - depends on the installed huggingface-hub
    import httpx

LOGIN_HINT = "set HF_TOKEN to an access token (https://huggingface.co/settings/tokens) or run `hf auth login`"


class HubUnreachable(ModelError):
    """The Hub cannot be asked (offline mode, no network, connection refused, timeout)."""


@dataclass(frozen=True)
class RemoteRepo:
    repo_id: str
    revision: str  # as asked ("main", a tag, a commit)
    commit: str  # the commit it resolves to
    files: tuple[RepoFile, ...]
    gated: bool = False


def endpoint() -> str:
    return constants.ENDPOINT


def is_connection_error(error: BaseException) -> bool:
    return isinstance(
        error,
        (OfflineModeIsEnabled, httpx.ConnectError, httpx.TimeoutException, httpx.NetworkError, ConnectionError),
    )


def offline_mode() -> bool:
    """Whether huggingface-hub's offline mode (HF_HUB_OFFLINE) is on."""
    return constants.is_offline_mode()


def fetch_repo(repo_id: str, revision: str, *, token: str | None = None) -> RemoteRepo:
    """The Hub's listing of ``repo_id`` at ``revision``; raises our errors, HubUnreachable
    when the Hub cannot be reached."""
    if constants.is_offline_mode():
        raise HubUnreachable("offline mode is on (HF_HUB_OFFLINE=1)")
    try:
        info = HfApi(endpoint=endpoint()).model_info(repo_id, revision=revision, files_metadata=True, token=token)
    except Exception as error:
        raise translate(error, repo_id, revision=revision) from error
    files = tuple(
        RepoFile(
            path=s.rfilename,
            size=(s.lfs.size if s.lfs else s.size),
            sha256=(s.lfs.sha256 if s.lfs else None),
            blob_id=s.blob_id,
        )
        for s in (info.siblings or ())
    )
    if not info.sha:
        raise ModelError(f"The Hub at {endpoint()} gave no commit for {repo_id}@{revision}.",
                         "Check HF_ENDPOINT: it must point to a Hugging Face Hub (or a mirror of it).")
    return RemoteRepo(repo_id, revision, info.sha, files, gated=bool(info.gated))


def translate(error: BaseException, repo_id: str, *, revision: str | None = None,
              filename: str | None = None) -> BaseException:
    """Our error for a huggingface-hub / HTTP failure; anything unknown is returned as is
    (a bug or an unexpected server answer, which the CLI reports as an internal error)."""
    page = f"{endpoint()}/{repo_id}"
    what = f"{repo_id}/{filename}" if filename else repo_id
    if isinstance(error, HybridMoeError):
        return error
    if is_connection_error(error) or isinstance(error, LocalEntryNotFoundError):
        reason = "offline mode is on (HF_HUB_OFFLINE=1)" if isinstance(error, OfflineModeIsEnabled) else \
            f"cannot reach {endpoint()} ({_short(error)})"
        return HubUnreachable(reason)
    if isinstance(error, HFValidationError):
        return UsageError(f"{repo_id!r} is not a Hugging Face repository id ({error}).",
                          "Give it as organisation/name, e.g. moonshotai/Kimi-K2.6, or a catalogue name "
                          "(`hybridmoe models --catalogue`).")
    if isinstance(error, GatedRepoError):
        from huggingface_hub import get_token

        sent = "no token is set" if get_token() is None else "the token in use has not been granted access"
        return ModelError(
            f"{repo_id} is a gated model and the Hub refused {what} ({sent}).",
            f"Accept the license on {page} while logged in, then {LOGIN_HINT}.",
        )
    if isinstance(error, RevisionNotFoundError):
        return ModelError(f"{repo_id} has no revision {revision!r}.",
                          f"Check the branch, tag or commit on {page}/tree/main (default: main).")
    if isinstance(error, RemoteEntryNotFoundError):
        return ModelError(f"{what} is not on the Hub (any more) at this revision.",
                          "The repository changed while downloading; run the command again.")
    if isinstance(error, RepositoryNotFoundError):
        return ModelError(
            f"{repo_id} was not found on {endpoint()}.",
            f"Check the name (organisation/model, as on the model page). If it is private, {LOGIN_HINT}.",
        )
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            return ModelError(
                f"The Hub refused access to {what} (HTTP {status}).",
                f"If the model is gated, accept its license on {page}; then {LOGIN_HINT} "
                "with a token that may read it.",
            )
        return ModelError(f"The Hub answered HTTP {status} for {what}: {_short(error)}.",
                          "The Hub may be having trouble; try again later. A later pull resumes where this one stopped.")
    return error


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
