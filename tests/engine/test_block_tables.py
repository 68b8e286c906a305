"""The block tables' array forms (what the native kernels read) follow every change of the
tables, and are not made again when a call writes into blocks the sequence already holds."""

from __future__ import annotations

import pytest

from hybridmoe.backend.engine.kv_cache import NO_BLOCK, B, CacheFullError, CacheGroup, PagedCache


def _same(cache: PagedCache, seq) -> None:
    for group in cache.groups:
        assert seq.table_array(group).tolist() == seq.tables[group]


def test_arrays_follow_the_tables_and_are_kept_while_they_stay():
    full, sliding = CacheGroup(6), CacheGroup(6, window=B, rewind=0)
    cache = PagedCache([full, sliding], capacity=6 * B)
    seq = cache.new_sequence()

    def step(start: int, n: int) -> None:
        cache.prepare(seq, start, n)
        cache.commit(seq, start, [7] * n)
        _same(cache, seq)

    step(0, 3)
    held = seq.table_array(full)
    step(3, 1)  # inside the block it holds: the same array, not a new one
    assert seq.table_array(full) is held
    step(4, B)  # into a new block
    assert len(seq.table_array(full)) == 2 and seq.table_array(full) is not held
    with pytest.raises(ValueError):  # skips positions: refused before anything changes
        cache.prepare(seq, 3 * B, 1)
    _same(cache, seq)
    step(2, 1)  # a rewind gives blocks back
    assert len(seq.table_array(full)) == 1
    for start in range(3, 4 * B, 7):  # the sliding group drops blocks behind its window
        step(start, 7)
    assert NO_BLOCK in seq.tables[sliding]


def test_a_refused_call_leaves_arrays_that_match_what_it_did():
    group = CacheGroup(2)
    cache = PagedCache([group], capacity=4 * B)
    seq = cache.new_sequence()
    cache.prepare(seq, 0, 1)
    cache.commit(seq, 0, [7])
    seq.table_array(group)  # made: the refused call must not leave it stale
    with pytest.raises(CacheFullError):
        cache.prepare(seq, 1, 3 * B)  # takes the second block, then finds none for the third
    _same(cache, seq)
    assert sum(block >= 0 for block in seq.tables[group]) == 2
