"""Progress of a whole pull: bytes done of the total, rate, time left; and the stop signal.

Every download thread reports the bytes it writes here; one ``DownloadProgress`` (a
``hybridmoe.backend.session.Progress``) goes to the caller at most every ``interval`` seconds and at
each finished file, so a TUI or a terminal line shows one bar for the whole model rather
than one per shard. The same object is where writers learn that they must stop: the user
cancelled (``Cancelled``), or another thread failed (``Stopped``: its error is the one to
report).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hybridmoe.backend.session import CancelToken, Progress, ProgressCallback
from hybridmoe.backend.units import fmt_bytes, fmt_rate

# The rate is measured over this window: long enough to smooth TCP bursts and the pauses
# between files, short enough to follow a changing connection.
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class DownloadProgress(Progress):
    """``done``/``total`` are bytes of the whole pull (files already on disk count as done)."""

    rate_bytes_per_s: float | None = None  # over the last RATE_WINDOW_S seconds
    eta_s: float | None = None
    file: str = ""  # the file most recently written to
    files_done: int = 0
    files_total: int = 0


class Stopped(Exception):
    """Raised in a download thread because another one failed; never reaches the caller."""


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class TransferMeter:
    def __init__(self, *, total: int, already: int, files_total: int, files_done: int = 0,
                 on_progress: ProgressCallback | None = None, cancel: CancelToken | None = None,
                 what: str = "the download", interval: float = 0.2,
                 clock: Callable[[], float] = time.monotonic):
        self.total = total
        self.done = already
        self.files_total = files_total
        self.files_done = files_done
        self.what = what
        self._on_progress = on_progress
        self._cancel = cancel
        self._stop = threading.Event()
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._emit_lock = threading.Lock()  # callbacks never run concurrently, whatever thread calls
        self._samples: deque[tuple[float, int]] = deque([(clock(), already)])
        self._last_emit = float("-inf")
        self._file = ""

    # ---- called from download threads ------------------------------------------------------

    def check(self) -> None:
        """Raise if the download must stop: between chunks, before each file."""
        if self._cancel is not None:
            self._cancel.raise_if_cancelled(self.what)
        if self._stop.is_set():
            raise Stopped()

    def wait(self, seconds: float) -> None:
        """Sleep (before a retry), but raise as soon as the download must stop."""
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._stop.wait(min(left, 0.1))

    def add(self, nbytes: int, file: str = "") -> None:
        """``nbytes`` more on disk (negative when a partial file was found unusable)."""
        with self._lock:
            self.done += nbytes
            if file:
                self._file = file
            now = self._clock()
            self._samples.append((now, self.done))
            while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
                self._samples.popleft()
            due = now - self._last_emit >= self._interval
        if due:
            self.emit()

    def file_finished(self, file: str) -> None:
        with self._lock:
            self.files_done += 1
            self._file = file
        self.emit()

    # ---- called by the coordinator ----------------------------------------------------------

    def stop(self) -> None:
        """Make every writer stop at its next chunk (another thread failed)."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set() or (self._cancel is not None and self._cancel.cancelled)

    def rate(self) -> float | None:
        with self._lock:
            (t0, b0), (t1, b1) = self._samples[0], self._samples[-1]
        if t1 - t0 < 0.5 or b1 <= b0:  # too early to say, or nothing new arrived
            return None
        return (b1 - b0) / (t1 - t0)

    def snapshot(self) -> DownloadProgress:
        rate = self.rate()
        with self._lock:
            done, file, files_done = self.done, self._file, self.files_done
        remaining = max(self.total - done, 0)
        eta = remaining / rate if rate else (0.0 if remaining == 0 else None)
        pct = f" ({100 * done / self.total:.1f}%)" if self.total else ""
        message = (f"{fmt_bytes(done)} of {fmt_bytes(self.total)}{pct}, {fmt_rate(rate)}, "
                   f"ETA {fmt_duration(eta)}, file {min(files_done + 1, self.files_total)}/{self.files_total}")
        return DownloadProgress(
            stage="download", done=done, total=self.total, unit="B", message=message,
            rate_bytes_per_s=rate, eta_s=eta, file=file, files_done=files_done, files_total=self.files_total,
        )

    def emit(self) -> None:
        if self._on_progress is None:
            return
        with self._emit_lock:
            with self._lock:
                self._last_emit = self._clock()
            self._on_progress(self.snapshot())
