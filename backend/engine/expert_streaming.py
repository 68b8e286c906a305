"""Streamed prefill: a layer's CPU-resident experts copied to the device, the layer run there.

For a long prompt the CPU experts are compute-bound, and moving an expert over PCIe costs
less than computing it on the CPU once enough tokens are routed to it (docs/sizing.md §6;
the Plan turns that crossover into ``prefill_stream_min_tokens``). Then each MoE layer's
CPU-resident experts are copied, in their stored form (quantized bytes stay quantized: the
copy moves bits/8 bytes a weight), into a buffer reserved on the device, dequantized there
one expert at a time and computed with the layer's GPU-resident ones.

The buffer is a ring of expert slots, at least one layer's CPU experts (the Plan's prefill
reserve). A copier thread fills it in layer order, on a side stream: the copy of layer n+1
starts when layer n starts, and takes each slot as soon as layer n's expert in it has been
computed, so copy and compute overlap even when the ring holds only one layer. Every slot
has two markers (``streams.Marker``): *filled* (issued by the copier after its copy; the
compute stream waits for it) and *released* (issued by the computing thread after the
last kernel reading the slot; the copy of the next occupant waits for it). The host never
waits for the device, only for the other thread to have issued its part.

Host side, the stored bytes are views of the mmap'd checkpoint, which the device cannot read
asynchronously; the copier packs each expert into one of two pinned staging buffers (a host
memcpy) and issues one asynchronous copy per expert from there, so packing expert j+1
overlaps the transfer of expert j.

Every *released* marker is owed by whoever holds the layer: a forward call that stops early
(an error, an interrupt) leaves it in its ``with`` block, which issues the rest, and the
next ``layer`` call gives up the slots of any layer still open (prefetched and never used,
or entered and never left), so the copies that wrap round to them do not wait forever.
Closing the streamer (also at interpreter exit) fails every marker still owed, which ends
the copier's waits and the computing thread's alike; the copier is a daemon thread.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch

from hybridmoe.backend.engine.experts import (
    ExpertGroup,
    add_expert_output,
    matrices_of,
    routed_groups,
)
from hybridmoe.backend.formats.quant import QuantTensor
from hybridmoe.backend.engine.streams import Edge, Marker, Worker, close_at_exit

if TYPE_CHECKING:
    from hybridmoe.backend.engine.moe import MoE

# Every stored part starts at a multiple of this in a slot: any dtype can view it, and the
# device reads aligned rows. hybridmoe.backend.plan.budget.STREAM_SLOT_ALIGN is the same figure.
ALIGN = 256


def _round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class _Leaf:
    role: str  # "gate_up", "down", "gate_up_bias", ...
    part: str | None  # QuantTensor part name, or None for a plain tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class SlotLayout:
    """Where each stored tensor of one expert goes in a slot (the same for all experts of a layer)."""

    def __init__(self, stored: dict[str, Any]):
        leaves = []
        self.quant: dict[str, tuple[str, str, torch.Size, dict]] = {}
        for role, obj in stored.items():
            if isinstance(obj, QuantTensor):
                self.quant[role] = (obj.format, obj.layout, obj.shape, obj.meta)
                leaves += [(role, name, t) for name, t in obj.parts.items()]
            else:
                leaves.append((role, None, obj))
        offset = 0
        self.leaves: list[_Leaf] = []
        for role, part, t in leaves:
            n = t.numel() * t.element_size()
            self.leaves.append(_Leaf(role, part, t.dtype, tuple(t.shape), offset, n))
            offset = _round_up(offset + n)
        self.nbytes = offset

    @staticmethod
    def leaves_of(stored: dict[str, Any]):
        for obj in stored.values():
            if isinstance(obj, QuantTensor):
                yield from obj.parts.values()
            else:
                yield obj

    def pack(self, stored: dict[str, Any], dst: torch.Tensor) -> None:
        """Copy the stored bytes of one expert into `dst` (uint8, at least ``nbytes``, host or device)."""
        for leaf, t in zip(self.leaves, self.leaves_of(stored), strict=True):
            if tuple(t.shape) != leaf.shape or t.dtype != leaf.dtype:
                raise ValueError(f"expert part {leaf.role}/{leaf.part} is {t.dtype} {tuple(t.shape)}, "
                                 f"the layer's first expert has {leaf.dtype} {leaf.shape}")
            src = t.contiguous().reshape(-1).view(torch.uint8)
            dst[leaf.offset : leaf.offset + leaf.nbytes].copy_(src)

    def unpack(self, slot: torch.Tensor) -> dict[str, Any]:
        """The stored objects of the expert in `slot`, as views of it (on its device)."""
        views: dict[str, Any] = {}
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for leaf in self.leaves:
            t = slot[leaf.offset : leaf.offset + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)
            if leaf.part is None:
                views[leaf.role] = t
            else:
                parts.setdefault(leaf.role, {})[leaf.part] = t
        for role, (fmt, layout, shape, meta) in self.quant.items():
            views[role] = QuantTensor(fmt, layout, shape, parts[role], meta)
        return views


@dataclass
class _ExpertCopy:
    expert: int
    slot: int
    previous: Marker | None  # released by the slot's previous occupant
    filled: Marker
    released: Marker


class ExpertStreamer:
    """The reserved device buffer and the copier for the MoE layers of one device."""

    def __init__(self, edge: Edge, layers: list[MoE], reserve_bytes: int | None = None):
        self.edge = edge
        self.device = edge.device
        self._moes = {m.layer: m for m in layers}
        self._layouts: dict[int, SlotLayout] = {}
        self.skipped: dict[int, str] = {}  # layer -> why its experts are not streamed
        for m in layers:
            if len(m.host):
                self._layouts[m.layer] = SlotLayout(m.host.store.stored(m.host.ids[0]))
        self.slot_bytes = max((lay.nbytes for lay in self._layouts.values()), default=0)
        one_layer = max((len(self._moes[layer].host) for layer in self._layouts), default=0) * self.slot_bytes
        self.capacity = int(reserve_bytes) if reserve_bytes is not None else one_layer
        self.n_slots = self.capacity // self.slot_bytes if self.slot_bytes else 0
        for layer in list(self._layouts):
            n = len(self._moes[layer].host)
            if n > self.n_slots:
                # Its copies would wait for slots only its own compute frees: it runs on the CPU.
                self.skipped[layer] = (f"{n} CPU experts of {self.slot_bytes:,} B do not fit the "
                                       f"{self.capacity:,} B reserve ({self.n_slots} slots)")
                del self._layouts[layer]
        order = [m.layer for m in layers if m.layer in self._layouts]
        self._next = dict(itertools.pairwise(order))
        self.buffer = torch.empty(self.n_slots * self.slot_bytes, dtype=torch.uint8, device=self.device)
        self._groups = {layer: ExpertGroup(self._moes[layer].host.ids, self._moes[layer].host.n_experts,
                                           self.device, self._moes[layer].host.act) for layer in self._layouts}
        self._released: list[Marker | None] = [None] * self.n_slots
        self._next_slot = 0
        self._pending: dict[int, StreamedLayer] = {}
        self._open: list[StreamedLayer] = []  # started and not yet left: their released markers are owed
        self._copier = Worker("hybridmoe-expert-copy")
        self._copy_stream = edge.new_stream()
        self._staging = [edge.host_buffer(self.slot_bytes, torch.uint8) for _ in range(2)] if edge.cuda else []
        self._staging_done: list[Marker | None] = [None, None]
        self.broken: BaseException | None = None
        self.closed = False
        self.layers_streamed = 0
        self.bytes_copied = 0
        close_at_exit(self)

    def covers(self, layer: int) -> bool:
        """Whether `layer`'s CPU experts can be streamed (they fit, no copy has failed, and
        the streamer is not closed)."""
        return layer in self._layouts and self.broken is None and not self.closed

    def slot(self, i: int) -> torch.Tensor:
        return self.buffer[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def layer(self, moe: MoE) -> StreamedLayer:
        """`moe`'s CPU experts on the device (arriving), to be used in a `with` block; the copy of
        the next streamed layer of this device starts now."""
        if self.closed:
            raise RuntimeError("the expert streamer is closed")
        got = self._pending.pop(moe.layer, None)
        self._pending.clear()
        for stale in [s for s in self._open if s is not got]:
            # A forward call that stopped early left it open: prefetched and never used (an
            # error between layers), or entered and never left (an interrupt). Its slots are
            # given up, or the copies that wrap round to them would wait forever.
            stale.__exit__(None, None, None)
        try:
            if got is None:
                got = self._start(moe.layer)
            following = self._next.get(moe.layer)
            if following is not None:
                self._pending[following] = self._start(following)
        except BaseException:
            # Nobody will use, or leave, what is open now.
            for started in list(self._open):
                started.__exit__(None, None, None)
            self._pending.clear()
            raise
        self.layers_streamed += 1
        return got

    def _start(self, layer: int) -> StreamedLayer:
        moe = self._moes[layer]
        first = self._next_slot
        copies = []
        for j, e in enumerate(moe.host.ids):
            s = (first + j) % self.n_slots
            copies.append(_ExpertCopy(e, s, self._released[s], Marker(), Marker()))
        streamed = StreamedLayer(self, moe, copies)
        self._copier.submit(self._copy_layer, layer, copies)  # if it cannot, nothing has changed
        for c in copies:
            self._released[c.slot] = c.released
        self._next_slot = (first + len(copies)) % self.n_slots
        self._open.append(streamed)
        return streamed

    def _left(self, streamed: StreamedLayer) -> None:
        with contextlib.suppress(ValueError):  # closed meanwhile
            self._open.remove(streamed)

    def _copy_layer(self, layer: int, copies: list[_ExpertCopy]) -> None:
        """The copier thread: each expert into its slot once the slot's previous user is done."""
        store, layout = self._moes[layer].host.store, self._layouts[layer]
        done = 0
        try:
            with torch.inference_mode(), self.edge.use_stream(self._copy_stream):
                for c in copies:
                    if c.previous is not None:
                        c.previous.order(self._copy_stream)
                    if self.closed:
                        raise RuntimeError("the expert streamer was closed")
                    stored = store.stored(c.expert)
                    dst = self.slot(c.slot)
                    if self.edge.cuda:
                        b = c.slot % 2
                        if self._staging_done[b] is not None:
                            self._staging_done[b].wait()
                        layout.pack(stored, self._staging[b])
                        dst[: layout.nbytes].copy_(self._staging[b][: layout.nbytes], non_blocking=True)
                        self._staging_done[b] = self.edge.mark(self._copy_stream)
                    else:
                        layout.pack(stored, dst)
                    self.bytes_copied += layout.nbytes
                    c.filled.issue(self._copy_stream)
                    done += 1
        except BaseException as err:  # noqa: BLE001 - handed on to the waiting thread, which raises it
            if self.broken is None:
                self.broken = err
            for c in copies[done:]:
                c.filled.fail(err)

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop streaming: fail every marker still owed (a copy waiting for a slot, a thread
        waiting for a copy), then stop the copier, waiting at most `timeout` seconds for the
        copy under way. True if the copier has stopped. Safe to call again, from any thread."""
        if not self.closed:
            self.closed = True
            error = RuntimeError("the expert streamer was closed")
            for streamed in list(self._open):
                streamed._abandon(error)
            self._open.clear()
            self._pending.clear()
        stopped = self._copier.close(timeout)
        if stopped and self._copy_stream is not None:
            self._copy_stream.synchronize()  # the buffer may be freed next: no copy into it may be queued
        return stopped


class StreamedLayer:
    """One layer's CPU experts in device slots, for one forward call (a context manager:
    leaving it releases every slot, also those of experts no token reached)."""

    def __init__(self, streamer: ExpertStreamer, moe: MoE, copies: list[_ExpertCopy]):
        self.streamer = streamer
        self.moe = moe
        self._copies = {c.expert: c for c in copies}

    def __enter__(self) -> Self:
        return self

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                host_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 partial sum over the streamed experts, as ``cpu_experts_forward``
        (`host_ids`: the ids in host memory, see ``routed_groups``)."""
        s, host = self.streamer, self.moe.host
        layout = s._layouts[self.moe.layer]
        stream = s.edge.current_stream()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, tokens, weights in routed_groups(topk_ids, topk_weights, s._groups[self.moe.layer], host_ids):
            c = self._copies[e]
            c.filled.order(stream)
            stored = layout.unpack(s.slot(c.slot))
            m = matrices_of(stored, host.dtype, x.device, transposed=host.store.transposed)
            add_expert_output(out, x, tokens, weights, m, host.act)
            c.released.issue(stream)
        return out

    def __exit__(self, *exc) -> None:
        stream = self.streamer.edge.current_stream()
        for c in self._copies.values():
            if not c.released.issued:
                c.released.issue(stream)
        self.streamer._left(self)

    def _abandon(self, error: BaseException) -> None:
        """Its slots will never be released, nor its experts used: wake whoever waits for either."""
        for c in self._copies.values():
            c.filled.fail(error)
            c.released.fail(error)
