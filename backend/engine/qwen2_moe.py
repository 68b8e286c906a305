"""Qwen1.5/Qwen2-MoE: attention with q/k/v biases (no q/k norm), softmax routing, and one
shared expert whose output is scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from hybridmoe.backend.engine import qwen3_moe
from hybridmoe.backend.engine.hf_config import HFConfig

BUILD_OPTIONS = {"rms_eps_default": 1e-6}

moe_layers = qwen3_moe.moe_layers


def _window(cfg: HFConfig, i: int) -> int | None:
    types = cfg.get("layer_types")
    if types is not None:
        sliding = types[i] == "sliding_attention"
    else:
        # transformers' derivation when the config does not list layer types.
        sliding = bool(cfg.get("use_sliding_window", False)) and (i + 1) % 2 == 1 and i < int(cfg.get("max_window_layers", 28))
    return (cfg.get("sliding_window") or None) if sliding else None


def attention(b, i: int):
    cfg = b.config
    hd = qwen3_moe.head_dim(cfg)
    return b.gqa(i, n_heads=int(cfg.require("num_attention_heads")), n_kv_heads=int(cfg.require("num_key_value_heads")),
                 head_dim=hd, rotary=b.rotary(hd), window=_window(cfg, i))


def feed_forward(b, i: int):
    cfg = b.config
    p = f"model.layers.{i}.mlp"
    act = str(cfg.get("hidden_act", "silu"))
    if i not in b.moe_layers:
        return b.load.mlp(p, b.hidden, int(cfg.require("intermediate_size")), act)
    router = qwen3_moe.softmax_router(b, i, p, normalize=bool(cfg.get("norm_topk_prob", False)))
    shared = shared_gate = None
    width = int(cfg.get("shared_expert_intermediate_size", 0))
    if width:
        shared = b.load.mlp(f"{p}.shared_expert", b.hidden, width, act)
        shared_gate = b.load.linear(f"{p}.shared_expert_gate", 1, b.hidden, bias=False)
    return b.moe(i, p, router, cfg.n_routed_experts(), int(cfg.require("moe_intermediate_size")),
                 shared=shared, shared_gate=shared_gate)
