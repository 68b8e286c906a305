"""Qwen3-MoE: grouped-query attention with RMSNorm on each head's q and k before the
rotation, softmax routing (norm_topk_prob renormalises the top k), no shared experts;
`mlp_only_layers` / `decoder_sparse_step` leave some layers dense."""

from __future__ import annotations

from hybridmoe.backend.engine.hf_config import HFConfig
from hybridmoe.backend.engine.routing import SoftmaxTopK

BUILD_OPTIONS = {"rms_eps_default": 1e-6}



def moe_layers(cfg: HFConfig) -> list[int]:
    """Layers with routed experts, as Qwen2/Qwen3-MoE (and OLMoE, all layers) choose them."""
    dense = set(cfg.get("mlp_only_layers", []))
    step = int(cfg.get("decoder_sparse_step", 1))
    n = int(cfg.require("num_hidden_layers"))
    if not cfg.n_routed_experts():
        return []
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


def head_dim(cfg: HFConfig) -> int:
    return int(cfg.get("head_dim") or int(cfg.require("hidden_size")) // int(cfg.require("num_attention_heads")))


def attention(b, i: int):
    cfg = b.config
    hd = head_dim(cfg)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    return b.gqa(i, n_heads=int(cfg.require("num_attention_heads")), n_kv_heads=int(cfg.require("num_key_value_heads")),
                 head_dim=hd, rotary=b.rotary(hd), window=window, qk_norm="head")


def softmax_router(b, i: int, prefix: str, *, normalize: bool, float32_weights: bool = False) -> SoftmaxTopK:
    n = b.config.n_routed_experts()
    weight = b.load.tensor(f"{prefix}.gate.weight", (n, b.hidden))
    return SoftmaxTopK(weight, int(b.config.require("num_experts_per_tok")), normalize=normalize,
                       float32_weights=float32_weights)


def feed_forward(b, i: int):
    cfg = b.config
    p = f"model.layers.{i}.mlp"
    if i not in b.moe_layers:
        return b.load.mlp(p, b.hidden, int(cfg.require("intermediate_size")), str(cfg.get("hidden_act", "silu")))
    router = softmax_router(b, i, p, normalize=bool(cfg.get("norm_topk_prob", False)))
    return b.moe(i, p, router, cfg.n_routed_experts(), int(cfg.require("moe_intermediate_size")))
