"""Host memory in transparent huge pages, for what the CPU reads every decode token.

A decode step reads every layer's whole KV cache. In 4 KiB pages each 4 KiB of it is a TLB
miss, and after a token's weights have streamed through the caches the page tables are out
of them too, so a miss can be a page walk to DRAM (in a virtual machine, a two-level one).
Measured on the 8-layer benchmark model, two copies of it in one process, rounds in turn:
attention took 0.93-0.96x the time with the cache in huge pages (64 to 2300 positions), the
decode token 1.00-1.03x. The weights' own copies are in huge pages already (the native
``allocate_pages``); the cache's tensors come from here.

One layer's cache is often smaller than a huge page (1.2 MB for the benchmark model at 1100
positions), so tensors are carved from chunks of many layers. Each tensor keeps its chunk
alive, so an arena holds no memory its tensors do not.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20
CHUNK_BYTES = 64 << 20
ALIGN = 4096  # tensors start on their own page

# Where the platform has no such advice (macOS, Windows) tensors are plain torch.zeros.
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


class HostArena:
    """Zeroed CPU tensors from large anonymous mappings advised for huge pages."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 over the current mapping, from a huge page boundary
        self._used = 0

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if _ADVICE is None or nbytes == 0:
            return torch.zeros(shape, dtype=dtype)
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = self._map(max(self.chunk_bytes, nbytes)), 0
        piece = self._chunk[self._used:self._used + nbytes]
        self._used += -(-nbytes // ALIGN) * ALIGN
        # Fresh pages read as zeros already; writing them faults them in now, as torch.zeros
        # does: the memory the plan counted is taken at load, not in the middle of a chat.
        piece.zero_()
        return piece.view(dtype).view(shape)

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor:
        """A fresh zeroed mapping of at least `nbytes` from a huge page boundary on (mmap
        aligns to 4 KiB only, and only whole aligned huge pages can be granted)."""
        m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(_ADVICE)  # a hint: where the kernel refuses, the pages are small
        whole = torch.frombuffer(m, dtype=torch.uint8)  # holds the mapping as long as any view of it lives
        skip = -whole.data_ptr() % HUGE_PAGE
        return whole[skip:skip + nbytes]
