"""One decode token through the decoder on a CPU main device, in float32, natively.

At one token per call a decoder layer is a few large reads (the projections, the experts)
and some thirty small PyTorch ops (norms, rotary embedding, cache write, router softmax and
top-k, dtype conversions), each costing 3-40 us of dispatch: on the issue's 8-layer
Qwen3-MoE model those small ops were a quarter of the decode step, more than reading the
attention projections. ``DecodeStep`` runs the same layers as a short chain of native calls
(``native/src/decode_ops.cpp`` for the small steps, ``DenseLinear``, ``attend_decode`` and
``MoELayer`` for the large ones) on a float32 residual stream, in buffers allocated once.

The kernels get those buffers, the weights they read and the KV cache as NumPy views made
once: handing a torch tensor to an extension goes through DLPack (``__dlpack__``) and cost
about 20 us a call with four tensor arguments, against 2 us with NumPy arrays (measured), a
tenth of the step over its hundred calls. NumPy has no bfloat16: a bf16 cache travels as its
uint16 bits, which the bindings read as bf16.

Numerics: float32 throughout (the reference rounds to the model dtype after every op; the
KV cache is still written in its own dtype, as prefill writes it), so a decode step is at
least as close to the float32 truth as the layer-by-layer path. Prompts (more than one
token), GPU main devices and blocks this module does not cover (sliding windows, attention
sinks, MLA, q/k clipping, main-device experts) keep the layer-by-layer path; a layer may mix
the two.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.backend.engine import native_experts, native_kernels
from hybridmoe.backend.engine.attention import Attention
from hybridmoe.backend.engine.kv_cache import KVCache
from hybridmoe.backend.engine.layers import GatedMLP, RMSNorm
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.engine.native_linear import NativeLinear
from hybridmoe.backend.engine.routing import SigmoidGroupedTopK, SoftmaxTopK, TopKSoftmax

_native = native_kernels._native


def _np(t: torch.Tensor) -> np.ndarray:
    """A float32 (or int64) NumPy view of a CPU tensor's memory; a float32 copy of other dtypes."""
    t = t.detach()
    return (t if t.dtype in (torch.float32, torch.int64) else t.float()).contiguous().numpy()


def _cache_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a KV cache, bf16 as its uint16 bits (NumPy has no bfloat16)."""
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


class _Buffer:
    """A float32 (or int64) tensor and its NumPy view: one memory, two handles."""

    def __init__(self, *shape: int, dtype: torch.dtype = torch.float32):
        self.t = torch.empty(*shape, dtype=dtype)
        self.a = self.t.numpy()


class _Norm:
    def __init__(self, norm: RMSNorm):
        self.w, self.eps = _np(norm.weight), float(norm.eps)

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        _native.rms_norm(x, self.w, self.eps, out)
        return out


class _Linear:
    """A NativeLinear called on NumPy views; out = x W^T (+ b)."""

    def __init__(self, lin: NativeLinear):
        self.lin = lin  # keeps alive what the kernels read
        self.native = lin.native
        self.bias = None if lin.bias is None else _np(lin.bias)
        self.out_features = lin.out_features

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        self.native.forward(x, out)
        if self.bias is not None:
            np.add(out, self.bias, out=out)
        return out


class _AttentionStep:
    """Grouped-query attention of one token: q|k|v projections, q/k norm + rotary + cache
    write, attention over the cache, output projection."""

    def __init__(self, attn: Attention):
        self.attn = attn
        # One fused call, or (q, k, v stored in different formats) three into one buffer.
        self.projections = [_Linear(p) for p in ((attn.qkv,) if attn.qkv is not None else (attn.q, attn.k, attn.v))]
        self.o = _Linear(attn.o)
        self.q_norm = None if attn.q_norm is None else _np(attn.q_norm.weight)
        self.k_norm = None if attn.k_norm is None else _np(attn.k_norm.weight)
        self.eps = float(attn.q_norm.eps) if attn.q_norm is not None else 1e-6
        self.cos, self.sin = _np(attn.rotary.cos), _np(attn.rotary.sin)
        self.pairs = attn.rotary.layout == "pairs"
        self.k, self.v = _cache_view(attn.cache.k[0]), _cache_view(attn.cache.v[0])  # preallocated
        self.qkv = np.empty(sum(p.out_features for p in self.projections), dtype=np.float32)
        self.slices, at = [], 0
        for p in self.projections:
            self.slices.append(self.qkv[at : at + p.out_features].reshape(1, -1))
            at += p.out_features
        self.q = np.empty((attn.n_heads, attn.head_dim), dtype=np.float32)
        self.att = np.empty((attn.n_heads, self.v.shape[-1]), dtype=np.float32)
        self.out = np.empty((1, self.o.out_features), dtype=np.float32)

    @staticmethod
    def supports(attn: nn.Module) -> bool:
        if type(attn) is not Attention:
            return False
        native = attn.qkv is not None or all(isinstance(p, NativeLinear) for p in (attn.q, attn.k, attn.v))
        return (native and isinstance(attn.o, NativeLinear)
                and type(attn.cache) is KVCache and attn.sinks is None and attn.clip_qkv is None
                and (attn.q_norm is None or attn.norm_per_head)
                and attn.cache.k.dtype in (torch.float32, torch.bfloat16))

    def __call__(self, h: np.ndarray, pos: int) -> np.ndarray:
        a = self.attn
        for p, out in zip(self.projections, self.slices):
            p(h, out)
        _native.rope_store(self.qkv, a.n_heads, a.n_kv_heads, self.q_norm, self.k_norm, self.eps, self.cos, self.sin,
                           self.pairs, self.k, self.v, pos, self.q)
        a.cache.filled = pos + 1
        _native.attend_decode(self.q, self.k, self.v, pos + 1, a.scale, self.att)
        return self.o(self.att.reshape(1, -1), self.out)


def _router(router: nn.Module) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
    """fn(logits, ids out, weights out) choosing one token's experts as `router` does; None
    for routers this module does not cover."""
    if isinstance(router, SoftmaxTopK):
        k, normalize = router.k, router.normalize
        return lambda logits, ids, w: _native.softmax_topk(logits, k, normalize, ids, w)
    if isinstance(router, SigmoidGroupedTopK):
        r = router
        bias = None if r.correction_bias is None else _np(r.correction_bias)
        return lambda logits, ids, w: _native.sigmoid_group_topk(logits, bias, r.k, r.n_group, r.topk_group,
                                                                 r.normalize, float(r.scaling), ids, w)
    if isinstance(router, TopKSoftmax):
        k = router.k
        return lambda logits, ids, w: _native.topk_softmax(logits, k, ids, w)
    return None


class _GatedStep:
    """down(silu(gate(x)) * up(x)) of a dense layer or shared expert."""

    def __init__(self, mlp: GatedMLP):
        self.gate_up, self.down = _Linear(mlp.gate_up), _Linear(mlp.down)
        self.gu = _Buffer(1, self.gate_up.out_features)
        self.act = _Buffer(1, self.gate_up.out_features // 2)
        self.out = np.empty((1, self.down.out_features), dtype=np.float32)

    @staticmethod
    def supports(mlp: nn.Module | None) -> bool:
        return (type(mlp) is GatedMLP and mlp.gate_up is not None and isinstance(mlp.down, NativeLinear)
                and mlp.act is F.silu)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        self.gate_up(h, self.gu.a)
        gate, up = self.gu.t.chunk(2, dim=-1)
        torch.mul(F.silu(gate), up, out=self.act.t)
        return self.down(self.act.a, self.out)


class _MoEStep:
    """Router, the routed experts (all in host memory), shared experts."""

    def __init__(self, moe: MoE, experts: native_experts.NativeExperts, choose: Callable):
        self.moe, self.layer = moe, experts.layer
        self.logits = _Linear(NativeLinear(moe.router.weight, getattr(moe.router, "bias", None)))
        self.choose = choose
        self.shared = None if moe.shared is None else _GatedStep(moe.shared)
        self.shared_gate = None if moe.shared_gate is None else _Linear(moe.shared_gate)
        k = moe.router.k
        self.buf_logits = np.empty((1, self.logits.out_features), dtype=np.float32)
        self.ids = _Buffer(1, k, dtype=torch.int64)
        self.weights = np.empty((1, k), dtype=np.float32)
        self.out = np.empty((1, experts.hidden), dtype=np.float32)
        self.gate = np.empty((1, 1), dtype=np.float32)

    @classmethod
    def build(cls, moe: nn.Module) -> _MoEStep | None:
        if type(moe) is not MoE or moe.scheduler is not None or len(moe.main) or not len(moe.host):
            return None
        choose = _router(moe.router)
        if choose is None or moe.router.weight.dtype != torch.float32:
            return None
        if moe.shared is not None and not _GatedStep.supports(moe.shared):
            return None
        if moe.shared_gate is not None and not isinstance(moe.shared_gate, NativeLinear):
            return None
        experts = native_experts.native_for(moe.host)
        if experts is None:
            return None
        try:
            return cls(moe, experts, choose)
        except native_kernels.Unsupported:
            return None

    def __call__(self, h: np.ndarray) -> np.ndarray:
        self.choose(self.logits(h, self.buf_logits), self.ids.a, self.weights)
        self.moe.record(self.ids.t)
        self.layer.forward(h, self.ids.a, self.weights, self.out, 1, 0)
        if self.shared is not None:
            shared = self.shared(h)
            if self.shared_gate is not None:
                shared = shared / (1.0 + np.exp(-self.shared_gate(h, self.gate)))  # sigmoid(gate) * shared
            np.add(self.out, shared, out=self.out)
        return self.out


class _LayerStep:
    def __init__(self, layer: nn.Module, h: np.ndarray):
        self.layer = layer
        self.h = h  # the normed input of a block (one buffer for all layers)
        self.attn_norm, self.ffn_norm = _Norm(layer.attn_norm), _Norm(layer.ffn_norm)
        self.attn = _AttentionStep(layer.attn) if _AttentionStep.supports(layer.attn) else None
        if _GatedStep.supports(layer.ffn):
            self.ffn = _GatedStep(layer.ffn)
        else:
            self.ffn = _MoEStep.build(layer.ffn)

    def __call__(self, x: _Buffer, pos: int, dtype: torch.dtype) -> None:
        """Add the layer's two blocks to the residual stream x in place."""
        layer = self.layer
        if self.attn is not None:
            np.add(x.a, self.attn(self.attn_norm(x.a, self.h), pos), out=x.a)
        else:
            x.t += layer.attn(layer.attn_norm(x.t.to(dtype)), pos).float()
        if self.ffn is not None:
            np.add(x.a, self.ffn(self.ffn_norm(x.a, self.h)), out=x.a)
        else:
            x.t += layer.ffn(layer.ffn_norm(x.t.to(dtype))).float()


class DecodeStep:
    """The layers, final norm and LM head of a CPU-main-device model for one token, or
    (``build``) None when no layer would run natively."""

    def __init__(self, model: nn.Module):
        self.model = model
        hidden = model.norm.weight.shape[0]
        self.x = _Buffer(1, hidden)  # the residual stream
        self.h = _Buffer(1, hidden)
        self.layers = [_LayerStep(layer, self.h.a) for layer in model.layers]
        self.norm = _Norm(model.norm)
        # A head the kernels do not read is a PyTorch Linear in the model dtype.
        self.head = _Linear(model.lm_head) if isinstance(model.lm_head, NativeLinear) else None

    @classmethod
    def build(cls, model: nn.Module) -> DecodeStep | None:
        if (not native_kernels.enabled() or model.device.type != "cpu" or model.boundaries
                or model.scheduler is not None or type(model.norm) is not RMSNorm):
            return None
        if any(type(layer.attn_norm) is not RMSNorm or type(layer.ffn_norm) is not RMSNorm for layer in model.layers):
            return None
        step = cls(model)
        if all(s.attn is None and s.ffn is None for s in step.layers):
            return None
        return step

    def __call__(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: the token's embedding [1, H] -> float32 logits [1, V]."""
        self.x.t.copy_(x)
        dtype = self.model.dtype
        for step in self.layers:
            step(self.x, pos, dtype)
        self.norm(self.x.a, self.h.a)
        if self.head is None:
            return self.model.lm_head(self.h.t.to(dtype)).float()
        logits = torch.empty(1, self.head.out_features)  # a new tensor: callers may keep it
        self.head(self.h.a, logits.numpy())
        return logits
