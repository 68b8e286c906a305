"""One decode token through the decoder on a CPU main device, in float32, natively.

At one token per call a decoder layer is a few large reads (the projections, the experts)
and some thirty small PyTorch ops (norms, rotary embedding, cache write, router softmax and
top-k, dtype conversions), each costing 3-40 us of dispatch: on the issue's 8-layer
Qwen3-MoE model those small ops were a quarter of the decode step, more than reading the
attention projections. ``DecodeStep`` runs the same layers as a short chain of native calls
(``native/src/decode_ops.cpp`` for the small steps, ``DenseLinear``, ``attend_decode`` and
``MoELayer`` for the large ones) on a float32 residual stream, into buffers allocated once.

Numerics: float32 throughout (the reference rounds to the model dtype after every op; the
KV cache is still written in its own dtype, as prefill writes it), so a decode step is at
least as close to the float32 truth as the layer-by-layer path. Prompts (more than one
token), GPU main devices and blocks this module does not cover (sliding windows, attention
sinks, MLA, q/k clipping, main-device experts) keep the layer-by-layer path; a layer may mix
the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backend.engine import native_experts
from backend.engine.attention import Attention
from backend.engine.kv_cache import KVCache
from backend.engine.layers import GatedMLP, RMSNorm
from backend.engine.moe import MoE
from backend.engine.native_linear import NativeLinear
from backend.engine.routing import SigmoidGroupedTopK, SoftmaxTopK, TopKSoftmax

_native = native_experts._native


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


class _Norm:
    def __init__(self, norm: RMSNorm):
        self.w, self.eps = _f32(norm.weight), float(norm.eps)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        _native.rms_norm(x, self.w, self.eps, out)
        return out


def _linear(lin: NativeLinear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    lin.native.forward(x, out)
    if lin.bias is not None:
        out += lin.bias
    return out


class _AttentionStep:
    """Grouped-query attention of one token: fused qkv, q/k norm + rotary + cache write,
    attention over the cache, output projection."""

    def __init__(self, attn: Attention):
        self.attn = attn
        # One fused call, or (q, k, v stored in different formats) three into one buffer.
        self.projections = (attn.qkv,) if attn.qkv is not None else (attn.q, attn.k, attn.v)
        self.o = attn.o
        self.q_norm = None if attn.q_norm is None else _f32(attn.q_norm.weight)
        self.k_norm = None if attn.k_norm is None else _f32(attn.k_norm.weight)
        self.eps = float(attn.q_norm.eps) if attn.q_norm is not None else 1e-6
        self.cos, self.sin = _f32(attn.rotary.cos), _f32(attn.rotary.sin)
        self.pairs = attn.rotary.layout == "pairs"
        self.buf_qkv = torch.empty(sum(p.out_features for p in self.projections))
        self.buf_q = torch.empty(attn.n_heads, attn.head_dim)
        self.buf_att = torch.empty(attn.n_heads, attn.cache.v.shape[-1])
        self.buf_o = torch.empty(1, self.o.out_features)

    @staticmethod
    def supports(attn: nn.Module) -> bool:
        if type(attn) is not Attention:
            return False
        native = attn.qkv is not None or all(isinstance(p, NativeLinear) for p in (attn.q, attn.k, attn.v))
        return (native and isinstance(attn.o, NativeLinear)
                and type(attn.cache) is KVCache and attn.sinks is None and attn.clip_qkv is None
                and (attn.q_norm is None or attn.norm_per_head)
                and attn.cache.k.dtype in (torch.float32, torch.bfloat16))

    def __call__(self, h: torch.Tensor, pos: int) -> torch.Tensor:
        a = self.attn
        cache = a.cache
        qkv, at = self.buf_qkv, 0
        for p in self.projections:
            _linear(p, h, qkv[at : at + p.out_features].view(1, -1))
            at += p.out_features
        k, v = cache.k[0], cache.v[0]
        _native.rope_store(qkv, a.n_heads, a.n_kv_heads, self.q_norm, self.k_norm, self.eps, self.cos, self.sin,
                           self.pairs, k, v, pos, self.buf_q)
        cache.filled = pos + 1
        _native.attend_decode(self.buf_q, k, v, pos + 1, a.scale, self.buf_att)
        return _linear(self.o, self.buf_att.view(1, -1), self.buf_o)


def _router(router: nn.Module) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None:
    """fn(logits, ids out, weights out) choosing one token's experts as `router` does, and
    the router's logits projection; None for routers this module does not cover."""
    if isinstance(router, SoftmaxTopK):
        k, normalize = router.k, router.normalize
        return lambda logits, ids, w: _native.softmax_topk(logits, k, normalize, ids, w)
    if isinstance(router, SigmoidGroupedTopK):
        r = router
        return lambda logits, ids, w: _native.sigmoid_group_topk(logits, r.correction_bias, r.k, r.n_group,
                                                                 r.topk_group, r.normalize, float(r.scaling), ids, w)
    if isinstance(router, TopKSoftmax):
        k = router.k
        return lambda logits, ids, w: _native.topk_softmax(logits, k, ids, w)
    return None


class _GatedStep:
    """down(silu(gate(x)) * up(x)) of a dense layer or shared expert."""

    def __init__(self, mlp: GatedMLP):
        self.gate_up, self.down = mlp.gate_up, mlp.down
        self.buf_gu = torch.empty(1, self.gate_up.out_features)
        self.buf_act = torch.empty(1, self.gate_up.out_features // 2)
        self.buf_out = torch.empty(1, self.down.out_features)

    @staticmethod
    def supports(mlp: nn.Module | None) -> bool:
        return (type(mlp) is GatedMLP and mlp.gate_up is not None and isinstance(mlp.down, NativeLinear)
                and mlp.act is F.silu)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = _linear(self.gate_up, h, self.buf_gu).chunk(2, dim=-1)
        torch.mul(F.silu(gate), up, out=self.buf_act)
        return _linear(self.down, self.buf_act, self.buf_out)


class _MoEStep:
    """Router, the routed experts (all in host memory), shared experts."""

    def __init__(self, moe: MoE, experts: native_experts.NativeExperts):
        self.moe, self.layer = moe, experts.layer
        self.logits = NativeLinear(moe.router.weight, getattr(moe.router, "bias", None))
        self.choose = _router(moe.router)
        self.shared = None if moe.shared is None else _GatedStep(moe.shared)
        self.shared_gate = moe.shared_gate
        k = moe.router.k
        self.buf_logits = torch.empty(1, self.logits.out_features)
        self.ids = torch.empty(1, k, dtype=torch.int64)
        self.weights = torch.empty(1, k)
        self.buf_out = torch.empty(1, experts.hidden)
        self.buf_gate = torch.empty(1, 1)

    @classmethod
    def build(cls, moe: nn.Module) -> _MoEStep | None:
        if type(moe) is not MoE or moe.scheduler is not None or len(moe.main) or not len(moe.host):
            return None
        if _router(moe.router) is None or moe.router.weight.dtype != torch.float32:
            return None
        if moe.shared is not None and not _GatedStep.supports(moe.shared):
            return None
        if moe.shared_gate is not None and not isinstance(moe.shared_gate, NativeLinear):
            return None
        experts = native_experts.native_for(moe.host)
        if experts is None:
            return None
        try:
            return cls(moe, experts)
        except native_experts.Unsupported:
            return None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        self.choose(_linear(self.logits, h, self.buf_logits), self.ids, self.weights)
        self.moe.record(self.ids)
        self.layer.forward(h, self.ids, self.weights, self.buf_out, 1, 0)
        if self.shared is not None:
            shared = self.shared(h)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(_linear(self.shared_gate, h, self.buf_gate))
            self.buf_out += shared
        return self.buf_out


class _LayerStep:
    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.attn_norm, self.ffn_norm = _Norm(layer.attn_norm), _Norm(layer.ffn_norm)
        self.attn = _AttentionStep(layer.attn) if _AttentionStep.supports(layer.attn) else None
        if _GatedStep.supports(layer.ffn):
            self.ffn = _GatedStep(layer.ffn)
        else:
            self.ffn = _MoEStep.build(layer.ffn)
        self.h = torch.empty(1, layer.attn_norm.weight.shape[0])

    def __call__(self, x: torch.Tensor, pos: int, dtype: torch.dtype) -> torch.Tensor:
        layer = self.layer
        if self.attn is not None:
            x += self.attn(self.attn_norm(x, self.h), pos)
        else:
            x += layer.attn(layer.attn_norm(x.to(dtype)), pos).float()
        if self.ffn is not None:
            x += self.ffn(self.ffn_norm(x, self.h))
        else:
            x += layer.ffn(layer.ffn_norm(x.to(dtype))).float()
        return x


class DecodeStep:
    """The layers and final norm of a CPU-main-device model for one token, or (``build``)
    None when no layer would run natively."""

    def __init__(self, model: nn.Module, layers: list[_LayerStep]):
        self.model = model
        self.layers = layers
        self.norm = _Norm(model.norm)
        self.out = torch.empty(1, model.norm.weight.shape[0])
        # A head the kernels do not read is a PyTorch Linear in the model dtype.
        self.head_dtype = None if isinstance(model.lm_head, NativeLinear) else model.dtype

    @classmethod
    def build(cls, model: nn.Module) -> DecodeStep | None:
        if (not native_experts.enabled() or model.device.type != "cpu" or model.boundaries
                or model.scheduler is not None or type(model.norm) is not RMSNorm):
            return None
        if any(type(layer.attn_norm) is not RMSNorm or type(layer.ffn_norm) is not RMSNorm for layer in model.layers):
            return None
        layers = [_LayerStep(layer) for layer in model.layers]
        if all(step.attn is None and step.ffn is None for step in layers):
            return None
        return cls(model, layers)

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: the token's embedding [1, H] -> the final-normed hidden state [1, H], what the
        LM head reads (float32 for a native head)."""
        x = x.float()  # a copy: the residual stream is updated in place
        dtype = self.model.dtype
        for step in self.layers:
            x = step(x, pos, dtype)
        h = self.norm(x, self.out)
        return h if self.head_dtype is None else h.to(self.head_dtype)
