"""Mixtral's llama.cpp metadata (architecture ``llama``, with experts)."""

from __future__ import annotations

from hybridmoe.backend.convert.gguf_keys import ArchWriter, GGUFKeys
from hybridmoe.backend.models.hf_config import HFConfig


def write(w: GGUFKeys, c: HFConfig) -> None:
    wr = w.writer
    if c.get("sliding_window"):
        raise w.refuse("sliding-window attention is not supported by llama.cpp's llama graph.")
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    head_dim = int(c.get("head_dim") or hidden // heads)
    wr.add_rope_dimension_count(head_dim)
    if head_dim != hidden // heads:
        wr.add_key_length(head_dim)
        wr.add_value_length(head_dim)


WRITER = ArchWriter(write)
