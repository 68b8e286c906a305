"""Routed experts on a GPU in the GGUF blocks the file stores (``ResidentExperts`` form "stored").

Requantized to weight-only int8, a Q4_K_M expert took 1.5-1.8x its file bytes on the card
(DeepSeek-V3: 44.06 MB for 24.77-28.56), so a card held half the experts llama.cpp holds there;
repacked as 4-bit codes with 16-bit group scales ("int4"), a Q4_K one still took 5 bits a weight
for 4.5 and its scales were rounded, and the Q6_K downs of Q4_K_M and every other k-quant and
i-quant had no such form. Held as stored, an expert takes its file bytes on any GGUF type the
engine reads (``stored_linear.KERNEL_TYPES``), and the card computes the file's values:

- a decode step's calls (up to ``decode_experts.MAX_TOKENS`` tokens) run two Triton launches
  a layer (``stored_experts_kernels``): the pairs routed to experts the group does not hold
  come out as zeros, so the ids never go to the host;
- a longer call (a prompt) takes the loop over the experts it hits, each matrix a
  ``StoredLinear`` over its slice of the stack: dequantized in tiles into a tensor-core matmul.

Gate, up and down are one stack each, ``[experts, rows, bytes a row]``, in their own types.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hybridmoe.backend.engine.stored_linear import KERNEL_TYPES, StoredLinear, _cdiv, _tables
from hybridmoe.backend.formats import quant
from hybridmoe.backend.formats.quant import QuantTensor

# (rows per program, columns per step) by kernel, on a card (provisional: scripts/gpu_check.py
# times the alternatives) and in Triton's interpreter, whose cost is per program and operation.
BLOCKS = {
    "cuda": {"gate_up": (8, 256), "down": (16, 256)},
    "cpu": {"gate_up": (64, 512), "down": (64, 512)},
}


def blocks_of(t: object) -> tuple[GGMLQuantizationType, torch.Tensor] | None:
    """A 2-D GGUF block matrix's type and bytes as [rows, bytes a row] (a view); None for
    anything the kernels do not read (a float tensor, another layout or type)."""
    if not (isinstance(t, QuantTensor) and t.layout == "gguf" and t.ggml_type in KERNEL_TYPES and t.dim() == 2):
        return None
    rows, cols = t.shape
    block, type_size = GGML_QUANT_SIZES[t.ggml_type]
    return t.ggml_type, t.parts["data"].reshape(rows, cols // block * type_size)


@dataclass(frozen=True)
class StoredStack:
    """One projection (gate, up or down) of all of a group's experts: `w` uint8 [experts, rows,
    bytes a row] in the blocks of `qtype`, `cols` weights a row; `bias` [experts, rows] or None."""

    qtype: GGMLQuantizationType
    w: torch.Tensor
    cols: int
    bias: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.w.shape[1]

    def matrix(self, j: int) -> StoredLinear:
        """Expert j's matrix (its slice of the stack, no copy), for the loop over the experts."""
        return StoredLinear(quant.from_gguf(self.w[j], self.qtype, (self.rows, self.cols)))

    # Worked out once per group: a decode step launches the kernels at every MoE layer.
    @cached_property
    def pointers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks, and the type's grid and sign table on their device."""
        return (self.w, *_tables(self.qtype, self.w.device))

    @cached_property
    def layout(self) -> tuple[int, int]:
        """Bytes from one expert's blocks to the next's, and a row's."""
        return self.w.stride(0), self.w.stride(1)

    def constants(self, prefix: str = "") -> dict[str, int]:
        """The type's compile-time constants (``stored_linear``'s geometry), named with `prefix`."""
        from hybridmoe.backend.engine import stored_linear_kernels as kernels

        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return {f"{prefix}TYPE": int(self.qtype), f"{prefix}QK": block, f"{prefix}TS": type_size,
                f"{prefix}CHUNK": kernels.CHUNKS.get(int(self.qtype), 32)}


def forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, slot_of: torch.Tensor,
            gate: StoredStack, up: StoredStack, down: StoredStack, activation: str, *, alpha: float = 1.702,
            limit: float = 7.0, blocks: dict | None = None) -> torch.Tensor:
    """Sum over the (token, slot) pairs of weight * expert(x[token]) for the experts the stacks
    hold (``slot_of[e]``: expert e's index in them, -1 if not held; ids -1 are skipped), as
    ``decode_experts.forward`` computes it for the other forms.

    x [T, H] in the compute dtype; topk_ids [T, k] int64 and topk_weights [T, k] on x's device.
    Returns [T, H] float32."""
    from hybridmoe.backend.engine import decode_experts_kernels, stored_experts_kernels as kernels
    from hybridmoe.backend.engine.decode_experts import launch_tensors

    where = BLOCKS["cpu" if x.device.type == "cpu" else "cuda"]
    blocks = {**where, **(blocks or {})}
    t, hidden = x.shape
    k = topk_ids.shape[1]
    pairs, inter = t * k, gate.rows
    x, ids, weights, h, y = launch_tensors(x, topk_ids, topk_weights, inter)
    n_experts = slot_of.shape[0]
    has_bias = gate.bias is not None

    block_i, block_k = blocks["gate_up"]
    acts = decode_experts_kernels.ACTS
    act = acts.get(activation, acts["silu"])  # "swish" is silu
    kernels.gate_up_kernel[(pairs, _cdiv(inter, block_i))](
        x, ids, slot_of, h, *gate.pointers, *up.pointers, gate.bias if has_bias else gate.w,
        up.bias if has_bias else up.w, hidden, inter, k, n_experts, *gate.layout, *up.layout, alpha, limit,
        **gate.constants("GATE_"), **up.constants("UP_"), HAS_BIAS=has_bias, ACT=act, BLOCK_I=block_i,
        BLOCK_K=block_k, num_warps=4)

    block_h, block_k = blocks["down"]
    kernels.down_kernel[(pairs, _cdiv(hidden, block_h))](
        h, ids, slot_of, weights, y, x, *down.pointers, down.bias if down.bias is not None else down.w, inter, hidden,
        n_experts, *down.layout, **down.constants(), HAS_BIAS=down.bias is not None, BLOCK_H=block_h,
        BLOCK_K=block_k, num_warps=4)
    return y.view(t, k, hidden).sum(dim=1)
