"""GPT-OSS: attention with biases and a learned sink logit per head, sliding-window layers
alternating with full ones (which ones: the spec's ``sliding_layers``), YaRN rotary; RMSNorm
multiplies by its weight before rounding; router with a bias, softmax over the top k logits
only; experts fused and interleaved (gate, up) with biases and a clamped SwiGLU (alpha
1.702, limit 7)."""

from __future__ import annotations

from hybridmoe.backend.models.layer_description import CLAMPED_SWIGLU
from hybridmoe.backend.engine.experts import ExpertActivation
from hybridmoe.backend.engine.routing import TopKSoftmax

BUILD_OPTIONS = {"rms_eps_default": 1e-5, "round_norm_before_weight": False}


def attention(b, i: int):
    return b.gqa(i, rotary=b.rotary(b.spec.head_dim, default_theta=150000.0), sinks=True)


def feed_forward(b, i: int):
    cfg, spec = b.config, b.spec
    p = f"model.layers.{i}.mlp"
    n = spec.n_routed_experts
    router = TopKSoftmax(b.load.tensor(f"{p}.router.weight", (n, b.hidden)),
                         b.load.tensor(f"{p}.router.bias", (n,)), spec.experts_per_token)
    act = ExpertActivation(CLAMPED_SWIGLU, alpha=float(cfg.get("swiglu_alpha", 1.702)),
                           limit=float(cfg.get("swiglu_limit", 7.0)), interleaved=True)
    return b.moe(i, p, router, n, spec.moe_intermediate_size, act=act, fused_xw_with_biases=True)
