"""One loaded session, many users: up to ``parallel`` generations at once, the others wait
in a fair first-come queue.

A session runs at most ``max_parallel`` generations together (the engine decodes as many
conversations as the plan's KV cache holds, batched; llama.cpp one), and more must never
reach it at once. ``SharedSession`` puts a FIFO queue in front of it: a generation starts
when a place is free and those that arrived earlier have started. The API server's requests
and the TUI's chat go through the same instance, so a chat message sent while the server is
busy runs beside the requests when there is a place, and else waits its turn like any request.

The queue is bounded per call (``max_waiting``), so the server can refuse at once, with an
estimate of when to come back, instead of letting clients pile up; a generation cancelled
while it waits leaves the queue.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

from hybridmoe.backend.errors import HybridMoeError, ModelUnloadedError
from hybridmoe.backend.session import Cancelled, CancelToken, Done, Event, Message, Session, Stats

# How often a waiting generation looks at its cancel token: a client that went away leaves
# the queue within this time.
_CANCEL_POLL_S = 0.05
# Durations of the last generations, for the estimate of how long the queue takes.
_RECENT = 16
# The estimate before any generation has finished.
_DEFAULT_DURATION_S = 2.0


class QueueFull(HybridMoeError):
    """Too many generations are waiting; ``retry_after_s`` estimates when there is room."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"the model is busy: {waiting} requests are waiting",
                         f"Try again in {retry_after_s} s.")
        self.waiting = waiting
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class QueueCounts:
    waiting: int
    running: int  # 0 to parallel
    completed: int  # generations that have finished, however they ended


class SharedSession:
    """Wraps a Session; ``generate`` and ``complete`` are the Session's, ``parallel`` at once."""

    def __init__(self, session: Session, *, parallel: int | None = None,
                 hold: Callable[[CancelToken | None], AbstractContextManager] | None = None):
        """``parallel``: how many generations run at once; by default all the session can
        (its ``max_parallel``). ``hold(cancel)``: a
        context each running generation also holds once its turn in the queue has come (the
        TUI's process-wide turn for model work, shared by the answers, so that a bandwidth
        measurement or a benchmark never runs beside an API request). Taken after the queue,
        always in that order, so the two can never wait on each other."""
        most = session.max_parallel
        parallel = most if parallel is None else parallel
        if not 1 <= parallel <= most:
            raise ValueError(f"parallel must be 1 to {most}, the generations this session runs at once; not {parallel}")
        self.session = session
        self.parallel = parallel
        self._hold = hold
        self._changed = threading.Condition()
        self._waiting: deque[object] = deque()  # tickets in arrival order
        self._running = 0
        self._completed = 0
        self._durations: deque[float] = deque(maxlen=_RECENT)
        self.closed = False

    # ---- the Session protocol, in turns ---------------------------------------------------------

    def generate(self, messages: Sequence[Message], sampling, cancel: CancelToken | None = None) -> Iterator[Event]:
        """Waits its turn, then the session's events; cancelled while waiting, it ends as a
        generation cancelled before its first token does: ``Done("cancelled")``."""
        return self._in_turn(lambda session: session.generate(messages, sampling, cancel), cancel)

    def complete(self, prompt: str, sampling, cancel: CancelToken | None = None) -> Iterator[Event]:
        return self._in_turn(lambda session: session.complete(prompt, sampling, cancel), cancel)

    def close(self) -> None:
        """Closes the session (whoever loaded it decides when); waiting and later turns are
        refused. The generations in progress finish first: the session closes when the last
        one ends, so that the caller (the TUI's thread) never waits for them."""
        with self._changed:
            self.closed = True
            self._changed.notify_all()
            in_use = self._running
        if not in_use:
            self.session.close()

    def _in_turn(self, events: Callable[[Session], Iterator[Event]], cancel: CancelToken | None) -> Iterator[Event]:
        try:
            with self.turn(cancel) as session:
                yield from events(session)
        except Cancelled:  # while it waited: nothing was generated
            yield Done("cancelled", "", (), Stats(0, 0, None, None, None))

    # ---- turns ------------------------------------------------------------------------------------

    @contextmanager
    def turn(self, cancel: CancelToken | None = None, *, max_waiting: int | None = None) -> Iterator[Session]:
        """Wait until it is this caller's turn, then use the session until the block ends
        (beside up to ``parallel`` - 1 other turns).

        Raises ``QueueFull`` at once when every place is taken and ``max_waiting``
        generations are already waiting, ``Cancelled`` when ``cancel`` is set while waiting,
        and ``ModelUnloadedError`` when the session was closed.
        """
        self._acquire(cancel, max_waiting)
        started = time.monotonic()
        try:
            with self._hold(cancel) if self._hold is not None else nullcontext():
                yield self.session
        finally:
            self._release(started)

    def _acquire(self, cancel: CancelToken | None, max_waiting: int | None) -> None:
        ticket = object()
        with self._changed:
            self._check_open()
            busy = self._running >= self.parallel or self._waiting
            if max_waiting is not None and busy and len(self._waiting) >= max_waiting:
                raise QueueFull(len(self._waiting), self._retry_after_s())
            self._waiting.append(ticket)
            try:
                while self._running >= self.parallel or self._waiting[0] is not ticket:
                    if cancel is not None and cancel.cancelled:
                        raise Cancelled("waiting for the model was cancelled")
                    self._check_open()
                    self._changed.wait(_CANCEL_POLL_S)
                self._check_open()
            except BaseException:
                self._waiting.remove(ticket)
                self._changed.notify_all()  # the one behind may now be first
                raise
            self._waiting.popleft()
            self._running += 1
            self._changed.notify_all()  # the next in line may have a place too

    def _release(self, started: float) -> None:
        with self._changed:
            self._running -= 1
            self._completed += 1
            self._durations.append(time.monotonic() - started)
            self._changed.notify_all()
            closing = self.closed and not self._running
        if closing:  # closed while turns ran: now nobody uses the session
            self.session.close()

    def counts(self) -> QueueCounts:
        with self._changed:
            return QueueCounts(len(self._waiting), self._running, self._completed)

    def _retry_after_s(self) -> int:
        """Seconds until the queue has drained, from the recent generations' durations
        (measured as they ran, beside the others)."""
        mean = sum(self._durations) / len(self._durations) if self._durations else _DEFAULT_DURATION_S
        ahead = len(self._waiting) + self._running
        return max(1, math.ceil(ahead * mean / self.parallel))

    def _check_open(self) -> None:
        if self.closed:
            raise ModelUnloadedError()

