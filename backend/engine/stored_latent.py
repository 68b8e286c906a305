"""MLA's kv_b on a GPU, as the model file stores it (``StoredLatent``).

Latent attention reads all of kv_b, each head's key and value maps on the latent (W_UK, W_UV),
for every decode step: the absorbed form folds W_UK into the queries and applies W_UV to the
attended latents. Widened to the compute dtype at load, as the engine held it before, DeepSeek-V3
Q4_K_M's kv_b took 1.9 GiB of the card where the file holds 0.6 (its attn_k_b in Q5_0, attn_v_b
in Q4_K), and a decode step read 3.2 times the file's bytes of it. Here it stays in its GGUF
blocks on the card, as ``stored_linear`` holds the projections, in either of the file's forms:

- whole (an older GGUF's ``attn_kv_b``): rows [H * (nope + v), kv_lora], head h's nope rows
  (W_UK) then its v rows (W_UV), each row kv_lora wide in blocks. W_UK folded into a query is
  x^T W over the head's nope rows, its output along the blocks' axis
  (``head_gemv_t_kernel``); W_UV after attention a GEMV over its v rows (``head_gemv_kernel``);
- split (``attn_k_b``, ``attn_v_b``: ``GGUFWeights.kv_b_split``): k_b rows [H * kv_lora, nope],
  each head's W_UK transposed, so folding it into the query is a GEMV over the head's kv_lora
  rows (rows of nope = 128 weights: a K-quant file stores them in a 32-weight type); v_b rows
  [H * v, kv_lora] as whole kv_b's v rows. A part the kernels do not read (a float one, where
  a file keeps k_b in f16) is held in the compute dtype, as the plan counts it.

The products (``query``, ``values``) are Triton launches with the heads as a grid axis
(``stored_latent_kernels``), each head its own rows and its own input vectors, up to
``GEMV_TOKENS`` tokens a launch; every weight is dequantized once a launch from its block
(``stored_linear_kernels._tile``), so a decode step reads the stored bytes only. Beyond
``GEMV_CALLS`` launches' worth of tokens (many conversations' decode rows, a prompt's absorbed
rows) the layer's kv_b is dequantized in the compute dtype for the call into tensor-core
matmuls; the expanded form (prompts) takes it dequantized so too (``dense``), as ``stored_linear``
widens a prompt's tiles.

Where Triton cannot build the kernels for a card, the calls on that device dequantize with the
torch dequantizers instead (``stored_linear``'s fallback and its log line, shared: the same
kernels' helpers failed there).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.backend.engine import stored_linear
from hybridmoe.backend.engine.stored_linear import GEMV_TOKENS, StoredLinear, _cdiv, _tables
from hybridmoe.backend.formats.weights import WeightSource, dense, require

# Launches of up to GEMV_TOKENS tokens each a call takes before it dequantizes the layer's kv_b
# instead: each launch reads the stored bytes (0.56-1.06 bytes a weight for Q4_K-Q8_0), the
# dequantized copy costs the stored bytes, two bytes a weight written and two read again.
GEMV_CALLS = 4

# (rows per program, columns per step) of the two kernels on a card (scripts/gpu_check.py times
# the alternatives) and in Triton's interpreter (the tests' CPU tensors: blocks as large as the
# tiny models' maps).
GEMV_BLOCKS = {"cuda": (8, 128), "cpu": (128, 512)}
GEMV_T_BLOCKS = {"cuda": (8, 128), "cpu": (128, 512)}

Map = StoredLinear | torch.Tensor  # one matrix of kv_b: in its blocks, or in the compute dtype


class StoredLatent(nn.Module):
    """kv_b of `n_heads` heads on a card: `whole` [H * (nope + v), C] in blocks, or split into
    `k_b` [H * C, nope] and `v_b` [H * v, C], each in blocks or (a float part) in the compute dtype."""

    def __init__(self, n_heads: int, nope: int, v_dim: int, kv_lora: int, *, whole: StoredLinear | None = None,
                 k_b: Map | None = None, v_b: Map | None = None):
        super().__init__()
        self.n_heads, self.nope, self.v_dim, self.kv_lora = n_heads, nope, v_dim, kv_lora
        if (whole is None) == (k_b is None or v_b is None):
            raise ValueError("StoredLatent holds kv_b whole or as its two parts")
        self.whole = whole
        for key, part in (("k_b", k_b), ("v_b", v_b)):
            if isinstance(part, torch.Tensor):
                self.register_buffer(key, part, persistent=False)
            else:  # a StoredLinear (a submodule), or None beside whole
                setattr(self, key, part)

    def extra_repr(self) -> str:
        forms = ("whole",) if self.whole is not None else ("k_b", "v_b")
        held = ", ".join(f"{f} {m.dtype if isinstance(m, torch.Tensor) else m.qtype.name}"
                         for f in forms for m in (getattr(self, f),))
        return f"heads={self.n_heads}, nope={self.nope}, v={self.v_dim}, kv_lora={self.kv_lora}: {held}"

    def reads_stored(self, n: int) -> bool:
        """Whether a call of n rows reads the blocks in place (else the layer is dequantized for it)."""
        return n <= GEMV_TOKENS * GEMV_CALLS

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj [H * (nope + v), kv_lora] in `dtype`, dequantized now (the expanded form's)."""
        h, c = self.n_heads, self.kv_lora
        if self.whole is not None:
            return self.whole.dequantize(dtype)
        k = _widened(self.k_b, dtype).view(h, c, self.nope).transpose(1, 2)
        v = _widened(self.v_b, dtype).view(h, self.v_dim, c)
        return torch.cat((k, v), dim=1).reshape(-1, c)

    def query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """W_UK folded into the queries: q_nope [H, n, nope] -> [H, n, kv_lora] in q_nope's dtype."""
        h, c, nope, v = self.n_heads, self.kv_lora, self.nope, self.v_dim
        if self.whole is not None:  # x^T W over each head's nope rows
            return _product(self.whole, q_nope, h, nope, nope + v, 0, transposed=True)
        if not isinstance(self.k_b, torch.Tensor):  # in blocks: each head's kv_lora rows of nope
            return _product(self.k_b, q_nope, h, c, c, 0, transposed=False)
        return torch.matmul(q_nope, self.k_b.view(h, c, nope).transpose(1, 2).to(q_nope.dtype))

    def values(self, attended: torch.Tensor) -> torch.Tensor:
        """W_UV after attention: attended [H, n, kv_lora] -> [H, n, v] in attended's dtype."""
        h, c, nope, v = self.n_heads, self.kv_lora, self.nope, self.v_dim
        if self.whole is not None:
            return _product(self.whole, attended, h, v, nope + v, nope, transposed=False)
        if not isinstance(self.v_b, torch.Tensor):
            return _product(self.v_b, attended, h, v, v, 0, transposed=False)
        return torch.matmul(attended, self.v_b.view(h, v, c).transpose(1, 2).to(attended.dtype))


def _widened(part: Map, dtype: torch.dtype) -> torch.Tensor:
    return part.to(dtype) if isinstance(part, torch.Tensor) else part.dequantize(dtype)


def _product(lin: StoredLinear, x: torch.Tensor, n_heads: int, rows: int, head_rows: int, row0: int, *,
             transposed: bool) -> torch.Tensor:
    """Per head h, with W_h its `rows` rows from h * head_rows + row0 of `lin`'s matrix, and
    x [H, n, width]: x[h] W_h^T ([H, n, rows]), or `transposed`, x[h] W_h ([H, n, in_features])."""
    n = x.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    device = x.device
    if n > GEMV_TOKENS * GEMV_CALLS or device in stored_linear._failed:
        return _by_matmul(lin, x, n_heads, rows, head_rows, row0, transposed)
    from hybridmoe.backend.engine import stored_latent_kernels as kernels
    from hybridmoe.backend.engine import stored_linear_kernels

    k = lin.in_features
    y = torch.empty((n_heads, n, k if transposed else rows), dtype=x.dtype, device=device)
    if n == 0:
        return y
    where = "cpu" if device.type == "cpu" else "cuda"
    block_r, block_k = (GEMV_T_BLOCKS if transposed else GEMV_BLOCKS)[where]
    grid = (n_heads, _cdiv(k, block_k) if transposed else _cdiv(rows, block_r))
    kernel = kernels.head_gemv_t_kernel if transposed else kernels.head_gemv_kernel
    tables = _tables(lin.qtype, device)
    try:
        for t0 in range(0, n, GEMV_TOKENS):
            t = min(GEMV_TOKENS, n - t0)
            xs, ys = x[:, t0 : t0 + t], y[:, t0 : t0 + t]
            kernel[grid](xs, xs.stride(0), xs.stride(1), lin.data, *tables, ys, ys.stride(0), ys.stride(1), t, rows, k,
                         head_rows, row0, lin.row_bytes, **lin._geometry(stored_linear_kernels),
                         BLOCK_T=1 << (t - 1).bit_length(), BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4)
    except Exception as error:  # noqa: BLE001 - a card or Triton build the kernels cannot run on
        stored_linear._fail(device, error)
        return _by_matmul(lin, x, n_heads, rows, head_rows, row0, transposed)
    return y


def _by_matmul(lin: StoredLinear, x: torch.Tensor, n_heads: int, rows: int, head_rows: int, row0: int,
               transposed: bool) -> torch.Tensor:
    """The product through the dequantized matrix (many rows, or a device the kernels failed on)."""
    w = lin.dequantize(x.dtype).view(n_heads, head_rows, lin.in_features)[:, row0 : row0 + rows]
    return torch.matmul(x, w if transposed else w.transpose(1, 2))


def stored_latent(weights: WeightSource, name: str, heads: tuple[int, int], n_heads: int, nope: int, v_dim: int,
                  kv_lora: int, device: torch.device, dtype: torch.dtype) -> StoredLatent | None:
    """kv_b (`name`, kv_b_proj's HF name) as stored, for `heads` (first, end: a card's share
    under tensor parallelism, or all `n_heads`), where `device` holds always-read matrices as
    stored (``stored_linear.serves``) and the file stores kv_b, whole or split, in GGUF blocks;
    else None (the caller loads kv_b whole in the compute dtype)."""
    if not stored_linear.serves(device):
        return None
    (h0, h1), c = heads, kv_lora
    split = getattr(weights, "kv_b_split", None)
    parts = split(name) if split is not None else None
    if parts is None:  # whole, or not a GGUF: the loader checks it against the config
        stored = require(weights, name, (n_heads * (nope + v_dim), c))
        whole = stored_linear.stored_linear(stored[h0 * (nope + v_dim) : h1 * (nope + v_dim)], None, device)
        return None if whole is None else StoredLatent(h1 - h0, nope, v_dim, c, whole=whole)
    k_b, v_b = parts[0][h0 * c : h1 * c], parts[1][h0 * v_dim : h1 * v_dim]
    if tuple(k_b.shape) != ((h1 - h0) * c, nope) or tuple(v_b.shape) != ((h1 - h0) * v_dim, c):
        return None  # loaded whole, whose check names it
    k_map, v_map = (stored_linear.stored_linear(p, None, device) for p in (k_b, v_b))
    if k_map is None and v_map is None:  # both float: as many bytes joined in the compute dtype
        return None
    return StoredLatent(h1 - h0, nope, v_dim, c, k_b=k_map if k_map is not None else dense(k_b, dtype, device),
                        v_b=v_map if v_map is not None else dense(v_b, dtype, device))
