"""A short measurement of host memory read bandwidth.

Decode speed with experts in host RAM is bounded by how fast the CPU cores can stream
weights from DRAM, and the datasheet figure (``memory.theoretical_host_bandwidth``) is
often far from what a machine delivers: missing DIMMs, one DIMM per two channels, a VM.
This probe reads a buffer far larger than the last-level cache with one thread per
physical core and keeps the best of a few passes (the best pass is the one least
disturbed by other work). It takes about half a second and is skipped when the caller
opts out.
"""

from __future__ import annotations

import os
import time

__all__ = ["probe_buffer_bytes", "probe_threads", "measure_host_read_bandwidth"]

MiB = 1024**2
GiB = 1024**3
# Large enough to leave any cache behind on machines whose L3 size we could not read.
MIN_BUFFER_BYTES = 256 * MiB
# Enough to defeat even a 2×384 MiB L3 (4×), without taking seconds to allocate and fill.
MAX_BUFFER_BYTES = 4 * GiB


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
) -> float:
    """Best-of-``passes`` read bandwidth in bytes/s, summing a float32 buffer.

    ``buffer_bytes`` defaults to ``probe_buffer_bytes(l3_bytes, available_bytes)`` and
    ``threads`` to ``probe_threads(None)``. Raises on failure (no torch and no numpy, or out
    of memory); ``detect()`` turns that into an ``unknown`` entry.
    """
    if passes < 1:
        raise ValueError("passes must be at least 1")
    size = buffer_bytes if buffer_bytes is not None else probe_buffer_bytes(l3_bytes, available_bytes)
    elements = max(size // 4, 1)
    threads = threads or probe_threads(None)
    try:
        import torch
    except ImportError:
        return _measure_with_numpy(elements, passes)

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # Writing every element first makes the kernel back the buffer with real pages;
        # reading untouched memory would read the shared zero page and measure the cache.
        buffer = torch.ones(elements, dtype=torch.float32)
        buffer.sum()  # warm up the thread pool and the code path, not timed
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        del buffer
    finally:
        # The thread count is process-wide; leave it as the caller had it.
        torch.set_num_threads(previous_threads)
    return elements * 4 / best


def _measure_with_numpy(elements: int, passes: int) -> float:
    """Single-threaded fallback: an underestimate on many-channel servers, said by the caller."""
    import numpy as np

    buffer = np.ones(elements, dtype=np.float32)
    buffer.sum()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return elements * 4 / best
