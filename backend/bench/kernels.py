"""``hybridmoe bench kernels``: one MoE layer's CPU experts through the native kernels,
against the host memory bandwidth measured in the same run, kt-kernel and the PyTorch
reference path.

The layer is synthetic (random stored blocks, ``synthetic_experts``) with real shapes:
Qwen3-30B-A3B (H 2048, I 768, 128 experts, top-8) and DeepSeek-V3 (H 7168, I 2048, top-8;
256 experts are ~6 GB in q4_0 and ~12 GB in q8_0, so by default 64 of them, still ~50x the
last-level cache: ``--deepseek-experts`` changes it). Every expert is on the CPU.

Routing: T = 1 (decode) walks through the experts, eight new ones per call, so that every
call streams its experts from DRAM as a decode step on a real model does (a layer's
experts were last touched one full forward pass ago); larger T draws random distinct
experts per token. "GB/s" is the stored bytes of the distinct experts a call touched,
divided by its latency (median of the repeats): for decode, what the kernels pull from
memory; the ratio to the host read bandwidth probe (``measure_host_read_bandwidth``, the
number ``hybridmoe doctor`` prints) says how close to memory speed they run. The probe runs
before every measurement, so that on a shared machine it sees the same neighbours: "%BW med"
is the median latency's GB/s over the probes' median, "%BW best" the fastest repeat's over
the fastest probe (like with like). The layer is called the way the engine's decode step
calls it: NumPy views, a preallocated output.

Timed runs are not tests: nothing here runs under pytest.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from hybridmoe.backend.bench.kernel_layer import SEED, make_layer, routing
from hybridmoe.backend.bench.kt_kernel_peer import RESULT_MARK, methods
from hybridmoe.backend.engine import native_experts, native_kernels
from hybridmoe.backend.hardware.cpu import detect_cpu

__all__ = ["SHAPES", "Row", "run", "switch_point", "format_rows"]


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int


SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3-30b-a3b", 2048, 768, 128, 8),
    "deepseek-v3": Shape("deepseek-v3", 7168, 2048, 256, 8),
}
DEFAULT_FORMATS = ("q4_0", "q4_k", "q8_0", "int4_g32")
DEFAULT_TOKENS = (1, 8, 64, 512)


@dataclass
class Row:
    shape: str
    format: str
    tokens: int
    impl: str
    latency_s: float | None  # median of the repeats
    bytes_read: int = 0
    host_bandwidth: float = 0.0  # the probes' median, bytes/s
    host_bandwidth_best: float = 0.0  # the fastest probe
    note: str = ""
    best_s: float | None = None  # the fastest repeat: what the code does when nothing else runs

    @property
    def gbps(self) -> float | None:
        return self.bytes_read / self.latency_s / 1e9 if self.latency_s else None

    @property
    def ratio(self) -> float | None:
        return self.bytes_read / self.latency_s / self.host_bandwidth if self.latency_s and self.host_bandwidth else None

    @property
    def best_ratio(self) -> float | None:
        return self.bytes_read / self.best_s / self.host_bandwidth_best if self.best_s and self.host_bandwidth_best else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.latency_s if self.latency_s else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(gbps=self.gbps, ratio=self.ratio, best_ratio=self.best_ratio, tokens_per_s=self.tokens_per_s)
        return d


def _time(fn: Callable[[int], Any], seconds: float, min_repeats: int, max_repeats: int) -> tuple[float, float]:
    """(median, minimum) wall time of fn(call) over repeats; the first call, a warm-up, is
    not counted."""
    fn(0)
    times = []
    deadline = time.perf_counter() + seconds
    i = 1
    while len(times) < min_repeats or (time.perf_counter() < deadline and len(times) < max_repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
        i += 1
    return float(np.median(times)), float(np.min(times))


def _distinct_bytes(T: int, E: int, k: int, calls: Iterable[int], expert_bytes: int) -> int:
    """Mean stored bytes of the distinct experts a call touches."""
    counts = [len(torch.unique(routing(T, E, k, c)[0])) for c in calls]
    return int(np.mean(counts) * expert_bytes)


def host_bandwidth(threads: int, rounds: int = 3) -> tuple[float, float]:
    """(the app's probe, the native kernels' own probe) in bytes/s: the best of `rounds`
    probes of a few passes each, so that the reference is the machine's, not a busy moment's."""
    from hybridmoe import _native
    from hybridmoe.backend.hardware.bandwidth import measure_host_read_bandwidth

    app = max(measure_host_read_bandwidth(threads=threads, passes=5) for _ in range(rounds))
    native = max(_native.measure_read_bandwidth(1 << 30, 5) for _ in range(rounds))
    return app, native


def _reference(probes: Sequence[float]) -> tuple[float, float]:
    """(median, best) of the bandwidth probes so far."""
    return float(np.median(probes)), max(probes)


def _kt_peer(shape: Shape, E: int, fmt: str, method: str, tokens: Sequence[int], threads: int,
             seconds: float) -> dict[str, Any]:
    spec = dict(E=E, k=shape.top_k, H=shape.hidden, I=shape.inter, format=fmt, method=method, seed=SEED,
                tokens=list(tokens), threads=threads, seconds=seconds, min_repeats=3, max_repeats=50)
    try:
        proc = subprocess.run([sys.executable, "-m", "hybridmoe.backend.bench.kt_kernel_peer", json.dumps(spec)],
                              capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {proc.returncode}: {tail[0][:200]}"}


def run(
    shapes: Sequence[str] = ("qwen3-30b-a3b", "deepseek-v3"),
    formats: Sequence[str] = DEFAULT_FORMATS,
    tokens: Sequence[int] = DEFAULT_TOKENS,
    *,
    threads: int = 0,
    seconds: float = 2.0,
    deepseek_experts: int = 64,
    peers: Sequence[str] = ("kt-kernel", "torch"),
    out: Callable[[str], None] = print,
) -> list[Row]:
    """Time every (shape, format, T) through the native kernels and the peers; returns rows."""
    from hybridmoe import _native

    from hybridmoe.backend.hardware.bandwidth import measure_host_read_bandwidth

    if threads:
        _native.set_num_threads(threads)
    threads = _native.num_threads()
    app_bw, native_bw = host_bandwidth(threads)
    probes = [app_bw]
    out(f"native kernels: {native_kernels.isa()}, {threads} threads; host read bandwidth: "
        f"{app_bw / 1e9:.2f} GB/s (app probe, the ratio's reference), {native_bw / 1e9:.2f} GB/s (native probe)")
    rows: list[Row] = []
    cpu_features = set(detect_cpu()[0].features)  # which of kt-kernel's paths it has here (methods)
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        E = min(shape.experts, deepseek_experts) if shape_name == "deepseek-v3" else shape.experts
        for fmt in formats:
            t0 = time.perf_counter()
            experts = make_layer(fmt, E, shape.hidden, shape.inter)
            native = native_experts.native_for(experts)
            if native is None:
                out(f"{shape_name} {fmt}: not native ({native_experts.unsupported_reason(experts)})")
                continue
            eb = native.expert_bytes
            label = shape_name if E == shape.experts else f"{shape_name} ({E} of {shape.experts} experts)"
            out(f"\n{label}, {fmt}: {E} experts x {eb / 1e6:.1f} MB = {E * eb / 1e9:.2f} GB "
                f"(built in {time.perf_counter() - t0:.0f} s)")
            for T in tokens:
                # The probe again before each measurement: on a shared machine the bandwidth
                # moves from minute to minute, and the ratio compares like with like.
                probes.append(measure_host_read_bandwidth(threads=threads, passes=5))
                x = torch.randn(T, shape.hidden)
                nbytes = _distinct_bytes(T, E, shape.top_k, range(64), eb)

                routes = [routing(T, E, shape.top_k, i) for i in range(64)]
                views = [(ids.numpy(), w.numpy()) for ids, w in routes]
                xn, out_n = x.numpy(), np.empty((T, shape.hidden), np.float32)

                def native_call(i: int) -> None:
                    native.layer.forward(xn, *views[i % len(views)], out_n)

                lat, best = _time(native_call, seconds, 5 if T < 512 else 3, 200)
                rows.append(Row(label, fmt, T, f"hybridmoe ({native_kernels.isa()})", lat, nbytes, *_reference(probes), best_s=best))
                out(format_rows(rows[-1:], header=False))
                # The reference dequantizes every expert it uses on every call (~0.01 GB/s):
                # timed where that takes seconds, not minutes.
                if "torch" in peers and T <= (64 if shape_name != "deepseek-v3" else 1):
                    from hybridmoe.backend.engine.experts import experts_forward

                    def torch_call(i: int) -> None:
                        experts_forward(x, *routes[i % len(routes)], experts)

                    lat, best = _time(torch_call, min(seconds, 1.0), 1, 3)
                    rows.append(Row(label, fmt, T, "pytorch reference", lat, nbytes, *_reference(probes), best_s=best))
                    out(format_rows(rows[-1:], header=False))
            experts = native = None  # free the layer before kt-kernel builds its own copy
            if "kt-kernel" in peers:
                kt_methods = methods(fmt, cpu_features)
                if not kt_methods:
                    out(f"  kt-kernel: no comparable path for {fmt}")
                    continue
                # kt-kernel's caller thread waits in sync() while its pool works, so it is
                # run with the same number of pool threads and, on small machines where
                # that oversubscribes the cores, with one fewer.
                for method in kt_methods:
                    for kt_threads in sorted({threads, max(1, threads - 1)}, reverse=True):
                        res = _kt_peer(shape, E, fmt, method, tokens, kt_threads, seconds)
                        if "error" in res:
                            rows.append(Row(label, fmt, 0, f"kt-kernel {method}, {kt_threads} threads", None,
                                            note=res["error"]))
                            out(f"  kt-kernel {method}: {res['error']}")
                            break
                        for T in tokens:
                            nbytes = _distinct_bytes(T, E, shape.top_k, range(64), eb)
                            rows.append(Row(label, fmt, T, f"kt-kernel {res['method']} [{res['variant']}], "
                                            f"{kt_threads} thr", res["latency"][str(T)], nbytes, *_reference(probes),
                                            best_s=res["best"][str(T)]))
                            out(format_rows(rows[-1:], header=False))
    for r in rows:
        r.host_bandwidth, r.host_bandwidth_best = float(np.median(probes)), max(probes)
    out(f"\nhost read bandwidth over {len(probes)} probes of the run: median {np.median(probes) / 1e9:.2f} GB/s "
        f"(%BW med), best {max(probes) / 1e9:.2f} GB/s (%BW best)")
    return rows


def switch_point(
    formats: Sequence[str] = DEFAULT_FORMATS,
    counts: Sequence[int] = (1, 4, 8, 16, 24, 32, 48, 64),
    *,
    threads: int = 0,
    repeats: int = 6,
    out: Callable[[str], None] = print,
) -> dict[str, dict[str, list[float]]]:
    """CPU time per expert of the decode and the prefill regime, forced, when each expert of
    a call gets n tokens (Qwen3-30B-A3B expert shapes, 64 experts of which each call uses
    eight new ones). Where prefill becomes cheaper is the switch point (moe_layer.cpp).

    Process CPU time, best of `repeats`: on a shared machine wall time mostly measures the
    neighbours, while the CPU time the two regimes need for the same work compares them."""
    from hybridmoe import _native

    if threads:
        _native.set_num_threads(threads)
    shape = SHAPES["qwen3-30b-a3b"]
    E, k = 64, 8
    result: dict[str, dict[str, list[float]]] = {}
    out(f"CPU ms per expert by tokens per expert ({native_kernels.isa()}, {_native.num_threads()} threads)")
    out("format   regime   " + " ".join(f"{n:>6}" for n in counts))
    for fmt in formats:
        native = native_experts.native_for(make_layer(fmt, E, shape.hidden, shape.inter))
        result[fmt] = {}
        for regime in ("decode", "prefill"):
            per = []
            for n in counts:
                x = torch.randn(n, shape.hidden)
                w = torch.full((n, k), 1.0 / k)
                best = math.inf
                for i in range(repeats + 1):
                    ids = ((torch.arange(k) + k * i) % E).repeat(n, 1)
                    c0 = time.process_time()
                    native.forward(x, ids, w, regime=regime)
                    if i:  # the first call warms up
                        best = min(best, time.process_time() - c0)
                per.append(best / k * 1e3)
            result[fmt][regime] = per
            out(f"{fmt:<8} {regime:<8} " + " ".join(f"{v:6.2f}" for v in per))
        cross = next((n for n, d, p in zip(counts, result[fmt]["decode"], result[fmt]["prefill"]) if p < d), None)
        out(f"{fmt:<8} prefill cheaper from {cross if cross else '>' + str(counts[-1])} tokens per expert")
    return result


def format_rows(rows: Sequence[Row], header: bool = True) -> str:
    """ms: median and fastest repeat; tok/s and GB/s from the median; % of host BW: the
    median's share of the probes' median, the fastest repeat's of the fastest probe."""
    lines = []
    if header:
        lines.append(f"{'shape':<32} {'format':<9} {'T':>4}  {'implementation':<44} {'ms med':>9} {'ms best':>9} "
                     f"{'tok/s':>8} {'GB/s':>6} {'%BW med':>7} {'%BW best':>8}")
    for r in rows:
        if r.latency_s is None:
            lines.append(f"{r.shape:<32} {r.format:<9} {'':>4}  {r.impl:<44} {r.note}")
            continue
        ratio = f"{100 * r.ratio:6.0f}%" if r.ratio is not None else ""
        best_ratio = f"{100 * r.best_ratio:7.0f}%" if r.best_ratio is not None else ""
        best = f"{1e3 * r.best_s:9.2f}" if r.best_s else ""
        lines.append(f"{r.shape:<32} {r.format:<9} {r.tokens:>4}  {r.impl[:44]:<44} {1e3 * r.latency_s:9.2f} {best:>9} "
                     f"{r.tokens_per_s:8.1f} {r.gbps:6.2f} {ratio:>7} {best_ratio:>8}")
    return "\n".join(lines)


def main(args) -> int:
    """The CLI's `bench kernels` (arguments parsed in app/cli.py)."""
    if not native_kernels.available():
        print(f"hybridmoe: the native kernels are not built: {native_kernels.isa()}", file=sys.stderr)
        return 1
    tokens = tuple(args.tokens) if args.tokens else DEFAULT_TOKENS
    formats = tuple(args.formats) if args.formats else DEFAULT_FORMATS
    if args.switch:
        res = switch_point(formats, threads=args.threads or 0)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    peers = tuple(p for p in ("kt-kernel", "torch") if p not in (args.no_peer or ()))
    rows = run(tuple(args.shapes) if args.shapes else tuple(SHAPES), formats, tokens, threads=args.threads or 0,
               seconds=args.seconds, deepseek_experts=args.deepseek_experts, peers=peers)
    print("\n" + format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in rows], f, indent=1)
    return 0
