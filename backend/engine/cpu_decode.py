"""One decode token per sequence through the decoder on a CPU main device, natively.

At one token per call a decoder layer is a few large reads (the projections, the experts)
and some thirty small PyTorch ops (norms, rotary embedding, cache write, router softmax and
top-k, dtype conversions), each costing 3-40 us of dispatch: on the issue's 8-layer
Qwen3-MoE model those small ops were a quarter of the decode step, more than reading the
attention projections. ``DecodeStep`` runs the same layers as a short chain of native calls
(``native/src/decode_ops.cpp`` for the small steps, ``DenseLinear``, ``attend_decode`` and
``MoELayer`` for the large ones) on a float32 residual stream, in buffers allocated once.
Several sequences' tokens (continuous batching) go through as rows of one step: the
projections and the experts read their weights once for all rows, each row's attention
reads its own sequence's blocks of the cache. A row's arithmetic does not depend on the
others (the kernels quantize and accumulate per row), so a batched token gets the logits
it gets alone.

The kernels get those buffers, the weights they read and the KV cache as NumPy views made
once: handing a torch tensor to an extension goes through DLPack (``__dlpack__``) and cost
about 20 us a call with four tensor arguments, against 2 us with NumPy arrays (measured), a
tenth of the step over its hundred calls. NumPy has no bfloat16: a bf16 cache travels as its
uint16 bits, which the bindings read as bf16.

Multi-head latent attention (DeepSeek, Kimi) runs natively too (``_MLAStep``, in the absorbed
form: ``native/src/mla_decode.h``); in PyTorch it took 2.6 ms a layer on a 16-head model, and
the DeepSeek-shaped benchmark model decoded at 0.34x llama.cpp (now 1.44x).

When every layer has a shape the chain covers (one cache group; grouped-query attention, with
or without bias and per-head q/k norm, or latent attention; a dense gated MLP, or routed experts
under any router below with or without shared experts: Qwen3-MoE, Mixtral, GLM-4.5, Qwen2-MoE,
DeepSeek-V3, Kimi K2), ``_Chain`` runs all of them in one native call
(``native/src/decode_chain.cpp``) with the same kernels in the same order: the same bits,
without the Python between the calls, which the weights streaming through the caches make run
cold (about 2 ms a token on the 8-layer benchmark model; 1.06-1.12x decode on its GLM-4.5- and
DeepSeek-shaped twins, where the chain replaced the calls: ``benchmarks/decode_chain_ab.py``).

Numerics: float32 throughout (the reference rounds to the model dtype after every op; the
KV cache is still written in its own dtype, as prefill writes it), so a decode step is at
least as close to the float32 truth as the layer-by-layer path. Prompts (more than one
token per sequence), GPU main devices and blocks this module does not cover (sliding
windows, attention sinks, q/k clipping, MLA's expanded form where it is forced,
main-device experts) keep the layer-by-layer path; a layer may mix the two. Which blocks run
natively and whether the chain runs them all is the model's decode plan (``decode_path``),
decided from the layers' descriptions and the machine; this module builds what it says.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from hybridmoe.backend.engine import native_experts, native_kernels, step_profile
from hybridmoe.backend.engine.attention import Attention
from hybridmoe.backend.models.layer_description import (DenseFeedForward, GroupedQueryAttention, LatentAttention, Layer,
                                                        MixtureOfExperts, Router)
from hybridmoe.backend.plan.decode_path import DecodePlan, LayerPath
from hybridmoe.backend.engine.kv_cache import B, Segment
from hybridmoe.backend.engine.layers import GatedMLP, RMSNorm
from hybridmoe.backend.engine.mla import MLAttention
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.engine.native_linear import NativeLinear

_native = native_kernels._native


_clock, _lap = step_profile.clock, step_profile.lap


def _distinct(ids: np.ndarray) -> int:
    """How many different experts a step's rows chose (a set: np.unique costs ~10 us, and a
    profiled step must not be much slower than an unprofiled one)."""
    return len(set(ids.ravel().tolist()))


def _stack(tables: list[np.ndarray]) -> np.ndarray:
    """Block tables of different lengths as the rows of one int64 array (padded with 0:
    a row's length says how many of its entries are read)."""
    if len(tables) == 1:
        return tables[0].reshape(1, -1)
    out = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for row, table in zip(out, tables):
        row[:len(table)] = table
    return out


def _np(t: torch.Tensor) -> np.ndarray:
    """A float32 (or int64) NumPy view of a CPU tensor's memory; a float32 copy of other dtypes."""
    t = t.detach()
    return (t if t.dtype in (torch.float32, torch.int64) else t.float()).contiguous().numpy()


def _cache_view(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a KV cache or the embedding table, bf16 as its uint16 bits (NumPy has no
    bfloat16)."""
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@contextmanager
def _torch_parts() -> Iterator[None]:
    """Where a step runs PyTorch modules (layers it does not cover, a head the kernels do not
    read): inference mode, and decode rows for the kernels those modules call."""
    with native_kernels.rows_are("decode"), torch.inference_mode():
        yield


class _Buffer:
    """A float32 tensor and its NumPy view: one memory, two handles."""

    def __init__(self, *shape: int):
        self.t = torch.empty(*shape)
        self.a = self.t.numpy()


class _Norm:
    def __init__(self, norm: RMSNorm):
        self.w, self.eps = _np(norm.weight), float(norm.eps)

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        t0 = _clock()
        _native.rms_norm(x, self.w, self.eps, out)
        _lap("small", t0)
        return out


class _Linear:
    """A NativeLinear called on NumPy views; out = x W^T (+ b). `part`: where a step profile
    counts it."""

    def __init__(self, lin: NativeLinear, part: str):
        self.lin = lin  # keeps alive what the kernels read
        self.native, self.part = lin.native, part
        self.bias = None if lin.bias is None else _np(lin.bias)
        self.out_features = lin.out_features

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        t0 = _clock()
        self.native.forward(x, out, native_kernels.dense_threshold("decode"))
        if self.bias is not None:
            np.add(out, self.bias, out=out)
        _lap(self.part, t0, self.native.bytes)
        return out


class _AttentionStep:
    """Grouped-query attention of one token per sequence: q|k|v projections over all rows,
    then per row q/k norm + rotary + cache write, one call for every row's attention over its
    own sequence's blocks (the threads share the rows' heads), then the output projection
    over all rows."""

    def __init__(self, attn: Attention, max_rows: int):
        self.attn = attn
        self.qkv_proj = _Linear(attn.qkv, "qkv")  # q, k and v joined, whatever formats they are stored in
        self.o = _Linear(attn.o, "o")
        self.qkv_bytes, self.attend_bytes = self.qkv_proj.native.bytes, 0  # what a token reads besides the cache
        self.q_norm = None if attn.q_norm is None else _np(attn.q_norm.weight)
        self.k_norm = None if attn.k_norm is None else _np(attn.k_norm.weight)
        self.eps = float(attn.q_norm.eps) if attn.q_norm is not None else 1e-6
        self.cos, self.sin = _np(attn.rotary.cos), _np(attn.rotary.sin)
        self.pairs = attn.rotary.layout == "pairs"
        self.group = attn.cache.group
        self.k, self.v = _cache_view(attn.cache.k), _cache_view(attn.cache.v)  # [blocks, KV, B, d]
        kv_heads = self.k.shape[1]
        self.position_bytes = kv_heads * (self.k.shape[-1] * self.k.itemsize + self.v.shape[-1] * self.v.itemsize)
        self.qkv = np.empty((max_rows, self.qkv_proj.out_features), dtype=np.float32)
        self.q = np.empty((max_rows, attn.n_heads, attn.head_dim), dtype=np.float32)
        self.att = np.empty((max_rows, attn.n_heads, self.v.shape[-1]), dtype=np.float32)
        self.lengths = np.empty(max_rows, dtype=np.int64)
        self.out = np.empty((max_rows, self.o.out_features), dtype=np.float32)

    def chain(self, hidden: int, k: int, max_rows: int):
        """The native chain for layers of this attention's shape."""
        a = self.attn
        return _native.DecodeChain(hidden, a.n_heads, a.n_kv_heads, a.head_dim, self.v.shape[-1], self.k.shape[2], k,
                                   max_rows)

    def add_to(self, chain, s: _LayerStep, block: dict) -> None:
        chain.add_layer(s.attn_norm.w, s.attn_norm.eps, self.qkv_proj.native, self.qkv_proj.bias, self.q_norm,
                        self.k_norm, self.eps, self.cos, self.sin, self.pairs, self.k, self.v, self.attn.scale,
                        self.o.native, self.o.bias, s.ffn_norm.w, s.ffn_norm.eps, **block)

    def __call__(self, h: np.ndarray, segments: list[Segment]) -> np.ndarray:
        a, n = self.attn, h.shape[0]
        qkv = self.qkv_proj(h, self.qkv[:n])
        q, att, lengths = self.q[:n], self.att[:n], self.lengths[:n]
        t0 = _clock()
        tables: list[np.ndarray] = [None] * n
        for seg in segments:
            pos, t = seg.start, seg.row
            table = seg.seq.table_array(self.group)
            block, row, first = table[pos // B], pos % B, pos - pos % B
            # The rotary tables from the block's first position on, so that the kernel's
            # position (the row in the block) picks the token's own angle.
            _native.rope_store(qkv[t], a.n_heads, a.n_kv_heads, self.q_norm, self.k_norm, self.eps, self.cos[first:],
                               self.sin[first:], self.pairs, self.k[block], self.v[block], row, q[t])
            lengths[t], tables[t] = pos + 1, table
        _lap("small", t0)
        t0 = _clock()
        _native.attend_decode_rows(q, self.k, self.v, _stack(tables), lengths, a.scale, att)
        _lap("attend", t0, int(lengths.sum()) * self.position_bytes)
        return self.o(att.reshape(n, -1), self.out[:n])


class _MLAStep:
    """Multi-head latent attention of one token per sequence (DeepSeek, Kimi): the q and
    compressed-kv projections over all rows, per row the rotary parts and the cache row
    (``mla_rope_store``), one call for every row's absorbed attention over its latent cache
    (``mla_attend_rows``: kv_b folded into the queries and applied to the attended latents),
    then the output projection. The expanded form, where it is forced (``set_mla_absorb(False)``,
    which rebuilds the step: tests compare the two), is PyTorch's."""

    def __init__(self, attn: MLAttention, max_rows: int):
        self.attn = attn
        if attn.q_proj is not None:
            self.q, self.q_a = _Linear(attn.q_proj, "qkv"), None
        else:
            self.q_a, self.q_a_norm, self.q = _Linear(attn.q_a, "qkv"), _Norm(attn.q_a_norm), _Linear(attn.q_b, "qkv")
            self.qa = np.empty((max_rows, self.q_a.out_features), dtype=np.float32)
        self.kv_a = _Linear(attn.kv_a, "qkv")
        self.kv_norm, self.eps = _np(attn.kv_a_norm.weight), float(attn.kv_a_norm.eps)
        self.o = _Linear(attn.o, "o")
        if attn.stored_maps is not None:  # kv_b as the file stores it
            self.maps = attn.stored_maps.native
        else:  # kv_b_proj in the compute dtype (its NumPy view kept with the maps that read it)
            self.kv_b = _cache_view(attn.kv_b_weight)
            self.maps = _native.LatentMaps.joined(self.kv_b, attn.n_heads, attn.nope_dim, attn.v_dim)
        # What a token reads besides the cache: the projections; kv_b, whole, in the attention.
        self.qkv_bytes = sum(lin.native.bytes for lin in (self.q, self.q_a, self.kv_a) if lin is not None)
        self.attend_bytes = self.maps.bytes
        self.cos, self.sin = _np(attn.rotary.cos), _np(attn.rotary.sin)
        self.pairs = attn.rotary.layout == "pairs"
        self.group = attn.cache.group
        self.cache = _cache_view(attn.cache.kv)  # [blocks, B, latent + rotary key]
        self.position_bytes = self.cache.shape[-1] * self.cache.itemsize
        self.q_buf = np.empty((max_rows, self.q.out_features), dtype=np.float32)
        self.kv = np.empty((max_rows, self.kv_a.out_features), dtype=np.float32)
        self.lengths = np.empty(max_rows, dtype=np.int64)
        self.att = np.empty((max_rows, attn.n_heads * attn.v_dim), dtype=np.float32)
        self.out = np.empty((max_rows, self.o.out_features), dtype=np.float32)

    def chain(self, hidden: int, k: int, max_rows: int):
        """The native chain for layers of this attention's shape (one latent "head" of the cache)."""
        a = self.attn
        c, rope = a.kv_lora_rank, a.rope_dim
        return _native.DecodeChain(hidden, a.n_heads, 1, c + rope, c, self.cache.shape[1], k, max_rows,
                                   latent_nope=a.nope_dim, latent_v=a.v_dim)

    def add_to(self, chain, s: _LayerStep, block: dict) -> None:
        chain.add_latent_layer(
            s.attn_norm.w, s.attn_norm.eps, None if self.q_a is None else self.q_a.native,
            None if self.q_a is None else self.q_a_norm.w, 0.0 if self.q_a is None else self.q_a_norm.eps,
            self.q.native, self.kv_a.native, self.kv_norm, self.eps, self.maps, self.cos, self.sin, self.pairs,
            self.cache, self.attn.scale, self.o.native, self.o.bias, s.ffn_norm.w, s.ffn_norm.eps, **block)

    def __call__(self, h: np.ndarray, segments: list[Segment]) -> np.ndarray:
        a, n = self.attn, h.shape[0]
        if self.q_a is None:
            q = self.q(h, self.q_buf[:n])
        else:
            qa = self.q_a(h, self.qa[:n])
            q = self.q(self.q_a_norm(qa, qa), self.q_buf[:n])
        kv, lengths = self.kv_a(h, self.kv[:n]), self.lengths[:n]
        t0 = _clock()
        tables: list[np.ndarray] = [None] * n
        for seg in segments:
            pos, t = seg.start, seg.row
            table = seg.seq.table_array(self.group)
            _native.mla_rope_store(q[t], kv[t], self.kv_norm, self.eps, self.cos[pos], self.sin[pos], self.pairs,
                                   self.cache[table[pos // B], pos % B], a.n_heads, a.rope_dim)
            lengths[t], tables[t] = pos + 1, table
        _lap("small", t0)
        t0 = _clock()
        att = self.att[:n]
        _native.mla_attend_rows(q, self.maps, self.cache, _stack(tables), lengths, a.rope_dim, a.scale, att)
        _lap("attend", t0, int(lengths.sum()) * self.position_bytes + self.attend_bytes)
        return self.o(att, self.out[:n])


def route_fields(r: Router, choice_bias: np.ndarray | None) -> dict:
    """The native route of a router's description: the fields a chain layer and the per-call
    ``route`` take, under the description's names (``decode_chain.h``'s ``kRouteNames`` name
    the kinds as ``Router.kind`` does: no translation between them)."""
    return dict(route=r.kind, normalize=r.normalize, correction_bias=choice_bias, n_group=r.n_group,
                topk_group=r.topk_group, scaling=r.scaling)


def _chooser(r: Router, choice_bias: np.ndarray | None) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    """fn(logits, ids out, weights out): one token's choice, as the router's description says,
    through the route the native chain takes too."""
    f = route_fields(r, choice_bias)
    args = (f["route"], f["normalize"], f["correction_bias"], f["n_group"], f["topk_group"], f["scaling"])
    k, route = r.k, _native.route
    return lambda logits, ids, w: route(logits, k, *args, ids, w)


class _GatedStep:
    """down(silu(gate(x)) * up(x)) of a dense layer or shared expert, over the step's rows."""

    routed = False

    def __init__(self, mlp: GatedMLP, max_rows: int, part: str = "mlp"):
        self.gate_up, self.down = _Linear(mlp.gate_up, part), _Linear(mlp.down, part)
        self.gu = np.empty((max_rows, self.gate_up.out_features), dtype=np.float32)
        self.act = np.empty((max_rows, self.gate_up.out_features // 2), dtype=np.float32)
        self.out = np.empty((max_rows, self.down.out_features), dtype=np.float32)

    def chain_block(self) -> dict:
        """Its part of a native chain layer's arguments."""
        return dict(gate_up=self.gate_up.native, down=self.down.native)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        n = h.shape[0]
        gu, act = self.gate_up(h, self.gu[:n]), self.act[:n]
        t0 = _clock()
        _native.silu_mul_rows(gu, act)
        _lap("small", t0)
        return self.down(act, self.out[:n])


class _MoEStep:
    """Router, the routed experts (all in host memory, one call over the union of the rows'
    choices), shared experts."""

    routed = True

    def __init__(self, moe: MoE, max_rows: int):
        experts = native_experts.native_for(moe.host)  # the plan saw that the kernels read them
        self.moe, self.layer = moe, experts.layer
        self.route = route = moe.router.describe()
        self.logits = _Linear(moe.router.native, "router")  # (``routing``: with its bias, in its held dtype)
        self.choice_bias = _np(moe.router.correction_bias) if route.choice_bias else None
        self.choose = _chooser(route, self.choice_bias)
        self.shared = None if moe.shared is None else _GatedStep(moe.shared, max_rows, "shared")
        self.shared_gate = None if moe.shared_gate is None else _Linear(moe.shared_gate, "shared")
        self.expert_bytes = experts.expert_bytes
        k = moe.router.k
        self.k = k
        self.buf_logits = np.empty((max_rows, self.logits.out_features), dtype=np.float32)
        self.ids = np.empty((max_rows, k), dtype=np.int64)
        self.weights = np.empty((max_rows, k), dtype=np.float32)
        self.out = np.empty((max_rows, experts.hidden), dtype=np.float32)
        self.gate = np.empty((max_rows, 1), dtype=np.float32)

    def chain_block(self) -> dict:
        """Its part of a native chain layer's arguments: the router as described, the experts,
        the shared experts."""
        block = dict(router=self.logits.native, router_bias=self.logits.bias, experts=self.layer,
                     shared_gate=None if self.shared_gate is None else self.shared_gate.native,
                     **route_fields(self.route, self.choice_bias))
        if self.shared is not None:
            block.update(self.shared.chain_block())
        return block

    def __call__(self, h: np.ndarray) -> np.ndarray:
        n = h.shape[0]
        logits = self.logits(h, self.buf_logits[:n])
        ids, weights, out = self.ids[:n], self.weights[:n], self.out[:n]
        t0 = _clock()
        for t in range(n):
            self.choose(logits[t], ids[t], weights[t])
        _lap("small", t0)
        self.moe.record(ids)
        t0 = _clock()
        self.layer.forward(h, ids, weights, out, native_experts.REGIMES[native_kernels.expert_regime("decode")], 0)
        if t0:  # the experts of the union of the rows' choices, each read once
            _lap("experts", t0, _distinct(ids) * self.expert_bytes)
        if self.shared is not None:
            shared = self.shared(h)
            gate = None if self.shared_gate is None else self.shared_gate(h, self.gate[:n])
            t0 = _clock()
            _native.add_gated(out, shared, gate)  # out += sigmoid(gate) * shared
            _lap("small", t0)
        return out


# The native step of each kind of block, by the type of its description.
_ATTENTION_STEPS = {GroupedQueryAttention: _AttentionStep, LatentAttention: _MLAStep}
_FFN_STEPS = {DenseFeedForward: _GatedStep, MixtureOfExperts: _MoEStep}


class _LayerStep:
    """One layer: its blocks as native steps where the plan's path says so, else (None) the
    PyTorch modules."""

    def __init__(self, layer: nn.Module, desc: Layer, path: LayerPath, max_rows: int):
        self.layer = layer
        self.attn_norm, self.ffn_norm = _Norm(layer.attn_norm), _Norm(layer.ffn_norm)
        self.attn = None if path.attention else _ATTENTION_STEPS[type(desc.attention)](layer.attn, max_rows)
        self.ffn = None if path.ffn else _FFN_STEPS[type(desc.ffn)](layer.ffn, max_rows)

    def __call__(self, x: torch.Tensor, xa: np.ndarray, h: np.ndarray, segments: list[Segment],
                 dtype: torch.dtype) -> None:
        """Add the layer's two blocks to the residual stream x [T, H] (float32; xa: its NumPy
        view, h: the normed input's buffer) in place. NumPy views, made once a step: torch's
        slicing and conversions cost microseconds each, and with the weights streaming
        through the caches every Python step between the kernels runs cold."""
        layer = self.layer
        if self.attn is not None:
            np.add(xa, self.attn(self.attn_norm(xa, h), segments), out=xa)
        else:
            x += layer.attn(layer.attn_norm(x.to(dtype)), segments).float()
        if self.ffn is not None:
            np.add(xa, self.ffn(self.ffn_norm(xa, h)), out=xa)
        else:
            x += layer.ffn(layer.ffn_norm(x.to(dtype))).float()


# The native chain's parts, in the order its `seconds` array holds them (decode_chain.h).
_CHAIN_PARTS = ("experts", "qkv", "o", "router", "attend", "small", "shared", "mlp")


class _Chain:
    """Every layer of the step in one native call (``native/src/decode_chain.h``), when all
    of them have its shape: one cache group; grouped-query attention (q|k|v and output
    projections with or without bias, per-head or no q/k norm) or latent attention in every
    layer; and a dense gated MLP or routed experts (any router ``_route`` covers, the same k in
    every layer) with or without shared experts. Same kernels, same order, same bits as the
    layer-by-layer calls; none of the Python between them."""

    def __init__(self, steps: list[_LayerStep], max_rows: int):
        first = steps[0].attn
        self.steps, self.group = steps, first.group
        self.moe = [s.ffn for s in steps if s.ffn.routed]
        self.k = self.moe[0].k if self.moe else 1
        self.native = first.chain(steps[0].attn_norm.w.shape[0], self.k, max_rows)
        for s in steps:
            s.attn.add_to(self.native, s, s.ffn.chain_block())
        # Bytes a step reads besides the experts and the cache (for a step profile).
        self.fixed = {"qkv": sum(s.attn.qkv_bytes for s in steps),
                      "o": sum(s.attn.o.native.bytes for s in steps),
                      "router": sum(m.logits.native.bytes for m in self.moe),
                      "shared": sum(_gated_bytes(m.shared) + (m.shared_gate.native.bytes if m.shared_gate else 0)
                                    for m in self.moe if m.shared is not None),
                      "mlp": sum(_gated_bytes(s.ffn) for s in steps if not s.ffn.routed)}
        self.attend_bytes = sum(s.attn.attend_bytes for s in steps)
        self.position_bytes = sum(s.attn.position_bytes for s in steps)
        # The chain counts the experts chosen in its table.
        self.recorder = self.moe[0].moe.recorder if self.moe else None
        self.counts = None if self.recorder is None else self.recorder.table([m.moe.layer for m in self.moe])

    def __call__(self, xa: np.ndarray, segments: list[Segment]) -> None:
        n = xa.shape[0]
        tables = _stack([seg.seq.table_array(self.group) for seg in segments])
        positions = np.fromiter((seg.start for seg in segments), dtype=np.int64, count=n)
        ids = np.empty((len(self.moe), n, self.k), dtype=np.int64)
        profile = step_profile.active
        seconds = None if profile is None else np.zeros(len(_CHAIN_PARTS))
        counting = self.recorder is not None and self.recorder.enabled
        self.native.run(xa, tables, positions, ids, seconds, *(self.counts if counting else (None, None)))
        if profile is not None:
            nbytes = dict(self.fixed, small=0, experts=sum(_distinct(c) * m.expert_bytes
                                                           for m, c in zip(self.moe, ids)),
                          attend=int(positions.sum() + n) * self.position_bytes + self.attend_bytes)
            for part, sec in zip(_CHAIN_PARTS, seconds):
                profile.add(part, float(sec), nbytes[part])


def _gated_bytes(mlp: _GatedStep) -> int:
    return mlp.gate_up.native.bytes + mlp.down.native.bytes


# How long the kernels' threads keep spinning after a step's last calls: longer than the
# Python between two steps (0.2-0.5 ms here), so that the next call does not begin with a
# sleeping thread to wake (in a VM, tens of microseconds in which the caller works alone);
# short enough that a generation's end leaves them spinning for no more than that.
_GAP_US = 2000


class DecodeStep:
    """The layers, final norm and LM head of a CPU-main-device model for one token of each
    of up to ``max_rows`` sequences, or (``build``) None when no layer would run natively. Which
    blocks run natively, and whether the chain runs them all, is the model's decode plan
    (``decode_path``): decided from the layers' descriptions, not from the modules here."""

    def __init__(self, model: nn.Module, plan: DecodePlan, max_rows: int):
        self.model = model
        self.max_rows = max_rows
        self.plan = plan
        hidden = model.norm.weight.shape[0]
        self.x = _Buffer(max_rows, hidden)  # the residual stream
        self.h = _Buffer(max_rows, hidden)  # the normed input of a block (one buffer for all layers)
        self.layers = [_LayerStep(layer, desc, path, max_rows)
                       for layer, desc, path in zip(model.layers, model.describe(), plan.layers)]
        self.chain = _Chain(self.layers, max_rows) if plan.chain else None
        self.norm = _Norm(model.norm)
        # The embedding table as NumPy (bf16 as its bits), which ``embed_rows`` reads: one
        # native call per step; F.embedding's dispatch and the copy into the residual stream
        # cost ~0.2 ms a token on caches the weights have just streamed through.
        self.embed = None if model.embed is None else _cache_view(model.embed)
        self.embed_stored = model.embed_stored  # a table held as stored (NativeLinear): its rows dequantized
        # A head the kernels do not read is a PyTorch Linear in the model dtype.
        self.head = _Linear(model.lm_head, "head") if model.lm_head.runs_native else None

    @classmethod
    def build(cls, model: nn.Module, max_rows: int) -> DecodeStep | None:
        plan = model.decode_plan()
        return cls(model, plan, max_rows) if plan.native else None

    def __call__(self, tokens: list[int], segments: list[Segment]) -> torch.Tensor:
        """tokens: one per segment -> float32 logits [T, V]. Decode rows by construction: the
        native parts ask for the decode paths themselves and need no torch mode; the PyTorch
        modules a step falls back to run in ``_torch_parts`` (entering and leaving those
        contexts for every step cost ~0.1 ms a token on cold caches)."""
        n = len(tokens)
        if n > self.max_rows:
            raise ValueError(f"{n} sequences in one step; the decode step was built for {self.max_rows}")
        # NumPy views: slicing the torch handles costs ~20 us each with cold caches, and only
        # the layer-by-layer path and a PyTorch head use them.
        xa, ha = self.x.a[:n], self.h.a[:n]
        if self.embed is not None:
            _native.embed_rows(self.embed, tokens, xa)
        else:
            self.embed_stored.native.dequantize_rows(tokens, xa)
        dtype = self.model.dtype
        if self.chain is not None:
            self.chain(xa, segments)
        else:
            with _torch_parts():
                for step in self.layers:
                    step(self.x.t[:n], xa, ha, segments, dtype)
        if self.head is not None:  # (a PyTorch head would have them spin against its threads)
            _native.stay_awake(_GAP_US)  # through the Python before the head
        self.norm(xa, ha)
        if self.head is None:
            with _torch_parts():
                return self.model.lm_head(self.h.t[:n].to(dtype)).float()
        logits = np.empty((n, self.head.out_features), dtype=np.float32)  # new: callers may keep it
        self.head(ha, logits)
        _native.stay_awake(_GAP_US)  # through the caller's sampling and bookkeeping before the next step
        return torch.from_numpy(logits)
