"""The KV cache of several conversations at once, handed out in fixed-size blocks.

Every attention layer stores its keys and values (or, for multi-head latent attention, its
latents) in blocks of ``KV_BLOCK_TOKENS`` positions. A ``Sequence`` (one conversation's place
in the cache) owns a block table per ``CacheGroup``: position s lives in block
table[s // B], row s % B, of every layer of the group. So a conversation takes memory as it
grows instead of reserving the whole context up front, and two conversations that start
alike (a common system prompt, or a conversation and its next turn) can hold the blocks of
that prefix once: blocks are counted by reference and copied before one of their holders
writes into them (copy on write).

Groups: the full-attention layers (and MLA's) hold every position; the sliding-window layers
of one window (GPT-OSS) hold only what their calls read and what a rewind may need
(``ModelSpec.kv_tokens``), releasing older blocks as the conversation moves on.

A call writing n tokens at start_pos is prepared (``PagedCache.prepare``: rewind, copy on
write, allocate) before any layer runs, so a refused call changes nothing a layer reads, and
committed after (``commit``: the token ids the cache now holds, which is what prefix reuse
matches). Calling again with an earlier start_pos rewinds: the entries past it are dropped.

The pool's size is the plan's (users x each layer's ``kv_tokens``). When it runs out, the
cache asks its owner to free blocks (``on_full``: the batching loop evicts the least recently
used idle conversation); with nothing left to evict the call is refused with a clear error,
never an out-of-memory crash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hybridmoe.backend.engine.host_memory import HostArena
from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.models.spec import KV_BLOCK_TOKENS

B = KV_BLOCK_TOKENS
NO_BLOCK = -1  # a table entry whose block a sliding group has released


class ContextFullError(HybridMoeError):
    """The conversation has outgrown the context the model was loaded with."""


class CacheRewindError(ValueError):
    """A rewind further back than a sliding-window group still holds: the caller has to
    prefill the conversation again from the start."""


class CacheFullError(HybridMoeError):
    """Every block is held by a conversation in progress (more conversations at once than
    the plan sized the cache for)."""


def check_span(start_pos: int, n: int, filled: int, capacity: int) -> None:
    """A call writing n tokens at start_pos must follow what is held and fit the capacity."""
    if start_pos < 0 or start_pos > filled:
        raise ValueError(f"start_pos {start_pos} skips positions: the cache holds {filled}")
    if start_pos + n > capacity:
        raise ContextFullError(
            f"the conversation needs {start_pos + n} tokens of context, the model was loaded with {capacity}",
            "Start a new conversation, or load the model with a larger context.",
        )


def _blocks(positions: int) -> int:
    return -(-positions // B)


class BlockPool:
    """Block ids of one group: a free list and a reference count per block."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self.refs = [0] * n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        if not self._free:
            return None
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self._free.append(block)


class CacheGroup:
    """Layers that hold the same positions and so share block tables: the full-attention
    layers (window None), or the sliding layers of one window, which keep the last
    window + rewind positions."""

    def __init__(self, n_blocks: int, window: int | None = None, rewind: int = 0, arena: HostArena | None = None):
        self.pool = BlockPool(n_blocks)
        self.window = window
        self.keep = None if window is None else window + rewind
        self.stores: list[PagedKV | PagedLatent] = []
        self.arena = arena  # where the stores' tensors come from on the CPU (huge pages)
        # The last decode step's positions and block tables on a GPU (``paged_decode.step_meta``):
        # (what they were made for, the tensor), shared by the group's layers.
        self.decode_meta: tuple[tuple, torch.Tensor] | None = None

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A store's zeroed tensor: from the host arena on the CPU, else where torch puts it."""
        if self.arena is not None and torch.device(device).type == "cpu":
            return self.arena.zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def copy_block(self, src: int, dst: int) -> None:
        for store in self.stores:
            store.copy_block(src, dst)

    def nbytes(self) -> int:
        return sum(store.nbytes() for store in self.stores)


class Sequence:
    """One conversation's place in the cache: a block table per group and the token ids
    whose keys and values it holds, position by position."""

    def __init__(self, groups: list[CacheGroup]):
        self.tables: dict[CacheGroup, list[int]] = {g: [] for g in groups}
        self.tokens: list[int] = []
        self._arrays: dict[tuple[CacheGroup, str], tuple[int, object]] = {}
        self._version = 0

    @property
    def filled(self) -> int:
        return len(self.tokens)

    def changed(self) -> None:
        self._version += 1

    @property
    def version(self) -> int:
        """Bumped whenever the block tables change (what a copy of them was made for)."""
        return self._version

    def table_array(self, group: CacheGroup) -> np.ndarray:
        """The group's block table as int64 NumPy (what the native kernels read)."""
        return self._table(group, "numpy", lambda table: np.asarray(table, dtype=np.int64))

    def table_tensor(self, group: CacheGroup, device: torch.device) -> torch.Tensor:
        """The group's block table as a tensor on `device` (what PyTorch indexing reads)."""
        return self._table(group, str(device), lambda table: torch.tensor(table, dtype=torch.long, device=device))

    def _table(self, group: CacheGroup, form: str, make: Callable[[list[int]], object]):
        """The table in `form`, made once per change of the tables (every layer of a call
        reads the same one)."""
        held = self._arrays.get((group, form))
        if held is None or held[0] != self._version:
            held = (self._version, make(self.tables[group]))
            self._arrays[(group, form)] = held
        return held[1]


@dataclass(frozen=True)
class Segment:
    """Rows row..row+n-1 of a call: one sequence's tokens at positions start..start+n-1."""

    seq: Sequence
    start: int
    n: int
    row: int = 0

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.n)


class PagedCache:
    """The blocks of every group and the sequences that hold them."""

    def __init__(self, groups: list[CacheGroup], capacity: int):
        self.groups = groups
        self.capacity = capacity  # positions one conversation may reach (the context)
        # Called when a group has no free block: frees some (evicts an idle conversation) and
        # returns True, or returns False when there is nothing it may free.
        self.on_full: Callable[[], bool] | None = None

    def new_sequence(self) -> Sequence:
        return Sequence(self.groups)

    def nbytes(self) -> int:
        return sum(g.nbytes() for g in self.groups)

    # ---- before and after a call ---------------------------------------------------------

    def reaches(self, seq: Sequence, start: int) -> bool:
        """Whether `seq` can continue at `start` (every sliding group holds the window
        before it)."""
        return all(self._reaches(seq, g, start) for g in self.groups if g.window is not None)

    def check(self, seq: Sequence, start: int, n: int) -> None:
        """Raise what ``prepare`` would refuse, changing nothing."""
        check_span(start, n, seq.filled, self.capacity)
        for group in self.groups:
            if group.window is not None:
                self._check_reach(seq, group, start)

    def prepare(self, seq: Sequence, start: int, n: int) -> None:
        """Make positions start..start+n-1 writable for `seq`: drop what follows start (a
        rewind), copy shared blocks it writes into, allocate the missing ones."""
        self.check(seq, start, n)
        del seq.tokens[start:]
        changed = False  # most decode steps write into a block they hold: the tables stay as made
        try:
            for group in self.groups:
                table = seq.tables[group]
                if group.window is None:
                    first_written, lo = start, 0
                else:
                    # Kept: the window before `start` (its queries read it) and the last keep
                    # positions after the call; older blocks go back to the pool now.
                    first_written = max(start, start + n - group.keep)
                    lo = max(0, min(start - group.window + 1, first_written))
                changed |= self._truncate(group, table, _blocks(start))
                for j in range(min(lo // B, len(table))):
                    if table[j] != NO_BLOCK:
                        group.pool.release(table[j])
                        table[j] = NO_BLOCK
                        changed = True
                for j in range(first_written // B, _blocks(start + n)):
                    while len(table) <= j:  # positions a sliding group skips hold no block
                        table.append(NO_BLOCK)
                        changed = True
                    if table[j] == NO_BLOCK:
                        table[j] = self._take(group)
                        changed = True
                    elif group.pool.refs[table[j]] > 1:  # shared with another sequence: copy first
                        fresh = self._take(group)
                        group.copy_block(table[j], fresh)
                        group.pool.release(table[j])
                        table[j] = fresh
                        changed = True
        finally:  # a refused block leaves what was done before it: tables the arrays must follow
            if changed:
                seq.changed()

    def commit(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        """The call wrote `tokens` at start..: the cache now holds them."""
        seq.tokens[start:] = tokens

    # ---- sharing and dropping ------------------------------------------------------------

    def fork(self, source: Sequence, length: int) -> Sequence | None:
        """A new sequence holding source's first `length` positions by sharing its blocks;
        None when a sliding group no longer holds the window before `length`."""
        seq = self.new_sequence()
        for group in self.groups:
            if group.window is not None and not self._reaches(source, group, length):
                self.drop(seq)
                return None
            table = source.tables[group][: _blocks(length)]
            for block in table:
                if block != NO_BLOCK:
                    group.pool.share(block)
            seq.tables[group] = list(table)
        seq.tokens = source.tokens[:length]
        seq.changed()
        return seq

    def drop(self, seq: Sequence) -> None:
        """Release every block of `seq`; it holds nothing afterwards."""
        for group in self.groups:
            self._truncate(group, seq.tables[group], 0)
        seq.tokens = []
        seq.changed()

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _reaches(seq: Sequence, group: CacheGroup, start: int) -> bool:
        """Whether `seq` holds the window before `start` in `group`."""
        table = seq.tables[group]
        first = max(0, start - group.window + 1)
        return all(j < len(table) and table[j] != NO_BLOCK for j in range(first // B, _blocks(start)))

    def _check_reach(self, seq: Sequence, group: CacheGroup, start: int) -> None:
        if not self._reaches(seq, group, start):
            raise CacheRewindError(f"cannot rewind a sliding-window cache of {seq.filled} positions to {start}: "
                                   f"it keeps the last {group.keep}")

    @staticmethod
    def _truncate(group: CacheGroup, table: list[int], n_blocks: int) -> bool:
        """Release the table's blocks from n_blocks on; whether there were any."""
        if len(table) <= n_blocks:
            return False
        for block in table[n_blocks:]:
            if block != NO_BLOCK:
                group.pool.release(block)
        del table[n_blocks:]
        return True

    def _take(self, group: CacheGroup) -> int:
        while True:
            block = group.pool.take()
            if block is not None:
                return block
            if self.on_full is None or not self.on_full():
                raise CacheFullError(
                    f"the KV cache is full: its {group.pool.n_blocks} blocks of {B} positions are held by "
                    "conversations in progress",
                    "Serve fewer conversations at once, or plan for more (`hybridmoe plan --users N`).")


class PagedKV(nn.Module):
    """Keys and values of one attention layer: [blocks, KV heads, B, head size] each."""

    def __init__(self, group: CacheGroup, n_kv_heads: int, key_dim: int, value_dim: int, dtype, device):
        super().__init__()
        self.group = group
        n = group.pool.n_blocks
        self.register_buffer("k", group.zeros((n, n_kv_heads, B, key_dim), dtype, device), persistent=False)
        self.register_buffer("v", group.zeros((n, n_kv_heads, B, value_dim), dtype, device), persistent=False)
        group.stores.append(self)

    @property
    def window(self) -> int | None:
        return self.group.window

    def copy_block(self, src: int, dst: int) -> None:
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def write(self, seq: Sequence, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k, v [1, KV heads, T, d] at positions start.. (their blocks prepared)."""
        pos = torch.arange(start, start + k.shape[2])
        table = seq.table_tensor(self.group, torch.device("cpu"))
        blocks = table[pos // B].to(self.k.device)
        rows = (pos % B).to(self.k.device)
        self.k[blocks, :, rows] = k[0].transpose(0, 1).to(self.k.dtype)
        self.v[blocks, :, rows] = v[0].transpose(0, 1).to(self.v.dtype)

    def _read(self, seq: Sequence, first_block: int, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks first_block.. of `seq` as [1, KV heads, n_blocks * B, d] keys and values."""
        table = seq.table_tensor(self.group, self.k.device)[first_block : first_block + n_blocks]
        keys, values = self.k[table], self.v[table]  # [n, KV, B, d]
        shape = lambda t: t.permute(1, 0, 2, 3).reshape(1, t.shape[1], -1, t.shape[3])  # noqa: E731
        return shape(keys), shape(values)

    def update(self, seq: Sequence, k: torch.Tensor, v: torch.Tensor,
               start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store k, v [1, KV heads, T, d] at start (``PagedCache.prepare`` has run); return
        the keys and values the new queries may see and their absolute positions (None:
        they are 0..S-1)."""
        n = k.shape[2]
        end = start + n
        if self.window is None:
            self.write(seq, k, v, start)
            keys, values = self._read(seq, 0, _blocks(end))
            return keys[:, :, :end], values[:, :, :end], None
        # A sliding layer: the held positions of the window before `start`, then the new
        # ones as the cache holds them (only the last `keep` of which are stored): a chunk's
        # own keys read as a later chunk reads them (a float16 cache under float32 activations).
        first = max(0, start - self.window + 1)
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        keys, values, positions = k, v, torch.arange(start, end, device=k.device)
        if first < start:
            j0 = first // B
            held_k, held_v = self._read(seq, j0, _blocks(start) - j0)
            lo, hi = first - j0 * B, start - j0 * B
            keys = torch.cat((held_k[:, :, lo:hi], k), dim=2)
            values = torch.cat((held_v[:, :, lo:hi], v), dim=2)
            positions = torch.arange(first, end, device=k.device)
        kept = min(n, self.group.keep)
        self.write(seq, k[:, :, n - kept :], v[:, :, n - kept :], end - kept)
        return keys, values, positions


class PagedLatent(nn.Module):
    """Multi-head latent attention's cache: one row per position, [latent | rotary key], so
    that the absorbed attention reads keys as a view of the rows and values as a view of
    their first kv_lora_rank columns."""

    def __init__(self, group: CacheGroup, kv_lora_rank: int, rope_dim: int, dtype, device):
        super().__init__()
        self.group = group
        self.kv_lora_rank = kv_lora_rank
        n = group.pool.n_blocks
        self.register_buffer("kv", group.zeros((n, B, kv_lora_rank + rope_dim), dtype, device), persistent=False)
        group.stores.append(self)

    def copy_block(self, src: int, dst: int) -> None:
        self.kv[dst] = self.kv[src]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def write(self, seq: Sequence, latent: torch.Tensor, rope_key: torch.Tensor, start: int) -> None:
        """Store latent [T, kv_lora_rank] and rope_key [T, rope_dim] at positions start.."""
        pos = torch.arange(start, start + latent.shape[0])
        table = seq.table_tensor(self.group, self.kv.device)
        blocks, rows = table[(pos // B).to(self.kv.device)], (pos % B).to(self.kv.device)
        self.kv[blocks, rows] = torch.cat((latent, rope_key), dim=-1).to(self.kv.dtype)

    def update(self, seq: Sequence, latent: torch.Tensor, rope_key: torch.Tensor, start: int) -> torch.Tensor:
        """``write``, then return rows 0..start+T-1."""
        self.write(seq, latent, rope_key, start)
        end = start + latent.shape[0]
        table = seq.table_tensor(self.group, self.kv.device)
        return self.kv[table[: _blocks(end)]].reshape(-1, self.kv.shape[-1])[:end]


def causal_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor | None, n_keys: int, window: int | None
) -> torch.Tensor:
    """Boolean [T, S] mask (True = may attend): keys at or before each query, within the
    window when there is one (a window of W keeps the query and the W-1 before it)."""
    if k_pos is None:
        k_pos = torch.arange(n_keys, device=q_pos.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed
