"""One token through the decode GEMV of each stored format, cold, against the bandwidth probe.

A decode step reads each weight once, from DRAM: a kernel that is fast on weights in cache can
still leave bandwidth unused when they are not (too short a prefetch distance, or prefetches
bunched where they hold the loads back). Per round this takes one probe pass and then, formats
in turn (the order reversed every other round), one call over each of a set of matrices of
about 120 MB per format, so that nothing of it is in the caches when it is read again; the
figure per format is the median over rounds of its GB/s over the probe of its round.

    python benchmarks/dense_gemv_cold.py --formats f32 bf16 q8_0 q6_k q4_0 q4_k --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hybridmoe.backend.bench.synthetic_experts import random_matrix
from hybridmoe.backend.engine.native_kernels import _native
from hybridmoe.backend.engine.native_linear import NativeLinear

FORMATS = ("f32", "bf16", "f16", "q8_0", "q6_k", "q5_k", "q5_0", "q4_0", "q4_k", "mxfp4")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["f32", "bf16", "q8_0", "q6_k", "q4_0", "q4_k"],
                   choices=FORMATS)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0, help="default: one per physical core")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--megabytes", type=int, default=120, help="per format (default 120: far above an L3)")
    a = p.parse_args()
    if _native is None:
        raise SystemExit("the native extension is not built")
    if a.threads:
        _native.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    mats = {}
    for f in a.formats:
        mats[f] = [NativeLinear(random_matrix(rng, f, (a.rows, a.cols)))]
        n = max(2, int(a.megabytes * 1e6 / mats[f][0].native.bytes))  # the stored bytes say how many
        mats[f] += [NativeLinear(random_matrix(rng, f, (a.rows, a.cols))) for _ in range(n - 1)]
    x = rng.standard_normal((1, a.cols)).astype(np.float32)
    out = np.empty((1, a.rows), np.float32)

    def rate(lins: list[NativeLinear]) -> float:
        t0 = time.perf_counter()
        for lin in lins:
            lin.native.forward(x, out, 1 << 30)  # the one-token GEMV at any count
        return sum(lin.native.bytes for lin in lins) / (time.perf_counter() - t0)

    for lins in mats.values():  # first touch and warm-up of the code paths
        rate(lins)
    probes, rates = [], {f: [] for f in a.formats}
    for r in range(a.rounds):
        probes.append(_native.measure_read_bandwidth(256 << 20, 1))
        for f in a.formats if r % 2 == 0 else a.formats[::-1]:
            rates[f].append(rate(mats[f]))
    print(f"{_native.isa()}, {_native.num_threads()} threads, {a.rows} x {a.cols}, {a.rounds} rounds; "
          f"probe median {statistics.median(probes) / 1e9:.1f} GB/s")
    print(f"{'format':8} {'as read':9} {'GB/s':>6} {'of the probe':>13}")
    for f in a.formats:
        ratio = statistics.median(v / pr for v, pr in zip(rates[f], probes))
        print(f"{f:8} {mats[f][0].native.format:9} {statistics.median(rates[f]) / 1e9:6.1f} {ratio:13.2f}")


if __name__ == "__main__":
    main()
