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
    """topk_ids [T, k] int64 and topk_weights [T, k] float32 for repeat number `call`: k
    distinct experts per token at random, as a decode step routes. (One token's experts were
    once k consecutive ones, the next call's the next k: one contiguous stream through the
    layer from call to call, which the hardware prefetchers followed across the calls: the
    q4_0 layer read 45.6 GB/s that way on a 2-core Zen 5, 39.6 GB/s with random experts, in
    runs minutes apart.)"""
    rng = np.random.default_rng((seed, T, call))
    ids = torch.from_numpy(np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64))
    w = torch.full((T, k), 1.0 / k, dtype=torch.float32)
    return ids.contiguous(), w
