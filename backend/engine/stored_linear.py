"""Dense projections on a GPU in the GGUF blocks the file stores (``StoredLinear``).

Attention (MLA's q_a/q_b/kv_a and output projections included), shared experts, dense MLPs and
the head are read in full for every token. Widened to the compute dtype at load, as the engine
held them before, a Q4_K matrix took 3.6x its file size on the card: DeepSeek-V3 Q4_K_M's
always-read weights 32.1 GiB where llama.cpp holds them in 9.8, too much for a 24-32 GB card.
Here they stay as stored on the card and:

- a call of up to ``GEMV_TOKENS`` tokens (decode, a few conversations' decode) runs one Triton
  launch (``stored_linear_kernels.gemv_kernel``) that dequantizes each weight once from its block
  and multiplies it into every token's float32 sum: a decode step reads the stored bytes only;
- a longer call (a prompt) dequantizes ``TILE_BYTES`` of rows at a time in the compute dtype
  (``dequantize_kernel``) into a tensor-core matmul, so the widened copy exists for one tile.

Every GGUF block type the engine reads is served (``KERNEL_TYPES``: the types of
``formats.quant``'s dequantizers, k-quants, legacy quants, IQ4, MXFP4 and the grid i-quants), with
the block geometry of gguf's ``GGML_QUANT_SIZES``. Float matrices (bf16/fp16/f32) are not
stored here: the loader holds them in the compute dtype, as many bytes as bf16/fp16 store.
MLA's kv_b, whose per-head products are no projection, is held in these blocks too, with
kernels of its own over the same dequantizing (``stored_latent``).

Numerics: float32 sums rounded once to the compute dtype, like PyTorch's matmul over the
dequantized matrix (the reference, ``formats.quant.linear``); the dequantized weights are the
reference dequantizers' bit for bit.

Where Triton cannot build the kernels for a card, the calls on that device dequantize with the
torch dequantizers instead (the same values, more launches), and the reason is logged once.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import ClassVar

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from hybridmoe.backend.engine.decode_experts import triton_available
from hybridmoe.backend.formats import iquants, quant
from hybridmoe.backend.formats.quant import QuantTensor

log = logging.getLogger(__name__)

# GGML types the kernels dequantize: every block type the engine reads (floats are held as tensors).
KERNEL_TYPES = frozenset(quant.GGUF_SUPPORTED_TYPES - set(quant.GGUF_FLOAT_TYPES))

# Tokens per call up to which the GEMV kernel runs: it dequantizes each weight once for all tokens,
# and its float32 sums for up to 8 tokens stay in registers; beyond that the tensor cores'
# matmul over a dequantized tile does the arithmetic better.
GEMV_TOKENS = 8

# Dequantized bytes a prompt's call widens at a time: DeepSeek-V3's head (1.85 GB in bf16) goes
# in 28 tiles, its output projection (235 MB) in 4, its q_a projection in one.
TILE_BYTES = 64 << 20

# (rows per program, columns per step) of the kernels on a card (scripts/gpu_check.py times the
# alternatives), and in Triton's interpreter (the tests' CPU tensors), whose cost is per program
# and per operation, not per element: there blocks as large as the tiny models' matrices.
GEMV_BLOCKS = {"cuda": (8, 128), "cpu": (128, 512)}
DEQUANT_BLOCKS = {"cuda": (16, 128), "cpu": (128, 512)}

_failed: dict[torch.device, str] = {}


def serves(device: torch.device) -> bool:
    """Whether always-read matrices on `device` are held as stored (a CUDA card with Triton).
    The tests make the CPU stand in for the card (the kernels then run in Triton's interpreter)."""
    return device.type == "cuda" and triton_available()


@cache
def _tables(qtype: GGMLQuantizationType, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' float32 grid and int32 sign table for `qtype` on `device` (one float where
    the type has none: the pointer must point somewhere)."""
    signs = torch.zeros(1, dtype=torch.int32, device=device)
    if qtype in (GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS):
        return torch.tensor(quant._IQ4_GRID, dtype=torch.float32, device=device), signs
    if qtype == GGMLQuantizationType.MXFP4:
        return torch.tensor(quant._MXFP4_GRID_X2, dtype=torch.float32, device=device), signs
    if qtype in iquants.DEQUANTIZERS:
        grid_of = "IQ1_S" if qtype == GGMLQuantizationType.IQ1_M else qtype.name  # IQ1_M shares IQ1_S' grid
        grid = iquants._grid(grid_of, device).reshape(-1).contiguous()
        return grid, iquants._signs(device).to(torch.int32)
    return torch.zeros(1, dtype=torch.float32, device=device), signs


class StoredLinear(nn.Module):
    """y = x W^T (+ b) from a GGUF matrix `stored` [out, in] held in its blocks on its device."""

    runs_native: ClassVar[bool] = False

    def __init__(self, stored: QuantTensor, bias: torch.Tensor | None = None):
        super().__init__()
        qtype = stored.ggml_type
        if stored.layout != "gguf" or qtype not in KERNEL_TYPES or stored.dim() != 2:
            raise ValueError(f"StoredLinear reads 2-D GGUF block matrices, not {stored!r}")
        self.qtype = qtype
        self.block, self.type_size = GGML_QUANT_SIZES[qtype]
        self.out_features, self.in_features = int(stored.shape[0]), int(stored.shape[1])
        self.row_bytes = self.in_features // self.block * self.type_size
        # The blocks as one contiguous [out, row_bytes] byte matrix: a row-gathered view (a
        # llama GGUF's Q/K permutation undone) would otherwise be read with gaps.
        self.register_buffer("data", stored.parts["data"].reshape(self.out_features, self.row_bytes).contiguous(),
                             persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    @property
    def stored(self) -> QuantTensor:
        return quant.from_gguf(self.data, self.qtype, (self.out_features, self.in_features))

    def extra_repr(self) -> str:
        return f"{self.qtype.name}, in={self.in_features}, out={self.out_features}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= GEMV_TOKENS:
            out = self._gemv(flat)
        else:
            out = torch.empty((flat.shape[0], self.out_features), dtype=x.dtype, device=x.device)
            rows = max(1, TILE_BYTES // (self.in_features * x.element_size()))
            for a in range(0, self.out_features, rows):
                b = min(a + rows, self.out_features)
                bias = None if self.bias is None else self.bias[a:b].to(x.dtype)
                out[:, a:b] = F.linear(flat, self.dequantize(x.dtype, a, b), bias)
        return out.reshape(*lead, self.out_features)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The same product, by the name the routed experts' matrix forms share (``experts._linear``:
        a GPU expert held as stored is one of these over its slice of the stack)."""
        return self(x)

    def _gemv(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.device in _failed:
            return self._by_pytorch(flat)
        from hybridmoe.backend.engine import stored_linear_kernels as kernels

        y = torch.empty((flat.shape[0], self.out_features), dtype=torch.float32, device=flat.device)
        if flat.shape[0]:
            block_r, block_k = GEMV_BLOCKS["cpu" if flat.device.type == "cpu" else "cuda"]
            grid, signs = _tables(self.qtype, flat.device)
            try:
                kernels.gemv_kernel[(_cdiv(self.out_features, block_r),)](
                    flat.contiguous(), self.data, grid, signs, y, flat.shape[0], self.out_features, self.in_features,
                    self.row_bytes, **self._geometry(kernels), BLOCK_T=1 << (flat.shape[0] - 1).bit_length(),
                    BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
            except Exception as error:  # noqa: BLE001 - a card or Triton build the kernels cannot run on
                _fail(flat.device, error)
                return self._by_pytorch(flat)
        if self.bias is not None:
            y += self.bias.float()
        return y.to(flat.dtype)

    def _geometry(self, kernels) -> dict[str, int]:
        """The kernels' compile-time constants for this matrix's type: the type, its weights and
        bytes per block, and the weights per chunk its scales are shared over."""
        return {"TYPE": int(self.qtype), "QK": self.block, "TS": self.type_size,
                "CHUNK": kernels.CHUNKS.get(int(self.qtype), 32)}

    def _by_pytorch(self, flat: torch.Tensor) -> torch.Tensor:
        """The call through the dequantized matrix (a device the kernels failed on)."""
        return F.linear(flat, self.dequantize(flat.dtype), None if self.bias is None else self.bias.to(flat.dtype))

    def dequantize(self, dtype: torch.dtype, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Rows start:end of the matrix in `dtype` on its device (all rows by default)."""
        return self._dequantized(self.data[start : self.out_features if end is None else end], dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows `ids` [n] in `dtype`: an embedding lookup, only those rows' blocks dequantized."""
        return self._dequantized(self.data[ids], dtype)

    def _dequantized(self, data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The rows whose blocks are `data` [n, row_bytes], in `dtype`."""
        n = data.shape[0]
        if data.device in _failed or not triton_available():
            return quant.from_gguf(data, self.qtype, (n, self.in_features)).dequantize(dtype)
        from hybridmoe.backend.engine import stored_linear_kernels as kernels

        out = torch.empty((n, self.in_features), dtype=dtype, device=data.device)
        if n == 0:
            return out
        block_r, block_k = DEQUANT_BLOCKS["cpu" if data.device.type == "cpu" else "cuda"]
        grid, signs = _tables(self.qtype, data.device)
        try:
            kernels.dequantize_kernel[(_cdiv(n, block_r), _cdiv(self.in_features, block_k))](
                data, grid, signs, out, n, self.in_features, self.row_bytes, **self._geometry(kernels),
                BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
        except Exception as error:  # noqa: BLE001 - as in _gemv
            _fail(data.device, error)
            return quant.from_gguf(data, self.qtype, (n, self.in_features)).dequantize(dtype)
        return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fail(device: torch.device, error: Exception) -> None:
    _failed[device] = f"{type(error).__name__}: {error}"
    log.warning("GPU stored-form kernels unavailable on %s (%s); always-read projections there are dequantized "
                "with PyTorch for each call instead", device, _failed[device])


def stored_linear(stored, bias: torch.Tensor | None, device: torch.device) -> StoredLinear | None:
    """A StoredLinear over `stored` (moved to `device`) where `device` holds always-read matrices
    as stored and `stored` is a GGUF block matrix; else None (the loader widens it)."""
    if not (serves(device) and isinstance(stored, QuantTensor) and stored.layout == "gguf"
            and stored.ggml_type in KERNEL_TYPES and stored.dim() == 2):
        return None
    return StoredLinear(stored.to(device), None if bias is None else bias.to(device))
