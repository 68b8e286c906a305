"""Qwen1.5/Qwen2-MoE's llama.cpp metadata (architecture ``qwen2moe``)."""

from __future__ import annotations

from hybridmoe.backend.convert.gguf_keys import ArchWriter, GGUFKeys
from hybridmoe.backend.models.families.qwen3_moe.gguf import write_qwen_moe_keys
from hybridmoe.backend.models.hf_config import HFConfig


def write(w: GGUFKeys, c: HFConfig) -> None:
    # Unlike qwen3moe's, llama.cpp's qwen2moe graph never renormalises the top-k weights.
    if c.get("norm_topk_prob", False):
        raise w.refuse("norm_topk_prob true: llama.cpp's qwen2moe graph never normalises the "
                       "top-k expert weights, so the converted model would compute differently.")
    write_qwen_moe_keys(w, c)
    w.writer.add_expert_shared_feed_forward_length(int(c.require("shared_expert_intermediate_size")))


WRITER = ArchWriter(write)
