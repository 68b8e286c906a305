"""The expert weights one core of the engine's CPU kernels decodes per second in a decode step,
per format: what plan.expected's EXPERT_UNPACK_RATES_PER_CORE documents for the kernel set in
use (docs/sizing.md §6, "Expected speed"; HYBRIDMOE_NATIVE_ISA=avx2 measures the AVX2 set's).

A layer of the mid-size benchmark model's shape (128 experts of 2048 x 768, top 8; random valid
blocks of each format) decodes one token at a time, each call routed to 8 experts at random;
one thread, its CPU time, so that a shared machine's neighbours do not enter the figure (bench
generate's wall-clock experts' part does, and a loaded machine halved it). The weights a token
touches (8 x 3 x 2048 x 768) over the median CPU time of a call.

    python benchmarks/expert_decode_rates.py [--formats iq2_xxs q4_0] [--calls 400]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridmoe import _native
from hybridmoe.backend.bench.kernel_layer import make_layer, routing
from hybridmoe.backend.engine import native_experts, native_kernels
from hybridmoe.backend.plan.expected import EXPERT_UNPACK_RATES_PER_CORE

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=[*EXPERT_UNPACK_RATES_PER_CORE["avx512"], "iq4_xs", "q4_0"])
    p.add_argument("--calls", type=int, default=400)
    args = p.parse_args()
    _native.set_num_threads(1)
    torch.set_num_threads(1)
    weights = TOP_K * 3 * HIDDEN * INTER
    print(f"{native_kernels.isa()}, 1 thread, one token a call, {EXPERTS} experts of {HIDDEN} x {INTER}, top {TOP_K}: "
          f"median CPU time of {args.calls} calls")
    # The extension's set names: avx512_vnni / avx512_amx decode with the AVX-512 set's kernels.
    documented_rates = EXPERT_UNPACK_RATES_PER_CORE.get("avx512" if native_kernels.isa().startswith("avx512")
                                                        else native_kernels.isa(), {})
    x = torch.randn(1, HIDDEN)
    for fmt in args.formats:
        layer = native_experts.native_for(make_layer(fmt, EXPERTS, HIDDEN, INTER))
        seconds = []
        for call in range(args.calls + 8):
            ids, w = routing(1, EXPERTS, TOP_K, call)
            start = time.process_time()
            layer.forward(x, ids, w, regime="decode")
            if call >= 8:  # the first calls warm up
                seconds.append(time.process_time() - start)
        median = statistics.median(seconds)
        documented = documented_rates.get(fmt)
        note = f"  (documented {documented / 1e9:.1f})" if documented else ""
        print(f"{fmt:<8} {median * 1e3:6.3f} ms a token  {weights / median / 1e9:5.1f} G weights/s a core{note}")


if __name__ == "__main__":
    main()
