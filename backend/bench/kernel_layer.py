"""The kernel benchmark's layer and routing, rebuilt from a seed: ``hybridmoe bench kernels``
(``kernels``) and its kt-kernel peer, in its own process (``kt_kernel_peer``), time the very
same bytes under the very same routing. Both import them from here, neither from the other.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridmoe.backend.bench.synthetic_experts import make_host_experts

SEED = 1234


def make_layer(fmt: str, E: int, H: int, I: int, seed: int = SEED, merged: dict | None = None):
    """The benchmark's layer: every expert on the CPU, per-expert tensors (views of merged
    [E, out, in] ones, as a GGUF stores them). The same seed gives the same bytes."""
    return make_host_experts(np.random.default_rng(seed), fmt, E, H, I, range(E), layout="per_expert",
                             merged=merged)


def routing(T: int, E: int, k: int, call: int, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int64 and topk_weights [T, k] float32 for repeat number `call`."""
    if T == 1:
        ids = (torch.arange(k, dtype=torch.int64) + k * call) % E
        ids = ids.view(1, k)
    else:
        rng = np.random.default_rng((seed, T, call))
        ids = torch.from_numpy(np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64))
    w = torch.full((T, k), 1.0 / k, dtype=torch.float32)
    return ids.contiguous(), w
