"""A short measurement of host memory read bandwidth.

Decode speed with experts in host RAM is bounded by how fast the CPU cores can stream
weights from DRAM, and the datasheet figure (``memory.theoretical_host_bandwidth``) is
often far from what a machine delivers: missing DIMMs, one DIMM per two channels, a VM.
This probe reads a buffer far larger than the last-level cache from many threads at once
and keeps the best of a few passes (the best pass is the one least disturbed by other
work). Passes run back to back, so a burst of other work (an indexer, a browser tab, a
compile) can slow all of them; ``detect()`` therefore takes several probes a little apart
(``HOST_PROBES``) and keeps the best, so that a decode bound computed from the figure is
not one the engine then beats. It takes about a second and is skipped when the caller opts out.

Two implementations, neither of which touches process-wide settings:

* the native extension's probe (``hybridmoe.backend.engine._native.measure_read_bandwidth``), run on
  the thread pool that computes the CPU experts, on memory allocated as the experts' copies
  are (transparent huge pages where the kernel grants them), so it measures what the experts get;
* a portable one where the extension was not built: numpy sums from Python threads (numpy
  releases the GIL while it sums).

PyTorch is deliberately not used. Its thread count is process-wide (OpenMP, MKL and its
own pools): a probe that set it from a worker thread while a model generated on another
thread would resize the pools under the running model. The app once exited with a
segmentation fault while this probe (then torch-based) ran beside a loaded model; nothing
here needs torch, so nothing here can do that. Not importing torch also keeps
``hybridmoe doctor`` fast.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["HOST_PROBES", "probe_buffer_bytes", "probe_threads", "measure_host_read_bandwidth", "probes_note"]

MiB = 1024**2
GiB = 1024**3
# Large enough to leave any cache behind on machines whose L3 size we could not read.
MIN_BUFFER_BYTES = 256 * MiB
# Enough to defeat even a 2×384 MiB L3 (4×), without taking seconds to allocate and fill.
MAX_BUFFER_BYTES = 4 * GiB
# What detect() takes: the best of this many probes, PROBE_PAUSE_S apart (three times one probe).
HOST_PROBES = 3
PROBE_PAUSE_S = 0.1


def probes_note(probes: int, pause_s: float = PROBE_PAUSE_S) -> str:
    """How a measured figure was obtained, for the places that show it."""
    return f"best of {probes} probes {pause_s:g} s apart" if probes > 1 else "one probe"


def probe_buffer_bytes(l3_bytes: int | None, available_bytes: int | None) -> int:
    """max(4 × L3, 256 MiB), capped at 4 GiB and at a quarter of the available RAM."""
    size = max(4 * (l3_bytes or 0), MIN_BUFFER_BYTES)
    size = min(size, MAX_BUFFER_BYTES)
    if available_bytes:
        # Never push the machine into swap (or a cgroup OOM) just to measure it.
        size = min(size, available_bytes // 4)
    return max(size, MiB)


def probe_threads(physical_cores: int | None) -> int:
    """One thread per physical core (SMT siblings share the load ports), within our affinity."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        allowed = os.cpu_count() or 1
    return max(1, min(physical_cores or allowed, allowed))


def measure_host_read_bandwidth(
    *,
    buffer_bytes: int | None = None,
    l3_bytes: int | None = None,
    available_bytes: int | None = None,
    threads: int | None = None,
    passes: int = 3,
    probes: int = 1,
    pause_s: float = PROBE_PAUSE_S,
) -> float:
    """Best-of-``passes`` read bandwidth in bytes/s; with ``probes`` > 1, the best of that
    many such probes, ``pause_s`` apart, so that they sample different moments.

    ``buffer_bytes`` defaults to ``probe_buffer_bytes(l3_bytes, available_bytes)``.
    ``threads`` (default ``probe_threads(None)``) is the thread count of the portable probe;
    the native probe runs on the experts' own pool, whose size is the kernels' business
    (``HYBRIDMOE_CPU_THREADS``, else one thread per physical core) and is not changed here:
    resizing it would pull it from under a model using it. Raises on failure (out of
    memory, say); ``detect()`` turns that into an ``unknown`` entry.
    """
    if passes < 1 or probes < 1:
        raise ValueError("passes and probes must be at least 1")
    size = buffer_bytes if buffer_bytes is not None else probe_buffer_bytes(l3_bytes, available_bytes)
    size = max(int(size), 8)
    native = _native_module()

    def probe() -> float:
        if native is not None:
            return float(native.measure_read_bandwidth(size, passes))
        return _measure_with_numpy(size // 4, threads or probe_threads(None), passes)

    best = probe()
    for _ in range(probes - 1):
        time.sleep(pause_s)
        best = max(best, probe())
    return best


def _native_module():
    """The extension, or None where it was not built (a source tree never installed)."""
    try:
        # The extension sits at the top of the package and imports nothing: no torch here.
        from hybridmoe import _native
    except ImportError:
        return None
    return _native if hasattr(_native, "measure_read_bandwidth") else None


def _measure_with_numpy(elements: int, threads: int, passes: int) -> float:
    """Each thread sums its own slice of one float32 buffer; a pass is timed from the
    moment all threads start to the moment the last one finishes."""
    import numpy as np

    # Written in full (ones, not zeros) so the kernel backs it with real pages; untouched
    # memory would read the shared zero page and measure the cache.
    buffer = np.ones(max(elements, threads), dtype=np.float32)
    slices = np.array_split(buffer, threads)
    if threads == 1:
        slices[0].sum()  # warm up: page-table walks and the code path, not timed
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            slices[0].sum()
            best = min(best, time.perf_counter() - start)
        return buffer.nbytes / best

    # One more party than threads: the timing thread releases them all at once and waits
    # for all of them at the end.
    start_line, finish_line = threading.Barrier(threads + 1), threading.Barrier(threads + 1)
    failures: list[BaseException] = []

    def read(part) -> None:
        try:
            for _ in range(passes + 1):  # the first round is the warm-up
                start_line.wait()
                part.sum()
                finish_line.wait()
        except threading.BrokenBarrierError:
            pass
        except BaseException as error:  # MemoryError in a thread: reported by the caller
            failures.append(error)
            start_line.abort()
            finish_line.abort()

    workers = [threading.Thread(target=read, args=(part,), name=f"bandwidth-probe-{i}", daemon=True)
               for i, part in enumerate(slices)]
    for worker in workers:
        worker.start()
    best = float("inf")
    try:
        for round_ in range(passes + 1):
            start_line.wait()
            start = time.perf_counter()
            finish_line.wait()
            if round_:
                best = min(best, time.perf_counter() - start)
    except threading.BrokenBarrierError:
        pass
    finally:
        for worker in workers:
            worker.join()
    if failures:
        raise failures[0]
    return buffer.nbytes / best
