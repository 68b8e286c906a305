"""The KV cache's host memory: zeroed tensors carved from huge-page mappings."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from hybridmoe.backend.engine import host_memory
from hybridmoe.backend.engine.host_memory import ALIGN, HUGE_PAGE, HostArena
from hybridmoe.backend.engine.kv_cache import CacheGroup, PagedKV
from hybridmoe.backend.hardware.memory import read_transparent_hugepages

needs_advice = pytest.mark.skipif(host_memory._ADVICE is None, reason="no MADV_HUGEPAGE on this platform")


@needs_advice
def test_tensors_are_zeroed_apart_and_outlive_the_arena():
    arena = HostArena(chunk_bytes=4 * HUGE_PAGE)
    a = arena.zeros((3, 5, 7), torch.bfloat16)
    b = arena.zeros((1000,), torch.float32)
    big = arena.zeros((3 * HUGE_PAGE,), torch.uint8)  # more than what is left of the chunk: a chunk of its own
    assert a.shape == (3, 5, 7) and a.dtype == torch.bfloat16 and b.dtype == torch.float32
    for t in (a, b, big):
        assert t.is_contiguous() and not t.any() and t.data_ptr() % ALIGN == 0
    a.fill_(1)
    big.fill_(2)
    assert not b.any()  # a tensor ends before the next begins
    del arena
    gc.collect()
    assert a.float().sum() == 105 and big[-1] == 2 and not b.any()  # each keeps its mapping


@needs_advice
def test_a_paged_cache_on_the_cpu_is_in_huge_pages():
    mode, why = read_transparent_hugepages()
    if mode in (None, "never"):
        pytest.skip(f"no transparent huge pages on this machine ({mode or why})")
    group = CacheGroup(n_blocks=64, arena=HostArena())
    store = PagedKV(group, n_kv_heads=4, key_dim=128, value_dim=128, dtype=torch.bfloat16, device="cpu")
    start = store.k.data_ptr()  # 4 MiB of keys, then 4 MiB of values
    fields = {}
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m.group(1), 16) <= start < int(m.group(2), 16):
            for field in lines[i + 1:]:
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", field):
                    break
                name, value = field.split(":", 1)
                fields[name] = value.split()[0]
    # In memory at load, as torch.zeros left it (the plan counted it), and in huge pages.
    assert int(fields["Rss"]) * 1024 >= 2 * store.k.nbytes
    assert int(fields["AnonHugePages"]) >= HUGE_PAGE // 1024


def test_without_the_advice_or_off_the_cpu_tensors_are_torch_zeros(monkeypatch):
    monkeypatch.setattr(host_memory, "_ADVICE", None)
    t = HostArena().zeros((4, 4), torch.float32)
    assert not t.any() and t.untyped_storage().nbytes() == 64  # its own storage, not a slice of a mapping
    group = CacheGroup(n_blocks=2, arena=HostArena())
    assert group.zeros((2, 3), torch.float32, "meta").device.type == "meta"
