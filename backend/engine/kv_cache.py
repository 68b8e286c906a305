"""Preallocated attention caches, one per layer, for one sequence (batch size 1).

The cache is explicit state: a forward call at `start_pos` writes the new tokens' entries at
positions start_pos.., and attends over positions 0..start_pos+T-1. Calling again with an
earlier `start_pos` rewinds (the entries past it are simply overwritten), which is how a
chat keeps the shared prefix of a conversation.

- ``KVCache``: keys and values per KV head (grouped-query attention), full context.
- ``SlidingKVCache``: a ring of `window` slots for sliding-window layers (GPT-OSS), which
  never need more; docs/sizing.md counts them that way.
- ``LatentCache``: multi-head latent attention keeps only the compressed latent
  (kv_lora_rank) and the shared rotary key (qk_rope_head_dim) per token.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.backend.errors import HybridMoeError


class ContextFullError(HybridMoeError):
    """The conversation has outgrown the context the model was loaded with."""


def check_span(start_pos: int, n: int, filled: int, capacity: int) -> None:
    """A call writing n tokens at start_pos must follow what is held and fit the capacity."""
    if start_pos < 0 or start_pos > filled:
        raise ValueError(f"start_pos {start_pos} skips positions: the cache holds {filled}")
    if start_pos + n > capacity:
        raise ContextFullError(
            f"the conversation needs {start_pos + n} tokens of context, the model was loaded with {capacity}",
            "Start a new conversation, or load the model with a larger context.",
        )


class KVCache(nn.Module):
    def __init__(self, n_kv_heads: int, key_dim: int, value_dim: int, capacity: int, dtype, device):
        super().__init__()
        self.capacity = capacity
        self.filled = 0
        self.register_buffer("k", torch.zeros(1, n_kv_heads, capacity, key_dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(1, n_kv_heads, capacity, value_dim, dtype=dtype, device=device), persistent=False)

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Store k, v [1, n_kv, T, d] at start_pos; return all keys/values 0..start_pos+T-1.

        The third value (positions of the returned keys) is None: they are 0..S-1.
        """
        n = k.shape[2]
        check_span(start_pos, n, self.filled, self.capacity)
        end = start_pos + n
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        self.filled = end
        return self.k[:, :, :end], self.v[:, :, :end], None


class CacheRewindError(ValueError):
    """A rewind further back than a sliding-window ring still reaches: the caller has to
    prefill the conversation again from the start."""


class SlidingKVCache(nn.Module):
    """Keys/values of a sliding-window layer in a ring of `window + rewind` slots.

    The layer attends to the last `window` positions only; the `rewind` extra slots keep
    older ones so that a conversation can be rewound by up to that many tokens (regenerating
    an answer) without prefilling it again.
    """

    def __init__(self, n_kv_heads: int, key_dim: int, value_dim: int, window: int, capacity: int, dtype, device,
                 *, rewind: int = 0):
        super().__init__()
        self.window = window
        self.capacity = capacity
        self.slots = min(capacity, window + rewind)
        self.filled = 0
        self.register_buffer("k", torch.zeros(1, n_kv_heads, self.slots, key_dim, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(1, n_kv_heads, self.slots, value_dim, dtype=dtype, device=device), persistent=False)
        # Absolute position held by each slot (-1: empty).
        self.register_buffer("pos", torch.full((self.slots,), -1, dtype=torch.long, device=device), persistent=False)

    def check_rewind(self, start_pos: int) -> None:
        """The new queries need the window before start_pos; the ring holds the last `slots`
        positions written."""
        oldest_kept = max(0, self.filled - self.slots)
        if start_pos > 0 and max(0, start_pos - self.window + 1) < oldest_kept:
            raise CacheRewindError(
                f"cannot rewind a sliding-window cache holding positions {oldest_kept}..{self.filled - 1} to {start_pos}")

    def update(self, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store k, v [1, n_kv, T, d]; return the keys/values the new queries may see and
        their absolute positions (the caller masks by position and window)."""
        n = k.shape[2]
        check_span(start_pos, n, self.filled, self.capacity)
        self.check_rewind(start_pos)
        new_pos = torch.arange(start_pos, start_pos + n, device=k.device)
        if start_pos == 0:
            keys, values, positions = k, v, new_pos
            self.pos.fill_(-1)  # a new sequence: nothing held is valid
        else:
            # Earlier tokens within the window (entries at or past start_pos are stale after a rewind).
            held = (self.pos >= 0) & (self.pos < start_pos) & (self.pos > start_pos - self.window)
            slots = held.nonzero().squeeze(1)
            keys = torch.cat((self.k[:, :, slots], k), dim=2)
            values = torch.cat((self.v[:, :, slots], v), dim=2)
            positions = torch.cat((self.pos[slots], new_pos))
        # Write the last `slots` new tokens into their slots (after reading the old ones).
        keep = min(n, self.slots)
        slot = new_pos[n - keep :] % self.slots
        self.k[:, :, slot] = k[:, :, n - keep :]
        self.v[:, :, slot] = v[:, :, n - keep :]
        self.pos[slot] = new_pos[n - keep :]
        self.filled = start_pos + n
        return keys, values, positions


class LatentCache(nn.Module):
    """One row per token: [latent (kv_lora_rank) | rotary key (rope_dim)], so that the absorbed
    attention reads keys as a view of the cache and values as a view of its first columns."""

    def __init__(self, kv_lora_rank: int, rope_dim: int, capacity: int, dtype, device):
        super().__init__()
        self.capacity = capacity
        self.kv_lora_rank = kv_lora_rank
        self.filled = 0
        self.register_buffer("kv", torch.zeros(capacity, kv_lora_rank + rope_dim, dtype=dtype, device=device), persistent=False)

    def update(self, latent: torch.Tensor, rope_key: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Store latent [T, kv_lora_rank] and rope_key [T, rope_dim]; return rows 0..start_pos+T-1."""
        n = latent.shape[0]
        check_span(start_pos, n, self.filled, self.capacity)
        end = start_pos + n
        self.kv[start_pos:end, : self.kv_lora_rank] = latent
        self.kv[start_pos:end, self.kv_lora_rank :] = rope_key
        self.filled = end
        return self.kv[:end]


def causal_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor | None, n_keys: int, window: int | None
) -> torch.Tensor:
    """Boolean [T, S] mask (True = may attend): keys at or before each query, within the
    window when there is one (a window of W keeps the query and the W-1 before it)."""
    if k_pos is None:
        k_pos = torch.arange(n_keys, device=q_pos.device)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed
