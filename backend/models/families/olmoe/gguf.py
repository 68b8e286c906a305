"""OLMoE's llama.cpp metadata (architecture ``olmoe``)."""

from __future__ import annotations

from hybridmoe.backend.convert.gguf_keys import ArchWriter, GGUFKeys
from hybridmoe.backend.models.hf_config import HFConfig


def write(w: GGUFKeys, c: HFConfig) -> None:
    wr = w.writer
    if c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob true: llama.cpp's olmoe graph never normalises the top-k "
                       "expert weights.")
    hidden, heads = int(c.require("hidden_size")), int(c.require("num_attention_heads"))
    wr.add_rope_dimension_count(hidden // heads)
    if c.get("clip_qkv"):
        wr.add_clamp_kqv(float(c.get("clip_qkv")))


WRITER = ArchWriter(write)
