"""When one workstation is not enough: the serving deployment that would carry the workload.

docs/sizing.md §7: we do not build a cluster; we say which existing engine and how many
cards. Cards are H200 (141 GB, 123.4 GiB usable by the sizing rule) in tensor-parallel
groups of 1, 2, 4 or 8 per node, two nodes by pipeline beyond that. Under tensor
parallelism an MLA (latent) cache is replicated in full on every card; decode context
parallelism divides it again by its size.
"""

from __future__ import annotations

from typing import Any

from hybridmoe.backend.plan.budget import described_gpu_budget

H200_REPORTED = int(140.4 * (1 << 30))
CARD = "H200 NVL 141GB"


def recommend(model: str, weight_bytes: int, kv_total_bytes: float, mla: bool, context: int, users: int) -> dict[str, Any]:
    usable = described_gpu_budget(H200_REPORTED)
    for nodes in (1, 2, 4):
        for tp in (1, 2, 4, 8):
            if nodes > 1 and tp != 8:
                continue
            cards = tp * nodes
            # MLA under TP: every card of a TP group holds the whole cache of its pipeline stage.
            kv_per_card = kv_total_bytes / nodes if mla else kv_total_bytes / cards
            dcp = 1
            if weight_bytes / cards + kv_per_card > usable and mla:
                dcp = tp
                kv_per_card /= dcp
            if weight_bytes / cards + kv_per_card <= usable:
                return _deployment(model, cards, tp, nodes, dcp, weight_bytes, kv_per_card, usable, context, users)
    return {
        "cards": None,
        "summary": (
            f"Even 32 × {CARD} cannot hold {weight_bytes / 2**30:.0f} GiB of weights plus "
            f"{kv_total_bytes / 2**30:.0f} GiB of KV cache: reduce context or users."
        ),
    }


def _deployment(model, cards, tp, nodes, dcp, weight_bytes, kv_per_card, usable, context, users) -> dict[str, Any]:
    vllm = ["vllm", "serve", model, "--tensor-parallel-size", str(tp)]
    sglang = ["python", "-m", "sglang.launch_server", "--model-path", model, "--tp", str(tp * nodes)]
    if nodes > 1:
        vllm += ["--pipeline-parallel-size", str(nodes)]
        sglang += ["--nnodes", str(nodes)]
    if dcp > 1:
        vllm += ["--decode-context-parallel-size", str(dcp)]
    vllm += ["--max-model-len", str(context), "--max-num-seqs", str(users)]
    sglang += ["--context-length", str(context), "--max-running-requests", str(users)]
    per_card = weight_bytes / cards + kv_per_card
    return {
        "cards": cards,
        "card": CARD,
        "nodes": nodes,
        "tensor_parallel": tp,
        "decode_context_parallel": dcp,
        "bytes_per_card": int(per_card),
        "usable_bytes_per_card": usable,
        "vllm": " ".join(vllm),
        "sglang": " ".join(sglang),
        "summary": (
            f"{cards} × {CARD} ({nodes} node{'s' if nodes > 1 else ''}): "
            f"{per_card / 2**30:.1f} of {usable / 2**30:.1f} GiB per card"
            + (f", KV divided by decode context parallelism {dcp}" if dcp > 1 else "")
        ),
        "kt_kernel_note": "For CPU+GPU serving of the same layout, SGLang with KTransformers (kt-kernel) experts on the CPU.",
    }
