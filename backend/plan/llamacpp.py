"""The Plan in llama.cpp's terms (docs/sizing.md §5).

llama.cpp places experts a whole layer at a time: `--n-cpu-moe N` keeps the experts of
blocks 0..N−1 in host memory (dense leading blocks count in N), and `-ot PATTERN=CPU`
does the same for any set of blocks. We give it the GPU expert budget the engine would
use and keep on the GPU as many whole layers' experts as fit, the last layers first, so
that the CPU layers are exactly blocks 0..N−1 and `--n-cpu-moe N` says the same thing.
"""

from __future__ import annotations

from typing import Any

from hybridmoe.backend.models.spec import ModelSpec

# Block tensors llama.cpp names for routed experts (merged gate/up/down, and the fused or
# "chexps" variants some converters write).
EXPERT_TENSORS = r"ffn_(up|down|gate|gate_up)_(ch|)exps"
KV_TYPES = {"bf16": "f16", "fp16": "f16", "fp8": "q8_0", "q8_0": "q8_0"}


def expert_override_pattern(layers) -> str:
    """One `-ot` pattern keeping the experts of `layers` in host memory."""
    alternatives = "|".join(str(i) for i in sorted(layers))
    return rf"blk\.({alternatives})\.{EXPERT_TENSORS}=CPU"


def translate(
    spec: ModelSpec,
    routed_bytes_by_layer: dict[int, int],
    gpu_expert_budget: float,
    gpu_budgets: list[int],
    threads: int | None,
    context: int,
    users: int,
    kv_dtype: str,
    gpu_layers: list[int] | None = None,
) -> dict[str, Any]:
    """llama.cpp's settings for the plan. `gpu_layers`: the MoE layers whose experts a plan made
    for llama.cpp put on the GPUs (its own layout, plan.make); without it, as many whole layers
    as `gpu_expert_budget` holds, the last first (the equivalent of an engine plan)."""
    has_gpu = bool(gpu_budgets)
    if gpu_layers is not None:
        gpu_layers = list(gpu_layers)
    elif has_gpu:
        gpu_layers = []
        left = gpu_expert_budget
        for layer in sorted(spec.moe_layers, reverse=True):
            if routed_bytes_by_layer[layer] > left:
                break
            left -= routed_bytes_by_layer[layer]
            gpu_layers.append(layer)
    else:
        gpu_layers = []
    cpu_layers = sorted(set(spec.moe_layers) - set(gpu_layers))
    n_cpu_moe = (max(cpu_layers) + 1) if cpu_layers else 0
    settings: dict[str, Any] = {
        # All blocks plus the output layer on the GPU; the experts excepted below.
        "n_gpu_layers": spec.num_layers + 1 if has_gpu else 0,
        "n_cpu_moe": n_cpu_moe if has_gpu else 0,
        "cpu_moe_layers": cpu_layers,
        "gpu_moe_layers": sorted(gpu_layers),
        "override_tensor": [expert_override_pattern(cpu_layers)] if has_gpu and cpu_layers else [],
        "n_ctx": context * users,
        "n_parallel": users,
        "n_threads": threads,
        "n_batch": 2048,
        # A large micro-batch lets llama.cpp offload big prompt batches to the GPU ("op offload").
        "n_ubatch": 2048 if has_gpu else 512,
        "flash_attn": True,
        "cache_type_k": KV_TYPES[kv_dtype],
        "cache_type_v": KV_TYPES[kv_dtype],
    }
    if len(gpu_budgets) > 1:
        total = sum(max(b, 0) for b in gpu_budgets) or 1
        settings["tensor_split"] = [round(max(b, 0) / total, 3) for b in gpu_budgets]
    settings["command"] = command_line(settings)
    return settings


def command_line(s: dict[str, Any]) -> str:
    parts = ["llama-server", "-m", "MODEL.gguf", "-ngl", str(s["n_gpu_layers"])]
    if s["n_cpu_moe"]:
        parts += ["--n-cpu-moe", str(s["n_cpu_moe"])]
    parts += ["-c", str(s["n_ctx"]), "--parallel", str(s["n_parallel"])]
    if s["n_threads"]:
        parts += ["-t", str(s["n_threads"])]
    parts += ["-b", str(s["n_batch"]), "-ub", str(s["n_ubatch"]), "-fa", "on"]
    if s["cache_type_k"] != "f16":
        parts += ["-ctk", s["cache_type_k"], "-ctv", s["cache_type_v"]]
    if "tensor_split" in s:
        parts += ["-ts", ",".join(str(x) for x in s["tensor_split"])]
    return " ".join(parts)
