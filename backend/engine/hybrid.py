"""Hybrid execution of the MoE layers: the CPU experts overlapped with the GPU's work.

Per MoE layer, for a decode step or a short prompt (``HybridScheduler._overlapped``):

1. the router runs on the device; the hidden states, expert ids and routing weights are
   copied into a pinned host slot without blocking, and a marker is issued after the copies;
2. this thread issues the shared experts and the GPU experts: for a decode step two kernel
   launches that read the ids on the device (``decode_experts``); for longer calls, once the
   ids have reached the host, the loop over the GPU experts hit (grouped on the host so that
   nothing waits for the device). The ids come to the host only for the CPU experts and that
   loop (activations are counted on the device, ``stats``);
3. the CPU half waits for the marker, runs the layer's CPU experts in the native kernels and
   writes the float32 result into the slot, while the device computes what step 2 issued. For
   calls of up to ``INLINE_ROWS`` rows (decode steps) this thread does it, after step 2; for
   longer ones a worker (one long-lived thread) does it from the start, overlapping the host
   time of step 2's many launches. For a decode step the hand-over to the worker and back
   (two thread wake-ups a layer) cost more than the few launches it overlapped: on an H200
   machine's 16-core host, the mid-size model with every expert on the CPU decoded at 46.7
   tokens/s this way and at 38.5 through the worker (`scripts/gpu_check.py`, same run);
4. the result goes back to the device without blocking and is added, in the order the
   CPU-only path adds it (``MoE.combine``).

The only waits are the ones the data needs: the CPU half waits for its inputs, this thread
for the ids and for the CPU result. Two host slots alternate between consecutive MoE layers,
so a slot is never rewritten while the asynchronous copy of its result to the device may
still be queued.

Prompts of at least ``HybridOptions.stream_min_tokens`` tokens (the threshold the Plan
derives from the prefill crossover, docs/sizing.md §6) take the other path: the layer's
CPU-resident experts are streamed over PCIe into a reserved device buffer and the whole
layer runs on the device (``expert_streaming``).

No CUDA graphs (yet): the decode step returns to the host at every MoE layer (its CPU
experts need the ids), so a graph could only cover the stretches between (attention,
router, shared and GPU experts). Since the decode attention reads its positions and block
tables from the device (``paged_decode``), those stretches have static shapes for a given
number of rows; capturing them is the next step (the host's time per launch, some 10-30 us,
is what a decode step on the GPU costs: ``step_profile``'s parts, printed by the GPU check).

Both threads (the CPU-expert worker and each streamer's copier) are daemon threads that
every wait of theirs can be woken from (``streams``): ``HybridScheduler.close`` stops them,
and so does garbage collection or interpreter exit for a scheduler nobody closed.

``attach`` installs one scheduler on every MoE layer of a model. A CPU main device does not
get one unless asked (the tests do, to run this code with the CPU standing in for the
GPU): there the plain synchronous ``MoE.forward`` is the fastest path and has no threads,
copies or markers at all.
"""

from __future__ import annotations

import contextvars

import contextlib
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from hybridmoe.backend.engine import step_profile
from hybridmoe.backend.engine.expert_streaming import ExpertStreamer
from hybridmoe.backend.engine.experts import decode_kernels_apply, experts_forward
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.engine.streams import Edge, Marker, Worker, close_at_exit


# Calls of up to this many rows run their CPU half on the calling thread (see the module
# docstring, step 3).
INLINE_ROWS = 8


@dataclass(frozen=True)
class HybridOptions:
    """How MoE layers share their work between the device and the CPU.

    stream_min_tokens: forward calls of at least this many tokens stream each layer's
        CPU-resident experts to the device and run the layer there (None: never).
    stream_reserve_bytes: the device buffer for streamed experts, per device (its string,
        e.g. "cuda:0"); 0: that device does not stream; a device not named gets a buffer for
        one layer's CPU experts.
    """

    stream_min_tokens: int | None = None
    stream_reserve_bytes: Mapping[str, int] = field(default_factory=dict)


def options_from_plan(plan) -> HybridOptions:
    """The Plan's prefill threshold and per-GPU prefill reserves (no reserve: no streaming)."""
    reserves = {d.engine_device: int(d.bytes_by_class.get("prefill_reserve", 0)) for d in plan.devices if d.kind == "gpu"}
    threshold = plan.prefill_stream_min_tokens if any(reserves.values()) else None
    return HybridOptions(stream_min_tokens=threshold, stream_reserve_bytes=reserves)


class CpuExpertWorker:
    """The one thread that runs CPU experts for the scheduler, in the order it is given them."""

    def __init__(self):
        self._thread = Worker("hybridmoe-cpu-experts")
        close_at_exit(self)

    def submit(self, fn, *args) -> Future:
        # In the submitter's context: how the kernels compute a call's rows is set per call
        # (``native_kernels.rows_are``) in the thread that runs the model.
        return self._thread.submit(contextvars.copy_context().run, _in_inference_mode, fn, *args)

    @property
    def thread(self):
        return self._thread.thread

    def close(self, timeout: float | None = 10.0) -> bool:
        """Cancel the jobs not started; wait at most `timeout` seconds for the running one."""
        return self._thread.close(timeout)


def _in_inference_mode(fn, *args):
    # Inference mode is per thread; the slots are inference tensors written in place here.
    with torch.inference_mode():
        return fn(*args)


class HostSlot:
    """Pinned host buffers for one MoE layer's exchange with the CPU experts."""

    def __init__(self, edge: Edge, rows: int, hidden: int, k: int, x_dtype: torch.dtype, weights_dtype: torch.dtype):
        self.rows, self.hidden, self.k = rows, hidden, k
        self.x_dtype, self.weights_dtype = x_dtype, weights_dtype
        self._x = edge.host_buffer((rows, hidden), x_dtype)
        self._ids = edge.host_buffer((rows, k), torch.int64)
        self._weights = edge.host_buffer((rows, k), weights_dtype)
        self._out = edge.host_buffer((rows, hidden), torch.float32)
        self.x = self.ids = self.weights = self.out = None

    def fits(self, n: int, hidden: int, k: int, x_dtype: torch.dtype, weights_dtype: torch.dtype) -> bool:
        return (n <= self.rows and hidden == self.hidden and k == self.k and x_dtype == self.x_dtype
                and weights_dtype == self.weights_dtype)

    def fill(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Copy a layer's inputs in, without blocking (the caller marks when they are done)."""
        n = x.shape[0]
        self.x, self.ids, self.weights, self.out = self._x[:n], self._ids[:n], self._weights[:n], self._out[:n]
        self.x.copy_(x, non_blocking=True)
        self.ids.copy_(topk_ids, non_blocking=True)
        self.weights.copy_(topk_weights, non_blocking=True)


class HostStaging:
    """Two host slots used by consecutive MoE layers in turn (grown when a call needs more rows)."""

    def __init__(self, edge: Edge):
        self.edge = edge
        self._slots: list[HostSlot | None] = [None, None]
        self._turn = 0

    def take(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> HostSlot:
        i, self._turn = self._turn, 1 - self._turn
        n, hidden = x.shape
        k = topk_ids.shape[1]
        slot = self._slots[i]
        if slot is None or not slot.fits(n, hidden, k, x.dtype, topk_weights.dtype):
            # Replacing a slot frees its pinned memory only after copies queued from it are done
            # (PyTorch's pinned allocator records their streams).
            rows = max(n, slot.rows if slot is not None else 0)
            slot = self._slots[i] = HostSlot(self.edge, rows, hidden, k, x.dtype, topk_weights.dtype)
        slot.fill(x, topk_ids, topk_weights)
        return slot


class HybridScheduler:
    """Runs MoE layers with the CPU experts overlapped with the device, or streamed to it."""

    def __init__(self, options: HybridOptions, streamers: dict[torch.device, ExpertStreamer]):
        self.options = options
        self.worker = CpuExpertWorker()
        self._edges: dict[torch.device, Edge] = {}
        self._staging: HostStaging | None = None
        self.streamers = streamers
        self.calls = {"overlapped": 0, "streamed": 0}  # MoE layer calls by path, for tests and benchmarks

    def edge(self, device: torch.device) -> Edge:
        got = self._edges.get(device)
        if got is None:
            got = self._edges[device] = Edge(device)
        return got

    def forward(self, moe: MoE, x: torch.Tensor) -> torch.Tensor:
        streamer = self.streamers.get(x.device)
        threshold = self.options.stream_min_tokens
        if streamer is not None and threshold is not None and x.shape[0] >= threshold and streamer.covers(moe.layer):
            self.calls["streamed"] += 1
            return self._streamed(moe, x, streamer)
        self.calls["overlapped"] += 1
        return self._overlapped(moe, x)

    def _overlapped(self, moe: MoE, x: torch.Tensor) -> torch.Tensor:
        t = step_profile.clock()
        edge = self.edge(x.device)
        if self._staging is None:
            self._staging = HostStaging(edge)  # host buffers serve every device of a pipeline
        topk_ids, topk_weights = moe.router(x)
        # Only the reference loop over the device's experts needs the ids on the host; the
        # decode kernels and the activation counts read them where they are, so a layer with no
        # CPU experts copies nothing and never waits for the device.
        kernels = bool(len(moe.main)) and decode_kernels_apply(x, moe.main)
        loop = bool(len(moe.main)) and not kernels
        slot = self._staging.take(x, topk_ids, topk_weights) if len(moe.host) or loop else None
        inputs = edge.mark() if slot is not None else None
        inline = x.shape[0] <= INLINE_ROWS
        job = self.worker.submit(_cpu_half, moe, slot, inputs) if len(moe.host) and not inline else None
        t = step_profile.lap("router", t)
        try:
            shared = moe.shared_part(x)
            moe.record(topk_ids)
            main = experts_forward(x, topk_ids, topk_weights, moe.main) if kernels else None
            if loop:
                inputs.wait()
                main = experts_forward(x, topk_ids, topk_weights, moe.main, slot.ids)
            t = step_profile.lap("gpu_experts", t)
            part = None
            if len(moe.host):
                if inline:  # _cpu_half on this thread; the device works through what was issued above
                    inputs.wait()
                    t = step_profile.lap("device_wait", t)
                    slot.out.copy_(moe.cpu_part(slot.x, slot.ids, slot.weights))
                else:
                    job.result()
                t = step_profile.lap("experts", t)  # (with the worker: its time as this thread waits for it)
                part = edge.to_device(slot.out)
        finally:
            if job is not None and not job.done():
                # This thread failed first: let the worker finish with the slot before anyone reuses it.
                with contextlib.suppress(BaseException):  # this thread's own error is the one to raise
                    job.result()
        out = moe.combine(x, main, part, shared)
        step_profile.lap("small", t)
        return out

    def _streamed(self, moe: MoE, x: torch.Tensor, streamer: ExpertStreamer) -> torch.Tensor:
        # Entering first starts the copy of this layer (unless the previous one already did)
        # and of the next; the router and the shared experts then run while it is under way.
        with streamer.layer(moe) as streamed:
            topk_ids, topk_weights = moe.router(x)
            shared = moe.shared_part(x)
            host_ids = topk_ids.cpu()
            moe.record(host_ids)
            main = experts_forward(x, topk_ids, topk_weights, moe.main, host_ids) if len(moe.main) else None
            part = streamed.forward(x, topk_ids, topk_weights, host_ids)
        return moe.combine(x, main, part, shared)

    def close(self, timeout: float | None = 10.0) -> bool:
        """Stop the scheduler's threads (safe to call again). True if they have stopped; a
        thread still finishing a job after `timeout` seconds is a daemon and ends with it."""
        stopped = [streamer.close(timeout) for streamer in self.streamers.values()]
        stopped.append(self.worker.close(timeout))
        return all(stopped)


def _cpu_half(moe: MoE, slot: HostSlot, inputs: Marker) -> None:
    inputs.wait()
    slot.out.copy_(moe.cpu_part(slot.x, slot.ids, slot.weights))


def attach(moes: list[MoE], options: HybridOptions) -> HybridScheduler:
    """Install one scheduler on every MoE block of a model (``moes``, as built); each device of
    a pipeline gets a streamer over its own MoE layers when streaming is on."""
    streamers: dict[torch.device, ExpertStreamer] = {}
    if options.stream_min_tokens is not None:
        by_device: dict[torch.device, list[MoE]] = {}
        for moe in moes:
            by_device.setdefault(moe.main.device, []).append(moe)
        for device, layers in by_device.items():
            reserve = options.stream_reserve_bytes.get(str(device))
            if any(len(m.host) for m in layers) and reserve != 0:
                streamers[device] = ExpertStreamer(Edge(device), layers, reserve)
    scheduler = HybridScheduler(options, streamers)
    for moe in moes:
        moe.scheduler = scheduler
    return scheduler
