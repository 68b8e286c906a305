"""What the user wants to run: context length, concurrent conversations, cache precision, strategy."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.workload_choices import (
    BACKENDS,
    GPU_EXPERT_FORMS,
    KV_BYTES_PER_ELEMENT,
    PARALLEL,
    PREFILL_RESERVE,
    STRATEGIES,
)


@dataclass(frozen=True)
class Workload:
    context: int = 32768
    users: int = 1
    kv_dtype: str = "bf16"
    # "auto": keep one MoE layer of experts free on each GPU for streamed prefill when it fits.
    prefill_reserve: str = "auto"
    strategy: str = "uniform"
    stats_file: str | None = None
    backend: str = "auto"
    # Tokens per prefill chunk: sizes the activation reserve on the main device.
    prefill_chunk: int = 2048
    # Per-user decode speed below which one workstation is not enough (docs/sizing.md §7).
    target_tokens_per_s: float = 5.0
    gpu_expert_form: str = "auto"
    parallel: str = "auto"
    # llama.cpp's --n-cpu-moe: the experts of blocks 0..N-1 on the CPU (a plan for llama.cpp
    # then checks that layout instead of choosing one); None: the plan chooses.
    n_cpu_moe: int | None = None

    def __post_init__(self):
        if self.context < 1:
            raise UsageError(f"context must be at least 1 token, got {self.context}", "Pass --context 32768 or similar.")
        if self.users < 1:
            raise UsageError(f"users must be at least 1, got {self.users}", "Pass --users 1 or more.")
        if self.kv_dtype not in KV_BYTES_PER_ELEMENT:
            raise UsageError(f"unknown KV cache type {self.kv_dtype!r}", f"Choose one of {', '.join(KV_BYTES_PER_ELEMENT)}.")
        if self.strategy not in STRATEGIES:
            raise UsageError(f"unknown placement strategy {self.strategy!r}", f"Choose one of {', '.join(STRATEGIES)}.")
        if self.strategy == "frequency" and not self.stats_file:
            raise UsageError(
                "the frequency strategy needs a statistics file",
                "Pass --stats FILE (recorded by `hybridmoe run --record-stats FILE`), or use --strategy uniform.",
            )
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown backend {self.backend!r}", f"Choose one of {', '.join(BACKENDS)}.")
        if self.prefill_reserve not in PREFILL_RESERVE:
            raise UsageError(f"prefill reserve must be one of {', '.join(PREFILL_RESERVE)}, got {self.prefill_reserve!r}")
        if self.prefill_chunk < 1:
            raise UsageError(f"prefill chunk must be at least 1 token, got {self.prefill_chunk}")
        if self.gpu_expert_form not in GPU_EXPERT_FORMS:
            raise UsageError(f"GPU expert form must be one of {', '.join(GPU_EXPERT_FORMS)}, got {self.gpu_expert_form!r}")
        if self.parallel not in PARALLEL:
            raise UsageError(f"GPU layout must be one of {', '.join(PARALLEL)}, got {self.parallel!r}")
        if self.n_cpu_moe is not None and self.n_cpu_moe < 0:
            raise UsageError(f"--n-cpu-moe must be 0 or more, got {self.n_cpu_moe}")
        if self.n_cpu_moe is not None and self.backend != "llamacpp":
            raise UsageError("--n-cpu-moe sizes llama.cpp's layout", "Add --backend llamacpp, or leave --n-cpu-moe out.")
        if self.target_tokens_per_s <= 0:
            raise UsageError(f"target speed must be positive, got {self.target_tokens_per_s}")

    @property
    def kv_bytes_per_element(self) -> float:
        return KV_BYTES_PER_ELEMENT[self.kv_dtype]

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Workload":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
