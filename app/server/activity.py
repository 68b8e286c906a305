"""What the API server is doing: the requests in progress (so that stopping the server can
cancel their generations) and the last ones that finished (for the TUI, the CLI's log lines
and tests). Written from the server's event loop, read from any thread."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hybridmoe.backend.session import CancelToken

# Finished requests kept for display.
_KEEP = 100


@dataclass(frozen=True)
class Finished:
    endpoint: str  # "/v1/chat/completions", "/v1/completions"
    status: int  # the HTTP status answered (200 also for a stream the client left)
    reason: str  # "stop", "length", "cancelled" (the client went away), or what was wrong
    prompt_tokens: int
    completion_tokens: int
    seconds: float

    def line(self) -> str:
        """One line for a log: what, how it ended, how much, how long."""
        tokens = f"{self.prompt_tokens} prompt + {self.completion_tokens} tokens" if self.status == 200 else ""
        parts = [f"{self.endpoint} {self.status} {self.reason}", tokens, f"{self.seconds:.2f} s"]
        return "  ".join(p for p in parts if p)


class Activity:
    def __init__(self, on_finished: Callable[[Finished], None] | None = None):
        self._lock = threading.Lock()
        self._in_progress: set[CancelToken] = set()
        self._finished: deque[Finished] = deque(maxlen=_KEEP)
        self._count = 0
        self._on_finished = on_finished

    def begin(self, cancel: CancelToken) -> None:
        with self._lock:
            self._in_progress.add(cancel)

    def end(self, cancel: CancelToken | None, record: Finished) -> None:
        with self._lock:
            self._in_progress.discard(cancel)
            self._finished.append(record)
            self._count += 1
        if self._on_finished is not None:
            self._on_finished(record)

    def cancel_all(self) -> None:
        """Stop every generation in progress (the server is shutting down)."""
        with self._lock:
            tokens = list(self._in_progress)
        for cancel in tokens:
            cancel.cancel()

    @property
    def in_progress(self) -> int:
        with self._lock:
            return len(self._in_progress)

    @property
    def finished_count(self) -> int:
        with self._lock:
            return self._count

    def recent(self, n: int = _KEEP) -> list[Finished]:
        """The last ``n`` finished requests, oldest first."""
        with self._lock:
            return list(self._finished)[-n:]
