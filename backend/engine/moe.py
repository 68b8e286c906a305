"""The MoE feed-forward block: router, routed experts split by placement, shared experts.

The router runs on the main device. Its choices go to the CPU once (the CPU experts and the
activation counts need them there). The CPU half runs in the native kernels when they are
built and read the layer's storage (``native_experts.try_forward``), else in the PyTorch
reference ``cpu_experts_forward``. The two float32 partial sums are then added, rounded to
the model dtype once, and the shared experts added.

That is the whole of ``forward`` when the main device is the CPU. With a GPU main device a
``hybrid.HybridScheduler`` is attached (``scheduler``) and runs the same steps overlapped:
the CPU half on a worker thread while the GPU computes its experts and the shared ones, or,
for long prompts, the CPU-resident experts streamed to the GPU (``expert_streaming``). It
uses the pieces below (``cpu_part``, ``shared_part``, ``combine``), so every path does the
same arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hybridmoe.backend.engine import native_experts
from hybridmoe.backend.models import layer_description
from hybridmoe.backend.engine.experts import (
    HostExperts,
    ResidentExperts,
    cpu_experts_forward,
    experts_forward,
)
from hybridmoe.backend.engine.layers import GatedMLP, Linear
from hybridmoe.backend.engine.stats import ExpertRecorder


class MoE(nn.Module):
    def __init__(
        self,
        layer: int,
        router: nn.Module,
        main: ResidentExperts,
        host: HostExperts,
        *,
        shared: GatedMLP | None = None,
        shared_gate: Linear | None = None,
        recorder: ExpertRecorder | None = None,
        tensors: layer_description.ExpertTensors = layer_description.ExpertTensors(),
    ):
        super().__init__()
        self.layer = layer
        self.router = router
        self.main, self.host = main, host
        self.shared = shared
        self.shared_gate = shared_gate  # Qwen2-MoE: sigmoid gate on the shared expert
        self.recorder = recorder
        self.tensors = tensors  # where it was read from
        self.scheduler = None  # a hybrid.HybridScheduler when the main device is not the CPU

    def describe(self) -> layer_description.MixtureOfExperts:
        host = len(self.host)
        return layer_description.MixtureOfExperts(
            router=self.router.describe(), shared=None if self.shared is None else self.shared.describe(),
            shared_gate=self.shared_gate is not None,
            shared_gate_native=self.shared_gate is not None and self.shared_gate.runs_native,
            experts_on_main=len(self.main), experts_on_host=host,
            experts_native=native_experts.unsupported_reason(self.host) if host else None,
            streamed=self.scheduler is not None, activation=layer_description.activation_name(self.host.act.kind),
            swiglu_alpha=self.host.act.alpha, swiglu_limit=self.host.act.limit, tensors=self.tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheduler is not None:
            return self.scheduler.forward(self, x)
        topk_ids, topk_weights = self.router(x)
        ids_cpu = topk_ids.cpu()
        self.record(ids_cpu)
        # Both halves return float32 partial sums; the sum is rounded to the model dtype once.
        main = experts_forward(x, topk_ids, topk_weights, self.main) if len(self.main) else None
        part = None
        if len(self.host):
            part = self.cpu_part(x.cpu(), ids_cpu, topk_weights.cpu()).to(x.device)
        return self.combine(x, main, part, self.shared_part(x))

    def record(self, ids_cpu: torch.Tensor | np.ndarray) -> None:
        if self.recorder is not None:
            self.recorder.record(self.layer, ids_cpu)

    def cpu_part(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The float32 partial sum over the CPU-resident experts (all arguments on the CPU)."""
        part = native_experts.try_forward(x, topk_ids, topk_weights, self.host)
        if part is None:
            part = cpu_experts_forward(x, topk_ids, topk_weights, self.host)
        return part

    def shared_part(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.shared is None:
            return None
        shared = self.shared(x)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return shared

    @staticmethod
    def combine(x: torch.Tensor, main: torch.Tensor | None, part: torch.Tensor | None,
                shared: torch.Tensor | None) -> torch.Tensor:
        """main + part in float32, rounded to x's dtype once (a norm's float32 rows: not at
        all, as llama.cpp's), plus the shared experts."""
        routed = main if part is None else part if main is None else main + part
        routed = torch.zeros_like(x) if routed is None else routed.to(x.dtype)
        return routed if shared is None else routed + shared
