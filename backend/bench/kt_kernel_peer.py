"""kt-kernel (KTransformers' CPU MoE kernels) on the benchmark's layer, for comparison.

Runs in its own process (``python -m hybridmoe.backend.bench.kt_kernel_peer SPEC_JSON``): kt-kernel
keeps its own worker threads, which must not compete with ours while either is timed. The
child rebuilds the very same synthetic layer from the seed (same bytes, same routing) and
drives kt-kernel's low-level extension (``kt_kernel_ext``) the way its Python wrappers do:

* GGUF q4_0 / q8_0 / q2_k .. q6_k, iq4_xs, iq2_xxs and iq1_s: the llamafile ``MOE`` class,
  given the merged ``[E, out, in]`` blocks as GGUF stores them (LlamafileMoEWrapper.load_weights),
  which computes them through ggml's type traits;
* int4_g32 (Kimi K2 compressed-tensors): ``RAWINT4``, whose kernels take the int32 words
  as bytes and the bf16 scales per expert (NativeMoEWrapper, CompressedSafeTensorLoader),
  with the best class kt-kernel selects for this CPU (AMX, AVX-VNNI-256 or AVX2);
* bf16: the native ``BF16`` class with per-expert pointers;
* on a CPU with AMX, q8_0 and q4_0 also through its AMX classes (``AMXInt8_MOE``,
  ``AMXInt4_MOE``), its fast path there: they take bf16 weights (the layer's, dequantized) and
  quantize them at load, per row, to int8 / int4 (AMXMoEWrapper.load_weights_from_tensors).
  ``methods`` says which paths a format has here.

Activations and outputs are bf16 (kt-kernel's interface), ids int64, weights fp32, all
experts on the CPU. kt-kernel is a benchmark peer only: nothing else imports it.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np
import torch

from hybridmoe.backend.bench.kernel_layer import make_layer, routing

RESULT_MARK = "KT_PEER_RESULT "
# Its llamafile MoE refuses iq2_xs, iq2_s, iq3_xxs, iq3_s ("llamafile not supported") and aborts
# on iq1_m (kt-kernel 0.7.2, tried on each).
LLAMAFILE_FORMATS = ("q4_0", "q8_0", "q4_k", "q5_k", "q6_k", "q2_k", "q3_k", "iq4_xs", "iq2_xxs", "iq1_s")


# Formats compared with kt-kernel's AMX class of the same bits per weight, on CPUs with AMX.
AMX_CLASSES = {"q8_0": "AMXInt8_MOE", "q4_0": "AMXInt4_MOE"}


def supported_formats() -> tuple[str, ...]:
    return LLAMAFILE_FORMATS + ("int4_g32", "bf16")


def methods(fmt: str, cpu_features: set[str]) -> tuple[str, ...]:
    """kt-kernel's paths for `fmt` on a CPU with these /proc/cpuinfo flags: "amx" (its AMX class,
    first: kt-kernel's own choice there) and "default" (llamafile, RAWINT4 or BF16)."""
    amx = ("amx",) if fmt in AMX_CLASSES and {"amx_tile", "amx_int8", "amx_bf16"} <= cpu_features else ()
    return amx + (("default",) if fmt in supported_formats() else ())


def _build(spec: dict[str, Any]):
    import kt_kernel  # noqa: F401  (loads the extension variant for this CPU)
    from kt_kernel_ext import CPUInfer, WorkerPoolConfig
    from kt_kernel_ext.moe import MOEConfig

    E, k, H, I, fmt = spec["E"], spec["k"], spec["H"], spec["I"], spec["format"]
    merged: dict[str, Any] = {}
    make_layer(fmt, E, H, I, spec["seed"], merged)
    pool_cfg = WorkerPoolConfig()
    pool_cfg.subpool_count = 1
    pool_cfg.subpool_numa_map = [0]
    pool_cfg.subpool_thread_count = [spec["threads"]]
    cpu = CPUInfer(pool_cfg)
    mask = torch.zeros(E, dtype=torch.bool)  # no expert on a GPU
    cfg = MOEConfig(E, k, H, I, mask.data_ptr())
    cfg.layer_idx = 0
    cfg.pool = cpu.backend_
    # kt-kernel sizes its buffers from max_len; smaller values than its m_block crash it.
    cfg.max_len = max(512, max(spec["tokens"]))
    keep: list[Any] = [mask, merged]

    if spec.get("method") == "amx":
        from kt_kernel_ext import moe as kt_moe

        from hybridmoe.backend.formats.quant import dequantize

        for name in ("gate", "up", "down"):  # [E, out, in] bf16, which the class quantizes
            w = dequantize(merged[name], torch.bfloat16).contiguous()
            keep.append(w)
            setattr(cfg, f"{name}_proj", w.data_ptr())
        cfg.save = cfg.load = False  # quantized at load, in memory (its wrapper's save mode also writes them)
        cls = getattr(kt_moe, AMX_CLASSES[fmt])
        moe = cls(cfg)
        method = cls.__name__
    elif fmt in LLAMAFILE_FORMATS:
        from kt_kernel_ext.kvcache import ggml_type
        from kt_kernel_ext.moe import MOE

        cfg.m_block = 32
        cfg.group_min_len = 10
        cfg.group_max_len = cfg.max_len
        cfg.gate_proj = merged["gate"].parts["data"].data_ptr()
        cfg.up_proj = merged["up"].parts["data"].data_ptr()
        cfg.down_proj = merged["down"].parts["data"].data_ptr()
        t = getattr(ggml_type, fmt.upper())
        cfg.gate_type = cfg.up_type = cfg.down_type = t
        cfg.hidden_type = ggml_type.BF16
        moe = MOE(cfg)
        method = f"LLAMAFILE {fmt.upper()}"
    elif fmt == "int4_g32":
        from kt_kernel.utils.amx import _select_rawint4_backend

        def per_expert(w):
            packed = w.parts["weight_packed"]
            data = [packed[e].contiguous().view(torch.uint8) for e in range(E)]
            scales = [w.parts["weight_scale"][e].contiguous() for e in range(E)]
            keep.extend(data + scales)
            return [[t.data_ptr() for t in data]], [[t.data_ptr() for t in scales]]

        cfg.gate_projs, cfg.gate_scales = per_expert(merged["gate"])
        cfg.up_projs, cfg.up_scales = per_expert(merged["up"])
        cfg.down_projs, cfg.down_scales = per_expert(merged["down"])
        cfg.quant_config.bits = 4
        cfg.quant_config.group_size = 32
        cfg.quant_config.zero_point = False
        cls = _select_rawint4_backend(32)
        moe = cls(cfg)
        method = f"RAWINT4 ({cls.__name__})"
    elif fmt == "bf16":
        from kt_kernel_ext.moe import AVX2BF16_MOE

        def per_expert(w):
            data = [w[e].contiguous() for e in range(E)]
            keep.extend(data)
            return [[t.data_ptr() for t in data]], [[0] * E]

        cfg.gate_projs, cfg.gate_scales = per_expert(merged["gate"])
        cfg.up_projs, cfg.up_scales = per_expert(merged["up"])
        cfg.down_projs, cfg.down_scales = per_expert(merged["down"])
        moe = AVX2BF16_MOE(cfg)
        method = "BF16 (AVX2BF16_MOE)"
    else:
        raise ValueError(f"kt-kernel has no path for {fmt} here")
    # The expert map: int64 for the AMX classes (as kt-kernel's own callers pass it), int32 for llamafile.
    identity = torch.arange(E, dtype=torch.int64 if spec.get("method") == "amx" else torch.int32)
    cpu.submit(moe.load_weights_task(identity.data_ptr()))
    cpu.sync()
    return cpu, moe, method, keep


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Median latency (s) per token count, or the error that stopped kt-kernel."""
    try:
        import kt_kernel

        cpu, moe, method, keep = _build(spec)
    except Exception as e:  # kt-kernel missing, or no kernel for this format on this CPU
        return {"error": f"{type(e).__name__}: {e}"}
    E, k, H = spec["E"], spec["k"], spec["H"]
    out: dict[str, Any] = {"method": method, "variant": getattr(kt_kernel, "__cpu_variant__", "?"), "latency": {},
                           "best": {}}
    for T in spec["tokens"]:
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
        y = torch.zeros(T, H, dtype=torch.bfloat16)
        bsz = torch.tensor([T], dtype=torch.int32)
        times = []
        routes = [routing(T, E, k, i, spec["seed"]) for i in range(64)]
        deadline = time.perf_counter() + spec["seconds"]
        i = 0
        while i < spec["min_repeats"] or (time.perf_counter() < deadline and i < spec["max_repeats"]):
            ids, w = routes[i % len(routes)]
            t0 = time.perf_counter()
            cpu.submit(moe.forward_task(bsz.data_ptr(), k, ids.data_ptr(), w.data_ptr(), x.data_ptr(), y.data_ptr(), False))
            cpu.sync()
            times.append(time.perf_counter() - t0)
            i += 1
        warm = times[1:] if len(times) > 2 else times
        out["latency"][str(T)] = float(np.median(warm))
        out["best"][str(T)] = float(np.min(warm))
    return out


if __name__ == "__main__":
    result = run(json.loads(sys.argv[1]))
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(result), flush=True)
