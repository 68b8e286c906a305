"""A decode step's GPU-resident routed experts in two kernel launches.

The reference path (``experts.experts_forward``) loops over the experts a call hits: for a
decode step that is k experts a layer, each a gather, two matmuls, the activation and a
scatter-add, some ten kernel launches each, and it needs the expert ids on the host first (a
wait for the device). On a GPU the launches, not the bytes, set a decode step's time: a
launch costs the host 9-16 us, and the mid-size Qwen3-shaped model's reads (0.3 ms a token)
take the H200 less than the step's 400 launches. Here the same arithmetic is two Triton
launches per layer (``decode_experts_kernels``): gate/up with the activation for every
(token, slot) pair, then down, weighted by the routing weight, for every pair, summed over
the slots. The ids stay on the device (a pair whose expert the group does not hold
contributes zeros), so the host never waits for them. Measured on an H200 in one run
(`scripts/gpu_check.py`), that model with every expert on the card decoded 1.8x as fast as
with the loop (104.5 against 58.0 tokens/s; 55.0 against 30.3 on a slower host).

Used for calls of up to ``MAX_TOKENS`` tokens on CUDA (decode, and batched decode of a few
conversations); longer calls read each expert once for many tokens, which the reference
path's matmuls do better.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache, cached_property

import torch

from hybridmoe.backend.models.layer_description import CLAMPED_SWIGLU

log = logging.getLogger(__name__)

# Tokens per call up to which the kernels run: each (token, slot) pair reads its expert's
# matrices, so beyond a few tokens an expert hit by several of them is read several times.
MAX_TOKENS = 8

# Block sizes by form and kernel: (rows per program, columns per step; a 4-bit step takes
# twice the columns, as it reads half the bytes). The fastest of those tried on an H200 at
# one token (`scripts/gpu_check.py`, section "decode kernels"); only the Kimi-shaped 4-bit
# layer (188 MB a call) ran long enough there for the kernels rather than their launches to
# set the time, so the dense and int8 choices are provisional.
BLOCKS = {
    "dense": {"gate_up": (8, 256), "down": (16, 256)},
    "int8": {"gate_up": (8, 256), "down": (16, 256)},
    "int4": {"gate_up": (4, 256), "down": (8, 256)},
}


@dataclass(frozen=True)
class Stack:
    """One role's matrices (gate_up or down) for all experts of a group, as held.

    form "dense": w [n, out, in] in the compute dtype; "int8": w int8 [n, out, in], scale [n,
    out]; "int4": w uint8 codes [n, out, in/2], scale (and min) [n, out, in/group], table a
    row of ``int4_weights.TABLES``. bias [n, out] or None."""

    form: str
    w: torch.Tensor
    scale: torch.Tensor | None = None
    min: torch.Tensor | None = None
    table: torch.Tensor | None = None
    table_name: str | None = None
    group: int = 32
    bias: torch.Tensor | None = None

    # Worked out once per group: a decode step launches these kernels at every MoE layer, and
    # on a GPU the host's time per launch is what a decode step costs.
    @cached_property
    def pointers(self) -> tuple:
        """w, scale, min, table and bias (each unused one standing in as w)."""
        w = self.w
        return tuple(t if t is not None else w for t in (w, self.scale, self.min, self.table, self.bias))

    @cached_property
    def strides(self) -> tuple[int, int, int, int]:
        """Of w, then of scale (and min) by expert and by row."""
        scale = self.scale if self.scale is not None else self.w
        return self.w.stride(0), self.w.stride(1), scale.stride(0), scale.stride(1) if scale.dim() > 1 else 1

    @cached_property
    def constants(self) -> dict:
        from hybridmoe.backend.engine import decode_experts_kernels as k

        return {"FORM": k.FORMS[self.form], "GROUP": self.group, "HAS_MIN": self.min is not None,
                "TABLE": k.TABLES.get(self.table_name, k.LOOKUP), "HAS_BIAS": self.bias is not None}


def supported(activation: str) -> bool:
    return activation in ("silu", "swish", CLAMPED_SWIGLU)


@cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Devices on which the kernels failed (Triton could not build them for the card, say): their
# calls take the reference loop from then on, and the reason is logged once.
_failed: dict[torch.device, str] = {}


def applies(x: torch.Tensor, activation: str) -> bool:
    """Whether a call with hidden states `x` [T, H] runs here (else the reference loop)."""
    return (x.device.type == "cuda" and x.shape[0] <= MAX_TOKENS and supported(activation)
            and x.device not in _failed and triton_available())


def failed(device: torch.device, error: Exception) -> None:
    """The kernels raised on `device`: the loop serves its calls from now on."""
    _failed[device] = f"{type(error).__name__}: {error}"
    log.warning("GPU decode kernels unavailable on %s (%s); routed experts there take the slower loop",
                device, _failed[device])


def launch_tensors(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, inter: int):
    """What the two launches read and write: x, ids and weights contiguous, and the float32
    intermediate [pairs, inter] and per-pair outputs [pairs, H] they fill."""
    pairs, hidden = topk_ids.numel(), x.shape[1]
    h = torch.empty((pairs, inter), dtype=torch.float32, device=x.device)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    return x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous(), h, y


def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, slot_of: torch.Tensor,
            gate_up: Stack, down: Stack, activation: str, *, interleaved: bool = False, alpha: float = 1.702,
            limit: float = 7.0, blocks: dict | None = None) -> torch.Tensor:
    """Sum over the (token, slot) pairs of weight * expert(x[token]) for the experts the stacks
    hold (``slot_of[e]``: expert e's index in them, -1 if not held; ids -1 are skipped).

    x [T, H] in the compute dtype; topk_ids [T, k] int64 and topk_weights [T, k] on x's device.
    Returns [T, H] float32, as ``experts.experts_forward`` does."""
    from hybridmoe.backend.engine import decode_experts_kernels as kernels

    blocks = blocks or {}
    t, hidden = x.shape
    k = topk_ids.shape[1]
    pairs = t * k
    inter = down.w.shape[2] * (2 if down.form == "int4" else 1)
    x, ids, weights, h, y = launch_tensors(x, topk_ids, topk_weights, inter)
    n_experts = slot_of.shape[0]

    block_i, block_k = blocks.get("gate_up") or BLOCKS[gate_up.form]["gate_up"]
    if gate_up.form == "int4":
        block_k *= 2
    gate_step, up_first, up_step = (2, 1, 2) if interleaved else (1, inter, 1)
    grid = (pairs, -(-inter // block_i))
    kernels.gate_up_kernel[grid](
        x, ids, slot_of, h, *gate_up.pointers, hidden, inter, k, n_experts, *gate_up.strides, gate_step, up_first,
        up_step, alpha, limit, ACT=kernels.ACTS[CLAMPED_SWIGLU if activation == CLAMPED_SWIGLU else "silu"], BLOCK_I=block_i,
        BLOCK_K=block_k, num_warps=4, **gate_up.constants)

    block_h, block_k = blocks.get("down") or BLOCKS[down.form]["down"]
    if down.form == "int4":
        block_k *= 2
    grid = (pairs, -(-hidden // block_h))
    kernels.down_kernel[grid](
        h, ids, slot_of, weights, y, x, *down.pointers, inter, hidden, n_experts, *down.strides, BLOCK_H=block_h,
        BLOCK_K=block_k, num_warps=4, **down.constants)
    return y.view(t, k, hidden).sum(dim=1)
