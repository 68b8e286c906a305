"""The hybrid scheduler with the CPU standing in for the GPU: the real threads, host slots,
markers and streaming ring run (device="cpu", asked for explicitly), and the logits are the
CPU-only path's: bit for bit where the same kernels read the same memory (the overlapped
path), within float32 rounding where streamed experts are read from the device buffer (BLAS
results depend on the alignment of the matrices, which the copy changes)."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch

from hybridmoe.backend.engine.expert_streaming import ALIGN, SlotLayout
from hybridmoe.backend.engine.hybrid import HybridOptions
from hybridmoe.backend.engine.moe import MoE
from tests.engine.conftest import FAMILY_NAMES, engine, relative_error, tokens


def _moe_layers(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _run(model, ids: torch.Tensor, prefill: int, chunk: int | None = None) -> torch.Tensor:
    """Logits of a prefill (in chunks of `chunk` tokens) and then one token per call."""
    chunk = chunk or prefill
    steps = [model(ids[:, p : min(p + chunk, prefill)], p) for p in range(0, prefill, chunk)]
    steps += [model(ids[:, t : t + 1], t) for t in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1)


def _layer_path(path, **kwargs):
    """The synchronous reference without a scheduler, one token at a time through the layers
    (the native one-token path of ``cpu_decode`` computes in float32 throughout instead, so
    it is not bit-comparable with the scheduler's layer-by-layer arithmetic)."""
    model = engine(path, **kwargs)
    model.native_decode = False
    return model


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal up to float32 summation order: what moving a matrix to other memory may change."""
    return relative_error(got, expected) < 1e-6


def _placements(model) -> dict[str, dict[int, list[int]]]:
    layers = [m.layer for m in _moe_layers(model)]
    return {
        "all_cpu": {},
        # Different per layer; the first MoE layer keeps all its experts on the CPU.
        "mixed": {layer: list(range(i % 2, 8, 2 + i)) for i, layer in enumerate(layers[1:])},
        "all_main": {layer: list(range(8)) for layer in layers},
    }


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_overlapped_decode_equals_the_cpu_only_path(family, checkpoints):
    """CPU experts on the worker thread through the host slots, main-device experts and shared
    experts meanwhile: the same logits as the plain synchronous path, exactly."""
    path = checkpoints(family)
    ids = tokens(16, seed=11)
    for name, placement in _placements(engine(path)).items():
        expected = _run(_layer_path(path, placement=placement), ids, prefill=10)
        model = engine(path, placement=placement, hybrid=HybridOptions())
        assert model.scheduler is not None
        got = _run(model, ids, prefill=10)
        assert torch.equal(got, expected), name
        n_moe = len(_moe_layers(model))
        assert model.scheduler.calls == {"overlapped": 7 * n_moe, "streamed": 0}, name


def test_the_cpu_half_of_long_calls_runs_on_the_worker_thread(checkpoints):
    """Calls of more than INLINE_ROWS rows hand the CPU half to the worker; decode-sized
    calls run it on the calling thread (no hand-over to wait for)."""
    from hybridmoe.backend.engine.hybrid import INLINE_ROWS

    model = engine(checkpoints("qwen3_moe"), hybrid=HybridOptions())
    moe = _moe_layers(model)[0]
    seen = []
    cpu_part = moe.cpu_part

    def spy(*args):
        seen.append((args[0].shape[0], threading.current_thread().name))
        return cpu_part(*args)

    moe.cpu_part = spy
    model(tokens(INLINE_ROWS + 1), 0)
    model(tokens(1), INLINE_ROWS + 1)
    model(tokens(INLINE_ROWS), INLINE_ROWS + 2)
    assert [(n, name.startswith("hybridmoe-cpu-experts")) for n, name in seen] == [
        (INLINE_ROWS + 1, True), (1, False), (INLINE_ROWS, False)]
    assert seen[1][1] == threading.current_thread().name
    # A CPU-only model without options has no scheduler: nothing runs on another thread.
    plain = engine(checkpoints("qwen3_moe"))
    assert plain.scheduler is None and all(m.scheduler is None for m in _moe_layers(plain))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_streamed_prefill_equals_the_cpu_only_path(family, checkpoints):
    """Prompts at the threshold copy each layer's CPU experts as stored into the reserved
    buffer (on a copier thread) and run the layer there; decode steps stay overlapped."""
    path = checkpoints(family)
    ids = tokens(20, seed=3)
    for name, placement in _placements(engine(path)).items():
        expected = _run(_layer_path(path, placement=placement), ids, prefill=16, chunk=8)
        model = engine(path, placement=placement, hybrid=HybridOptions(stream_min_tokens=8))
        got = _run(model, ids, prefill=16, chunk=8)
        assert _close(got, expected), name
        streamed_layers = [m for m in _moe_layers(model) if len(m.host)]
        assert model.scheduler.calls["streamed"] == 2 * len(streamed_layers), name
        streamers = list(model.scheduler.streamers.values())
        if not streamed_layers:
            assert streamers == [], name  # every expert on the main device: nothing to stream
            continue
        (streamer,) = streamers
        per_layer = [len(m.host) * SlotLayout(m.host.store.stored(m.host.ids[0])).nbytes for m in streamed_layers]
        assert streamer.bytes_copied == 2 * sum(per_layer), name


def test_slot_layout_round_trips_every_stored_form(checkpoints):
    """Plain tensors and quant objects (parts with their own dtypes) come back as equal views,
    each part at an aligned offset."""
    from hybridmoe.backend.formats.quant import QuantTensor

    model = engine(checkpoints("qwen3_moe"))
    stored = _moe_layers(model)[0].host.store.stored(3)
    packed = torch.tensor([[1, -2, 3, 4]], dtype=torch.int32)
    quant = QuantTensor("int4_g32", "hf", (1, 32), {"weight_packed": packed,
                                                      "weight_scale": torch.tensor([[0.5]], dtype=torch.bfloat16)})
    stored = dict(stored, up=quant)
    layout = SlotLayout(stored)
    assert all(leaf.offset % ALIGN == 0 for leaf in layout.leaves)
    slot = torch.zeros(layout.nbytes, dtype=torch.uint8)
    layout.pack(stored, slot)
    back = layout.unpack(slot)
    assert torch.equal(back["gate"], stored["gate"]) and torch.equal(back["down"], stored["down"])
    assert isinstance(back["up"], QuantTensor) and back["up"].format == "int4_g32"
    assert torch.equal(back["up"].parts["weight_packed"], packed)
    assert back["up"].parts["weight_scale"].dtype == torch.bfloat16
    assert back["gate"].data_ptr() == slot.data_ptr() + layout.leaves[0].offset  # views, not copies
    with pytest.raises(ValueError, match="first expert"):
        layout.pack(dict(stored, gate=stored["gate"][:-1]), slot)


@pytest.mark.timeout(60)
def test_a_ring_of_one_layer_overlaps_without_deadlock(checkpoints):
    """With room for exactly one layer's CPU experts, the copy of layer n+1 takes each slot as
    layer n's expert in it is done; with less, a layer that does not fit stays on the CPU."""
    path = checkpoints("deepseek_v2")
    ids = tokens(28, seed=5)
    placement = {2: [0, 1, 2]}  # layer 1: 8 CPU experts, layer 2: 5
    expected = _run(_layer_path(path, placement=placement), ids, prefill=24, chunk=8)
    probe = engine(path, placement=placement)
    moe1 = _moe_layers(probe)[0]
    slot = SlotLayout(moe1.host.store.stored(0)).nbytes
    for slots, skipped in ((8, []), (6, [1])):
        model = engine(path, placement=placement,
                       hybrid=HybridOptions(stream_min_tokens=8, stream_reserve_bytes={"cpu": slots * slot}))
        got = _run(model, ids, prefill=24, chunk=8)
        assert _close(got, expected), slots
        (streamer,) = model.scheduler.streamers.values()
        assert streamer.n_slots == slots
        assert sorted(streamer.skipped) == skipped
        assert model.scheduler.calls["streamed"] == 3 * (2 - len(skipped))


@pytest.mark.timeout(60)
def test_a_forward_call_that_fails_midway_leaves_the_ring_usable(checkpoints):
    """A failure after layer n prefetched layer n+1 must not leave the copier waiting for
    slots nobody releases: the next long prompt streams and is right."""
    path = checkpoints("qwen2_moe")
    ids = tokens(16, seed=9)
    expected = _run(_layer_path(path), ids, prefill=16, chunk=8)
    # The ring holds one layer: the slots of a prefetched layer nobody uses are all there is.
    model = engine(path, hybrid=HybridOptions(stream_min_tokens=8))
    first = _moe_layers(model)[0]
    real = first.router.forward

    def broken(x):
        raise RuntimeError("simulated failure")

    first.router.forward = broken  # fails after entering layer 0, which prefetched layer 1
    for _ in range(2):
        with pytest.raises(RuntimeError, match="simulated"):
            model(ids[:, :8], 0)
    first.router.forward = real
    assert _close(_run(model, ids, prefill=16, chunk=8), expected)


def test_native_cpu_experts_in_the_scheduler(checkpoints, monkeypatch):
    """With the native kernels, the worker runs the same native call as the plain path (exact);
    streamed layers run the PyTorch arithmetic on the device (close)."""
    from hybridmoe.backend.engine import native_kernels

    if not native_kernels.available():
        pytest.skip("native extension not built")
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "1")
    path = checkpoints("qwen3_moe")
    ids = tokens(20, seed=4)
    placement = {2: [1, 5]}
    expected = _run(_layer_path(path, placement=placement), ids, prefill=16, chunk=8)
    overlapped = engine(path, placement=placement, hybrid=HybridOptions())
    assert torch.equal(_run(overlapped, ids, prefill=16, chunk=8), expected)
    streamed = engine(path, placement=placement, hybrid=HybridOptions(stream_min_tokens=8))
    assert relative_error(_run(streamed, ids, prefill=16, chunk=8), expected) < 1e-4
    assert streamed.scheduler.calls["streamed"] > 0


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_pipeline_stages_move_hidden_states_at_the_boundaries(family, checkpoints):
    """Layers split into stages (all on the CPU here): each stage's layers are built on its
    device, hidden states cross at the boundary, and nothing else changes."""
    path = checkpoints(family)
    ids = tokens(20, seed=6)
    expected = _run(_layer_path(path, placement={1: [0, 3]}), ids, prefill=16, chunk=8)
    stages = [("cpu", (0, 1)), ("cpu", (2,))]
    plain = engine(path, placement={1: [0, 3]}, pipeline=stages)
    assert plain.boundaries == {2: torch.device("cpu")}
    assert plain.scheduler is None
    assert torch.equal(_run(plain, ids, prefill=16, chunk=8), expected)
    hybrid = engine(path, placement={1: [0, 3]}, pipeline=stages, hybrid=HybridOptions(stream_min_tokens=8))
    assert _close(_run(hybrid, ids, prefill=16, chunk=8), expected)
    for bad, message in (([("cpu", (0,)), ("cpu", (2,))], "no stage"),
                         ([("cpu", (2,)), ("cpu", (0, 1))], "consecutive"),
                         ([("cpu", (0, 1, 2)), ("cpu", (2,))], "two stages")):
        with pytest.raises(ValueError, match=message):
            engine(path, pipeline=bad)


class _FakeEvent:
    """Stands in for torch.cuda.Event (the GPU edge): remembers what recorded and synchronized it."""

    log: ClassVar[list] = []

    def record(self, stream):
        self.log.append(("record", stream))

    def synchronize(self):
        self.log.append(("synchronize", self))


class _FakeStream:
    def __init__(self, name):
        self.name, self.waited = name, []

    def wait_event(self, event):
        self.waited.append(event)


@pytest.mark.timeout(30)
def test_markers_order_streams_only_after_they_are_issued(monkeypatch):
    """A marker handed to another thread before its work is issued makes that thread wait
    until it is (a CUDA event waited on before it is recorded would let it through), then
    orders the waiting stream after the recorded event; an issuing thread's error reaches
    the waiter."""
    from hybridmoe.backend.engine.streams import Marker

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.log = []
    copy, compute = _FakeStream("copy"), _FakeStream("compute")
    marker = Marker()
    ordered = threading.Event()

    def waiter():
        marker.order(compute)
        ordered.set()

    t = threading.Thread(target=waiter)
    t.start()
    assert not ordered.wait(0.2)  # not issued yet: the compute stream is not told to wait on anything
    assert compute.waited == []
    marker.issue(copy)
    t.join(5)
    assert ordered.is_set()
    (event,) = compute.waited
    assert _FakeEvent.log == [("record", copy)] and isinstance(event, _FakeEvent)
    marker.wait()
    assert _FakeEvent.log[-1] == ("synchronize", event)

    failed = Marker()
    failed.fail(RuntimeError("copy failed"))
    with pytest.raises(RuntimeError, match="copy failed"):
        failed.order(compute)
    with pytest.raises(RuntimeError, match="copy failed"):
        failed.wait()


def test_the_cpu_stand_in_copies_back_into_memory_of_its_own():
    from hybridmoe.backend.engine.streams import Edge

    edge = Edge("cpu")
    host = edge.host_buffer((2, 3), torch.float32)
    assert not host.is_pinned()
    host.fill_(1.0)
    back = edge.to_device(host)
    host.fill_(2.0)  # the slot is reused two layers later: the result must not change with it
    assert torch.equal(back, torch.ones(2, 3))
    assert edge.mark().issued and edge.current_stream() is None


# --- failure, abandonment, closing and exit ------------------------------------------------


def _streaming(path):
    model = engine(path, hybrid=HybridOptions(stream_min_tokens=8))
    (streamer,) = model.scheduler.streamers.values()
    return model, streamer, _moe_layers(model)


@pytest.mark.timeout(60)
def test_a_layer_left_open_is_given_up_by_the_next_call(checkpoints):
    """A forward call interrupted between taking a layer and entering its `with` block (or
    inside it, past the point where an error would leave it) never releases its slots, and
    the layer it prefetched waits for them: the next call gives them up and streams."""
    path = checkpoints("qwen2_moe")
    ids = tokens(16, seed=9)
    expected = _run(_layer_path(path), ids, prefill=16, chunk=8)
    model, streamer, moes = _streaming(path)
    streamer.layer(moes[0])  # never left
    assert _close(_run(model, ids, prefill=16, chunk=8), expected)
    assert model.scheduler.calls["streamed"] == 2 * len(moes)


@pytest.mark.timeout(60)
def test_a_layer_call_that_fails_midway_gives_up_what_it_started(checkpoints, monkeypatch):
    """The copy of layer n is queued, the prefetch of n+1 cannot be: neither is left owing
    slots (n is nobody's to leave, and the slots n+1 took would never be released)."""
    path = checkpoints("qwen2_moe")
    ids = tokens(16, seed=9)
    expected = _run(_layer_path(path), ids, prefill=16, chunk=8)
    model, streamer, moes = _streaming(path)
    submit, calls = streamer._copier.submit, []

    def flaky(fn, *args):
        calls.append(fn)
        if len(calls) == 2:
            raise RuntimeError("cannot queue")
        return submit(fn, *args)

    monkeypatch.setattr(streamer._copier, "submit", flaky)
    with pytest.raises(RuntimeError, match="cannot queue"):
        model(ids[:, :8], 0)
    monkeypatch.undo()
    assert streamer._open == [] and streamer.covers(moes[0].layer)
    assert _close(_run(model, ids, prefill=16, chunk=8), expected)


@pytest.mark.timeout(60)
def test_closing_wakes_every_wait_and_stops_the_threads(checkpoints, monkeypatch):
    """With the copier waiting for slots a layer left open will never release, close() fails
    the markers still owed, so the waits end and both threads (daemons) stop at once."""
    from hybridmoe.backend.engine import hybrid

    monkeypatch.setattr(hybrid, "INLINE_ROWS", 0)  # short calls use the worker too
    model, streamer, moes = _streaming(checkpoints("qwen2_moe"))
    model(tokens(4), 0)  # a short prompt: the CPU-expert worker runs
    streamer.layer(moes[0])  # never left: the prefetched layer's copies wait for its slots
    prefetched = streamer._pending[moes[1].layer]
    waiting = next(iter(prefetched._copies.values())).filled
    assert not waiting.issued
    threads = [streamer._copier.thread, model.scheduler.worker.thread]
    assert all(t is not None and t.daemon for t in threads)
    assert model.scheduler.close(timeout=60)  # the timeout only bounds a failing test
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="closed"):
        waiting.wait()
    assert not streamer.covers(moes[0].layer)
    with pytest.raises(RuntimeError, match="closed"):
        model(tokens(8), 0)
    assert model.scheduler.close()  # again: nothing to do


@pytest.mark.timeout(60)
def test_a_scheduler_nobody_closed_stops_its_threads_when_collected(checkpoints, monkeypatch):
    import gc

    from hybridmoe.backend.engine import hybrid

    monkeypatch.setattr(hybrid, "INLINE_ROWS", 0)  # short calls use the worker too
    ids = tokens(16, seed=9)
    model, streamer, moes = _streaming(checkpoints("qwen2_moe"))
    _run(model, ids[:, :12], prefill=8)  # streamed, then overlapped: both threads started
    threads = [streamer._copier.thread, model.scheduler.worker.thread]
    assert all(t is not None and t.is_alive() for t in threads)
    del model, streamer, moes
    gc.collect()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_a_marker_is_settled_once():
    from hybridmoe.backend.engine.streams import Marker

    issued = Marker().issue()
    issued.fail(RuntimeError("too late"))
    issued.wait()  # still issued: the waiter goes on
    assert not issued.failed
    failed = Marker()
    failed.fail(RuntimeError("first"))
    failed.issue()
    assert failed.failed
    with pytest.raises(RuntimeError, match="first"):
        failed.wait()


_UNCLOSED = """
import sys, time
from pathlib import Path
import torch
from hybridmoe.backend.engine import hybrid
from hybridmoe.backend.engine.hybrid import HybridOptions
from hybridmoe.backend.engine.moe import MoE
from tests.engine.conftest import engine, tokens

torch.set_num_threads(1)
hybrid.INLINE_ROWS = 0  # short calls use the worker too
model = engine(Path(sys.argv[1]), hybrid=HybridOptions(stream_min_tokens=8))
(streamer,) = model.scheduler.streamers.values()
moes = [m for m in model.modules() if isinstance(m, MoE)]
real = moes[0].router.forward

def broken(x):
    raise RuntimeError("simulated failure")

moes[0].router.forward = broken
try:
    model(tokens(8), 0)  # fails after layer 0 prefetched layer 1
except RuntimeError:
    pass
moes[0].router.forward = real
model(tokens(4), 0)  # the CPU-expert worker runs
streamer.layer(moes[0])  # left open, as by an interrupt: layer 1's copy waits for its slots
waiting = next(iter(streamer._pending[moes[1].layer]._copies.values())).filled
time.sleep(0.3)
assert not waiting.issued, "the copier should be waiting"
print("exiting", flush=True)
"""


@pytest.mark.timeout(300)
def test_a_process_with_an_unclosed_scheduler_exits(checkpoints, tmp_path):
    """A session nobody closed, its copier waiting for slots a failed forward call left and its
    CPU-expert worker idle: the interpreter still exits (no thread of the scheduler is joined
    at exit, and the waits are failed there)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    errors = tmp_path / "stderr.txt"
    with errors.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", _UNCLOSED, str(checkpoints("qwen2_moe"))], cwd=root,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            line = proc.stdout.readline()  # the script's own work (imports, build) takes what it takes
            try:
                proc.wait(timeout=120)  # only bounds a failing test
            except subprocess.TimeoutExpired:
                pytest.fail(f"the process did not exit:\n{errors.read_text()}")
            assert line.strip() == "exiting", errors.read_text()
            assert proc.returncode == 0, errors.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


def test_a_recorded_decode_step_shows_the_moe_layers_host_parts(checkpoints):
    """``step_profile`` records the host's time in a hybrid MoE layer's parts (what the GPU
    check prints for a decode step bound by the host)."""
    from hybridmoe.backend.engine import step_profile

    model = engine(checkpoints("qwen3_moe"), placement={1: [0, 2, 3, 5]}, hybrid=HybridOptions())
    model(tokens(4), 0)
    with step_profile.recording() as recorded:
        model(tokens(1), 4)
    parts = {p for p, s in recorded.seconds.items() if s > 0}
    assert {"router", "gpu_experts", "device_wait", "experts", "small"} <= parts, parts
