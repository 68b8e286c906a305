"""The MoE feed-forward block: router, routed experts split by placement, shared experts.

The router runs on the main device. Its choices go to the CPU once (the CPU experts and the
activation counts need them there); the main-device experts are launched first so that on
a GPU they run while the CPU computes its half. The CPU half runs in the native kernels
when they are built and read the layer's storage (``native_experts.try_forward``), else in
the PyTorch reference ``cpu_experts_forward``. The two partial sums are then added.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.engine import native_experts
from backend.engine.experts import HostExperts, ResidentExperts, cpu_experts_forward, experts_forward
from backend.engine.layers import GatedMLP, Linear
from backend.engine.stats import ExpertRecorder


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
    ):
        super().__init__()
        self.layer = layer
        self.router = router
        self.main, self.host = main, host
        self.shared = shared
        self.shared_gate = shared_gate  # Qwen2-MoE: sigmoid gate on the shared expert
        self.recorder = recorder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.router(x)
        ids_cpu = topk_ids.cpu()
        if self.recorder is not None:
            self.recorder.record(self.layer, ids_cpu)
        # Both halves return float32 partial sums; the sum is rounded to the model dtype once.
        routed = None
        if len(self.main):
            routed = experts_forward(x, topk_ids, topk_weights, self.main)
        if len(self.host):
            x_cpu, weights_cpu = x.cpu(), topk_weights.cpu()
            part = native_experts.try_forward(x_cpu, ids_cpu, weights_cpu, self.host)
            if part is None:
                part = cpu_experts_forward(x_cpu, ids_cpu, weights_cpu, self.host)
            part = part.to(x.device)
            routed = part if routed is None else routed + part
        routed = torch.zeros_like(x) if routed is None else routed.to(x.dtype)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            routed = routed + shared
        return routed
