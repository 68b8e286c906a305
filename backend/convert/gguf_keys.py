"""What a family's GGUF writer (``models/families/<family>/gguf.py``) writes with.

The converter writes the keys every architecture shares (``GGUFKeys.common``: sizes, heads,
experts, rotary embedding); each family's ``gguf.py`` then writes the keys of its llama.cpp
architecture, or refuses a config that architecture's graph cannot represent. A family's
``gguf.py`` provides ``WRITER = ArchWriter(write, ...)``; ``hparams`` finds it by the
family's registry name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import gguf

from hybridmoe.backend.errors import UnsupportedModelError
from hybridmoe.backend.models.hf_config import HFConfig, RopeParams

USE_GGUF = "Use a GGUF published for this model, or run the checkpoint with the embedded engine."


@dataclass(frozen=True)
class ArchWriter:
    """The keys one llama.cpp architecture needs beyond the common ones."""

    write: Callable[[GGUFKeys, HFConfig], None]
    # MLA in llama.cpp's absorbed form has one shared "KV head" (see the deepseek writer).
    one_kv_head: bool = False


def head_dim(c: HFConfig) -> int:
    """The per-head size: ``head_dim`` when the config gives one, else hidden / heads."""
    return int(c.get("head_dim") or int(c.require("hidden_size")) // int(c.require("num_attention_heads")))


class GGUFKeys:
    """A GGUF being written, the config it is written from and the family's defaults."""

    def __init__(self, writer: gguf.GGUFWriter, cfg: HFConfig, source: str, family: ModuleType, n_mtp: int):
        self.writer = writer
        self.cfg = cfg
        self.source = source
        self.family = family
        self.n_mtp = n_mtp

    def refuse(self, what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.source}: {what}", USE_GGUF)

    def common(self, n_layers: int, head_count_kv: int | None) -> None:
        c, wr = self.cfg, self.writer
        wr.add_context_length(int(c.require("max_position_embeddings")))
        wr.add_embedding_length(int(c.require("hidden_size")))
        wr.add_block_count(n_layers)
        if c.get("intermediate_size"):
            wr.add_feed_forward_length(int(c.get("intermediate_size")))
        wr.add_head_count(int(c.require("num_attention_heads")))
        wr.add_head_count_kv(head_count_kv or int(c.get("num_key_value_heads") or c.require("num_attention_heads")))
        wr.add_layer_norm_rms_eps(float(c.get("rms_norm_eps", self.family.RMS_EPS_DEFAULT)))
        wr.add_vocab_size(int(c.require("vocab_size")))
        n_experts = c.n_routed_experts()
        wr.add_expert_count(n_experts)
        wr.add_expert_used_count(int(c.require("num_experts_per_tok")))
        self.rope()

    def rope_params(self) -> RopeParams:
        """The config's rotary embedding, with the family's defaults for what it leaves out."""
        return self.cfg.rope(default_theta=self.family.ROPE_THETA_DEFAULT,
                             default_partial=self.family.PARTIAL_ROTARY_DEFAULT)

    def rope(self) -> None:
        rope = self.rope_params()
        wr = self.writer
        wr.add_rope_freq_base(rope.theta)
        if rope.partial_rotary_factor != 1.0 and not self.family.GGUF_PARTIAL_ROTARY:
            raise self.refuse(f"partial rotary embeddings (factor {rope.partial_rotary_factor}) are not "
                              "supported by this converter.")
        if rope.kind == "default":
            return
        factor = float(rope.get("factor", 1.0))
        if rope.kind == "linear":
            wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            wr.add_rope_scaling_factor(factor)
        elif rope.kind == "yarn":
            wr.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            wr.add_rope_scaling_factor(factor)
            wr.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings")))
            if rope.get("beta_fast") is not None:
                wr.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast")))
            if rope.get("beta_slow") is not None:
                wr.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow")))
        else:
            raise self.refuse(f"rope scaling {rope.kind!r} is not supported by this converter.")
