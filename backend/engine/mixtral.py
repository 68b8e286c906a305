"""Mixtral: Llama attention (optionally one sliding window for all layers), every layer
MoE under ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down);
softmax routing, always renormalised, weights kept in float32."""

from __future__ import annotations

from hybridmoe.backend.engine import qwen3_moe
from hybridmoe.backend.engine.hf_config import HFConfig

BUILD_OPTIONS = {"rms_eps_default": 1e-5}



def moe_layers(cfg: HFConfig) -> list[int]:
    return list(range(int(cfg.require("num_hidden_layers"))))


def attention(b, i: int):
    cfg = b.config
    hd = qwen3_moe.head_dim(cfg)
    return b.gqa(i, n_heads=int(cfg.require("num_attention_heads")), n_kv_heads=int(cfg.require("num_key_value_heads")),
                 head_dim=hd, rotary=b.rotary(hd, default_theta=1e6), window=cfg.get("sliding_window"))


def feed_forward(b, i: int):
    cfg = b.config
    # Hub checkpoints name the block block_sparse_moe; transformers' fused layout names it mlp.
    p = f"model.layers.{i}.block_sparse_moe"
    if f"{p}.gate.weight" not in b.weights and f"model.layers.{i}.mlp.gate.weight" in b.weights:
        p = f"model.layers.{i}.mlp"
    router = qwen3_moe.softmax_router(b, i, p, normalize=True, float32_weights=True)
    return b.moe(i, p, router, cfg.n_routed_experts(), int(cfg.require("intermediate_size")), names=("w1", "w3", "w2"))
