"""OLMoE: q and k RMSNorm over the whole projection (not per head), optional clipping of
q/k/v to +-clip_qkv, softmax routing without renormalisation by default, all layers MoE."""

from __future__ import annotations

from hybridmoe.backend.engine import qwen3_moe
from hybridmoe.backend.engine.hf_config import HFConfig

BUILD_OPTIONS = {"rms_eps_default": 1e-5}



def moe_layers(cfg: HFConfig) -> list[int]:
    return list(range(int(cfg.require("num_hidden_layers"))))


def attention(b, i: int):
    cfg = b.config
    hd = qwen3_moe.head_dim(cfg)
    n_heads = int(cfg.require("num_attention_heads"))
    return b.gqa(i, n_heads=n_heads, n_kv_heads=int(cfg.get("num_key_value_heads", n_heads)), head_dim=hd,
                 rotary=b.rotary(hd), qk_norm="full", clip_qkv=cfg.get("clip_qkv"))


def feed_forward(b, i: int):
    cfg = b.config
    p = f"model.layers.{i}.mlp"
    router = qwen3_moe.softmax_router(b, i, p, normalize=bool(cfg.get("norm_topk_prob", False)))
    return b.moe(i, p, router, cfg.n_routed_experts(), int(cfg.require("intermediate_size")))
