"""The boundary between the host and the main device: streams, markers, host buffers.

The hybrid scheduler (``hybrid``) and the streamed prefill (``expert_streaming``) order work
that several threads issue on several CUDA streams. They do it only through this module, so
that the same scheduling code also runs where the main device is the CPU (a CPU-only
machine where a test asks for the hybrid path explicitly): there every operation is done
when the call that issued it returns, so a marker only has to say that the issuing thread
got that far, and host buffers need no pinning.

Every wait here ends: a marker that will not be issued (its forward call failed, was
abandoned, or its scheduler was closed) is failed instead, which wakes its waiters with the
error. The scheduler's threads (``Worker``) are daemon threads, stopped when their owner is
closed or garbage-collected and at interpreter exit, so that a session nobody closed never
keeps the process alive.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref
from concurrent.futures import Future

import torch

# Issuing and failing a marker are decided under this lock: the first one wins.
_SETTLE = threading.Lock()


class Marker:
    """A point in the work one thread issues on one stream.

    Made before the work is issued, so that it can be handed to another thread first: a
    waiter then waits until the point has been issued (a CUDA event waited on before it is
    recorded would let the waiter through at once, and e.g. let a copy overwrite memory a
    kernel is still reading). `fail` passes an error on to the waiters instead: the issuing
    thread's, or the reason the point will never be issued. Whichever of the two comes first
    settles the marker; the later one does nothing.
    """

    __slots__ = ("_error", "_event", "_issued")

    def __init__(self):
        self._issued = threading.Event()
        self._event = None
        self._error: BaseException | None = None

    def issue(self, stream=None) -> Marker:
        """Everything issued so far on `stream` (None: the CPU, already done) is before this point."""
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        with _SETTLE:
            if not self._issued.is_set():
                self._event = event
                self._issued.set()
        return self

    def fail(self, error: BaseException) -> None:
        with _SETTLE:
            if not self._issued.is_set():
                self._error = error
                self._issued.set()

    @property
    def issued(self) -> bool:
        """Settled: issued or failed (a waiter would not block)."""
        return self._issued.is_set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def wait(self) -> None:
        """Block this thread until the work before the point is done."""
        self._issued.wait()
        if self._error is not None:
            raise self._error
        if self._event is not None:
            self._event.synchronize()  # releases the GIL while it waits

    def order(self, stream) -> None:
        """Make `stream` run nothing more until the work before the point is done, without
        blocking this thread beyond the point being issued (on the CPU: until it is done)."""
        self._issued.wait()
        if self._error is not None:
            raise self._error
        if self._event is not None and stream is not None:
            stream.wait_event(self._event)


class Edge:
    """One device as the scheduler sees it: its streams, and host memory it copies through."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def host_buffer(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Host memory a copy to or from the device can run from without blocking (pinned)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def new_stream(self):
        return torch.cuda.Stream(self.device) if self.cuda else None

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def use_stream(self, stream):
        """Issue the work of a `with` block on `stream` (and this device) from this thread."""
        if not self.cuda:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(stream))
        return stack

    def mark(self, stream=None) -> Marker:
        """A marker issued now, after the work issued so far on `stream` (default: the current one)."""
        return Marker().issue(stream if stream is not None else self.current_stream())

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A new device tensor with the contents of `host` (a host buffer), copied without
        blocking this thread; the buffer must not be written until the copy is done (work
        issued later on the current stream is after it)."""
        if self.cuda:
            return host.to(self.device, non_blocking=True)
        return host.clone()  # the CPU stand-in: the caller gets memory of its own, as from a copy


_STOP = object()


class Worker:
    """One daemon thread that runs the callables given to it, in order (started on first use).

    Unlike a ThreadPoolExecutor's worker (joined at interpreter exit), it never keeps the
    process alive. It stops when closed, when the Worker is garbage-collected (the thread
    holds only its queue, so an idle thread keeps nothing else alive), and at exit (with its
    owner, see ``close_at_exit``). Closing cancels the jobs not yet started.
    """

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        # Runs once: on close, on garbage collection, or at exit.
        self._stop = weakref.finalize(self, self._queue.put, _STOP)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=_serve, args=(self._queue, self._cancel),
                                                name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((future, fn, args))
        return future

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def close(self, timeout: float | None = 10.0) -> bool:
        """Cancel the jobs not yet started, let the running one finish (waiting at most
        `timeout` seconds) and stop the thread. True if it has stopped."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._cancel.set()
        self._stop()
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()


def _serve(jobs: queue.SimpleQueue, cancel: threading.Event) -> None:
    while True:
        item = jobs.get()
        if item is _STOP:
            return
        future, fn, args = item
        del item
        if cancel.is_set():
            future.cancel()
        elif future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - the submitter gets it from the future
                future.set_exception(err)
        del future, fn, args  # hold nothing of the job while idle (its owner may be collected)


_AT_EXIT: weakref.WeakSet = weakref.WeakSet()


def close_at_exit(owner) -> None:
    """Call ``owner.close(timeout=...)`` at interpreter exit if it is still alive then (a
    session nobody closed): its waits are failed and its threads stopped before the
    interpreter tears down the modules they run."""
    _AT_EXIT.add(owner)


# A daemon thread still inside a native call when the interpreter tears down aborts the
# process (exit code 134): the call's end is worth waiting for. A closed model ends a prompt
# slice at its next layer; a decode step of many conversations of a large model on a slow
# machine can still take seconds.
_EXIT_WAIT_S = 30.0


@atexit.register
def _close_all() -> None:
    for owner in list(_AT_EXIT):
        with contextlib.suppress(Exception):
            owner.close(timeout=_EXIT_WAIT_S)
