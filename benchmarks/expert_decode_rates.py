"""The expert weights one core of the engine's CPU kernels decodes per second in a decode step,
per format: what plan.expected's EXPERT_UNPACK_RATES_PER_CORE documents for the kernel set in
use (docs/sizing.md §6, "Expected speed"; HYBRIDMOE_NATIVE_ISA=avx2 measures the AVX2 set's).

A layer of the mid-size benchmark model's shape (128 experts of 2048 x 768, top 8; random valid
blocks of each format) decodes one token at a time, each call routed to 8 experts at random;
one thread, its CPU time, so that a shared machine's neighbours do not enter the figure (bench
generate's wall-clock experts' part does, and a loaded machine halved it). The weights a token
touches (8 x 3 x 2048 x 768) over the median CPU time of a call.

--llama-cpp times llama.cpp's CPU kernels on the very same bytes and routing, alternating
call by call with the engine's: ggml's mul_mat_id (what llama.cpp's MoE layers run) for the
gate, up and down projections of one token, one thread, through the ggml libraries that
llama-cpp-python ships (ctypes; its build's kernel set, native to the machine it was built
on; --ggml-lib DIR takes another build's libggml-base.so and libggml-cpu.so, say one made
with -DGGML_NATIVE=OFF -DGGML_AVX2=ON to set llama.cpp's AVX2 kernels beside
HYBRIDMOE_NATIVE_ISA=avx2). Both sides leave out the activation between the projections (the
engine's layer computes it, a few microseconds).

    python benchmarks/expert_decode_rates.py [--formats iq2_xxs q4_0] [--calls 400] [--llama-cpp [--ggml-lib DIR]]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from hybridmoe import _native
from hybridmoe.backend.bench.kernel_layer import SEED, make_layer, routing
from hybridmoe.backend.engine import native_experts, native_kernels
from hybridmoe.backend.plan.expected import EXPERT_UNPACK_RATES_PER_CORE

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


class GgmlMoe:
    """One MoE layer's three projections as ggml mul_mat_id nodes over the layer's own bytes."""

    class _InitParams(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]

    def __init__(self, merged: dict, fmt: str, lib_dir: Path | None = None):
        if lib_dir is None:
            import llama_cpp

            lib_dir = Path(llama_cpp.__file__).parent / "lib"
        base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        base.ggml_init.restype = P
        base.ggml_init.argtypes = [self._InitParams]
        for name, args in (("ggml_new_tensor_2d", [P, ctypes.c_int, I64, I64]),
                           ("ggml_new_tensor_3d", [P, ctypes.c_int, I64, I64, I64]),
                           ("ggml_mul_mat_id", [P, P, P, P]), ("ggml_new_graph", [P]), ("ggml_get_data", [P])):
            getattr(base, name).restype = P
            getattr(base, name).argtypes = args
        base.ggml_nbytes.restype = ctypes.c_size_t
        base.ggml_nbytes.argtypes = [P]
        base.ggml_build_forward_expand.argtypes = [P, P]
        base.ggml_free.argtypes = [P]
        cpu.ggml_graph_compute_with_ctx.argtypes = [P, P, ctypes.c_int]
        cpu.ggml_cpu_init()
        self.base, self.cpu = base, cpu
        weight_bytes = sum(merged[k].parts["data"].numel() for k in ("gate", "up", "down"))
        self.ctx = base.ggml_init(self._InitParams(weight_bytes + (256 << 20), None, False))
        qtype = GGMLQuantizationType[fmt.upper()].value

        def tensor(t, w=None, dims=()):
            ptr = (base.ggml_new_tensor_3d if len(dims) == 3 else base.ggml_new_tensor_2d)(self.ctx, t, *dims)
            if w is not None:
                src = np.ascontiguousarray(w)
                assert base.ggml_nbytes(ptr) == src.nbytes, "ggml's layout is not the layer's"
                ctypes.memmove(base.ggml_get_data(ptr), src.ctypes.data, src.nbytes)
            return ptr

        f32, i32 = GGMLQuantizationType.F32.value, 26  # GGML_TYPE_I32
        self.x = tensor(f32, dims=(HIDDEN, 1, 1))
        self.h = tensor(f32, dims=(INTER, TOP_K, 1))
        self.ids = tensor(i32, dims=(TOP_K, 1))
        self.graph = base.ggml_new_graph(self.ctx)
        for name, K, N, b in (("gate", HIDDEN, INTER, self.x), ("up", HIDDEN, INTER, self.x), ("down", INTER, HIDDEN, self.h)):
            w = tensor(qtype, merged[name].parts["data"].numpy(), (K, N, EXPERTS))
            base.ggml_build_forward_expand(self.graph, base.ggml_mul_mat_id(self.ctx, w, b, self.ids))
        for t, n in ((self.x, HIDDEN), (self.h, INTER * TOP_K)):
            values = np.random.default_rng(0).standard_normal(n).astype(np.float32)
            ctypes.memmove(base.ggml_get_data(t), values.ctypes.data, values.nbytes)

    def forward(self, ids: torch.Tensor) -> None:
        chosen = ids.to(torch.int32).numpy().copy()
        ctypes.memmove(self.base.ggml_get_data(self.ids), chosen.ctypes.data, chosen.nbytes)
        self.cpu.ggml_graph_compute_with_ctx(self.ctx, self.graph, 1)

    def close(self) -> None:
        self.base.ggml_free(self.ctx)  # the layer's weights: hundreds of MB a format


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=[*EXPERT_UNPACK_RATES_PER_CORE["avx512"], "iq4_xs", "q4_0"])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--llama-cpp", action="store_true", help="time llama.cpp's kernels on the same bytes, alternating")
    p.add_argument("--ggml-lib", type=Path, help="with --llama-cpp: the folder of another ggml build's libraries")
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
        merged: dict = {}
        layer = native_experts.native_for(make_layer(fmt, EXPERTS, HIDDEN, INTER, merged=merged))
        peer = GgmlMoe(merged, fmt, args.ggml_lib) if args.llama_cpp else None
        seconds: list[float] = []
        peer_seconds: list[float] = []
        for call in range(args.calls + 8):
            ids, w = routing(1, EXPERTS, TOP_K, call)
            start = time.process_time()
            layer.forward(x, ids, w, regime="decode")
            mid = time.process_time()
            if peer is not None:
                # Experts of its own: the engine's would be in the cache (L3 holds a tenth of
                # the q4_0 layer), which made the second side of each call the faster.
                peer.forward(routing(1, EXPERTS, TOP_K, call, seed=SEED + 1)[0])
            if call >= 8:  # the first calls warm up
                seconds.append(mid - start)
                peer_seconds.append(time.process_time() - mid)
        median = statistics.median(seconds)
        documented = documented_rates.get(fmt)
        note = f"  (documented {documented / 1e9:.1f})" if documented else ""
        if peer is not None:
            peer.close()
            peer_median = statistics.median(peer_seconds)
            note += f"  llama.cpp {weights / peer_median / 1e9:5.1f}, engine/llama.cpp {peer_median / median:4.2f}x"
        print(f"{fmt:<8} {median * 1e3:6.3f} ms a token  {weights / median / 1e9:5.1f} G weights/s a core{note}")


if __name__ == "__main__":
    main()
