"""GPT-OSS's llama.cpp metadata (architecture ``gpt-oss``)."""

from __future__ import annotations

import logging

from hybridmoe.backend.convert.gguf_keys import ArchWriter, GGUFKeys, head_dim
from hybridmoe.backend.models.hf_config import HFConfig

log = logging.getLogger(__name__)


def write(w: GGUFKeys, c: HFConfig) -> None:
    """GPT-OSS. llama.cpp builds in what this family does not store: the clamped SwiGLU
    (alpha 1.702, limit 7), softmax over the top-k router logits, sinks, and sliding windows
    on a period of layers (``attention.sliding_window_pattern``, 2 unless written)."""
    wr = w.writer
    alpha, limit = float(c.get("swiglu_alpha", 1.702)), float(c.get("swiglu_limit", 7.0))
    if abs(alpha - 1.702) > 1e-6 or abs(limit - 7.0) > 1e-6:
        raise w.refuse(f"swiglu_alpha {alpha} / swiglu_limit {limit}: llama.cpp's gpt-oss graph has 1.702 and "
                       "7.0 built in.")
    if c.get("tie_word_embeddings", False):
        raise w.refuse("tied embeddings: llama.cpp's gpt-oss graph needs its own output head.")
    size = head_dim(c)
    wr.add_key_length(size)
    wr.add_value_length(size)
    wr.add_rope_dimension_count(size)
    wr.add_expert_feed_forward_length(int(c.require("intermediate_size")))
    n_layers = int(c.require("num_hidden_layers"))
    types = c.get("layer_types")
    if types is None:  # transformers' default: even layers slide
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding):
        wr.add_sliding_window(int(c.require("sliding_window")))
    wr.add_sliding_window_pattern(_swa_period(w, sliding))
    # YaRN: a config with "truncate": false (the published GPT-OSS ones) asks for the ramp
    # between fractional correction dims; ggml always rounds them outwards (floor / ceil), as
    # truncate=true does, and has no key to say otherwise. llama.cpp's own converter writes
    # these models the same way (every published GPT-OSS GGUF runs so): the difference moves
    # the frequencies at the ramp's two ends a little (dims 8..18 of 64 for gpt-oss-20b/120b),
    # so the file is written as llama.cpp runs it, and the engine reads it back alike.
    rope = w.rope_params()
    if rope.kind == "yarn" and rope.get("truncate", True) is False:
        log.warning("%s: YaRN 'truncate: false' is written as llama.cpp computes it (truncated correction "
                    "range); logits differ slightly from transformers'", w.source)


def _swa_period(w: GGUFKeys, sliding: list[bool]) -> int:
    """llama.cpp's sliding_window_pattern p for per-layer sliding flags: layer i slides when
    i % p < p - 1 (p = 0: every layer; 1: none). A layout no period gives is refused."""
    n = len(sliding)
    for period in (0, *range(1, n + 1)):
        if all(s == (period == 0 or i % period < period - 1) for i, s in enumerate(sliding)):
            return period
    raise w.refuse("its sliding-window layers (layer_types) follow no fixed period, which llama.cpp's "
                   "gpt-oss graph cannot represent.")


WRITER = ArchWriter(write)
