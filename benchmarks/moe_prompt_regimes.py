"""One CPU MoE layer's prompt in each of the native kernels' regimes, one thread's CPU time.

A DeepSeek-V3-like layer of the mid-size benchmark (128 experts of 2048 x 768, top 8; random
valid blocks of each format, random routing) computes a prompt of `--tokens` tokens as a
prompt chunk ("prompt": each format's own path, see native prompt_takes_gemv), on the GEMV
("decode", the many-token form for the i-quants) and on dequantized panels and the GEMM
("prefill"); best of `--repeats`. CPU time of one thread, so that a shared machine's
neighbours do not enter the figure; bf16 activations, as the engine gives them. Run it with
two builds of the extension (or two kernel sets: HYBRIDMOE_NATIVE_ISA=avx512_vnni) to compare
them: the i-quants' many-token GEMV took IQ2_XXS 551 -> 377 ms and IQ3_XXS 596 -> 405 ms here
(Xeon with AVX-512, 512 tokens); with AMX their prompts on bf16 tiles, IQ2_XXS 339 -> 250 ms,
IQ2_S 373 -> 219 ms, until the GEMVs below overtook the tiles (Sapphire Rapids-class Xeon,
tiles / GEMV: IQ2_XXS 251 / 195 ms, IQ2_S 259 / 214, IQ4_XS 229 / 160), which were removed. On Zen 4 (AVX-512 VNNI, no AMX; a busy 2-core VM, medians of three
runs), the GEMM micro-kernel that replaced the many-token GEMV's token-at-a-time loop took the
prompt column IQ2_XXS 368 -> 271 ms, IQ3_XXS 454 -> 291, IQ2_S 406 -> 291, IQ3_S 373 -> 309,
IQ1_S 322 -> 317 (both paths in one process in turn, two runs: 1.13-1.37x each).

    python benchmarks/moe_prompt_regimes.py [--formats iq2_xxs iq3_xxs] [--tokens 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridmoe import _native
from hybridmoe.backend.bench.kernel_layer import make_layer, routing
from hybridmoe.backend.engine import native_experts, native_kernels

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["iq2_xxs", "iq3_xxs"])
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    _native.set_num_threads(1)
    print(f"{native_kernels.isa()}, 1 thread, {args.tokens} tokens, {EXPERTS} experts of {HIDDEN} x {INTER}, "
          f"top {TOP_K}: CPU ms, best of {args.repeats}")
    x = torch.randn(args.tokens, HIDDEN).bfloat16()  # the engine's activations
    for fmt in args.formats:
        layer = native_experts.native_for(make_layer(fmt, EXPERTS, HIDDEN, INTER))
        cells = []
        for regime in ("prompt", "decode", "prefill"):
            best = float("inf")
            for call in range(args.repeats + 1):
                ids, weights = routing(args.tokens, EXPERTS, TOP_K, call)
                start = time.process_time()
                layer.forward(x, ids, weights, regime=regime)
                if call:  # the first call warms up
                    best = min(best, time.process_time() - start)
            cells.append(f"{regime} {best * 1e3:.0f}")
        print(f"{fmt:<8} " + "   ".join(cells))


if __name__ == "__main__":
    main()
