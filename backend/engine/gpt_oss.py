"""GPT-OSS: attention with biases and a learned sink logit per head, sliding-window layers
alternating with full ones (``layer_types``), YaRN rotary; RMSNorm multiplies by its
weight before rounding; router with a bias, softmax over the top k logits only; experts
fused and interleaved (gate, up) with biases and a clamped SwiGLU (alpha 1.702, limit 7)."""

from __future__ import annotations

from hybridmoe.backend.engine.experts import ExpertActivation
from hybridmoe.backend.engine.hf_config import HFConfig
from hybridmoe.backend.engine.routing import TopKSoftmax

BUILD_OPTIONS = {"rms_eps_default": 1e-5, "round_norm_before_weight": False}



def moe_layers(cfg: HFConfig) -> list[int]:
    return list(range(int(cfg.require("num_hidden_layers"))))


def _sliding(cfg: HFConfig, i: int) -> bool:
    types = cfg.get("layer_types")
    if types is not None:
        return types[i] == "sliding_attention"
    return i % 2 == 0  # transformers' default: even layers slide


def attention(b, i: int):
    cfg = b.config
    n_heads = int(cfg.require("num_attention_heads"))
    hd = int(cfg.get("head_dim") or b.hidden // n_heads)
    return b.gqa(i, n_heads=n_heads, n_kv_heads=int(cfg.require("num_key_value_heads")), head_dim=hd,
                 rotary=b.rotary(hd, default_theta=150000.0),
                 window=int(cfg.get("sliding_window", 128)) if _sliding(cfg, i) else None, sinks=True)


def feed_forward(b, i: int):
    cfg = b.config
    p = f"model.layers.{i}.mlp"
    n = cfg.n_routed_experts()
    router = TopKSoftmax(b.load.tensor(f"{p}.router.weight", (n, b.hidden)),
                         b.load.tensor(f"{p}.router.bias", (n,)), int(cfg.require("num_experts_per_tok")))
    act = ExpertActivation("gpt_oss", alpha=float(cfg.get("swiglu_alpha", 1.702)), limit=float(cfg.get("swiglu_limit", 7.0)))
    return b.moe(i, p, router, n, int(cfg.require("intermediate_size")), act=act, gpt_oss=True)
