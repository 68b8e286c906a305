"""Routed experts: where they are stored, where they run, and the reference computation.

A placement ``{layer: expert ids}`` names the experts of each MoE layer that live on the
main device (a missing layer: none). Those are materialised there once, dequantized to the
compute dtype, requantized to weight-only int8, or kept in their stored 4-bit codes (as the
Plan chose), with gate and up fused into one matrix (``ResidentExperts``). All others stay in
host memory in their stored form, mmap'd and possibly quantized (``HostExperts``), and are computed on the
CPU by ``cpu_experts_forward``, which dequantizes each needed expert per call: the plain
PyTorch reference the native kernels (``native_experts``) are tested against and fall
back to. The two partial sums are added by the MoE block.

Checkpoint layouts of one layer's experts (``prefix`` is e.g. ``model.layers.3.mlp``):
- per expert (every hub checkpoint, and what transformers 5 ``save_pretrained`` writes for
  all families but GPT-OSS): ``prefix.experts.{e}.{gate,up,down}_proj.weight`` (Mixtral:
  ``w1``, ``w3``, ``w2``);
- fused (transformers' in-memory layout): ``prefix.experts.gate_up_proj`` [E, 2I, H] with
  gate rows first, ``prefix.experts.down_proj`` [E, H, I];
- GPT-OSS: ``prefix.experts.gate_up_proj`` [E, H, 2I] (as x @ W, gate/up interleaved by
  column) and ``down_proj`` [E, I, H] in float checkpoints, or MXFP4 blocks whose logical
  shape is [E, 2I, H] / [E, H, I] (as x @ W^T); plus ``gate_up_proj_bias``, ``down_proj_bias``.
  Read from a GGUF file, GPT-OSS experts come per expert, gate and up apart, each with a
  ``.bias``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from hybridmoe.backend.engine import decode_experts, stored_experts
from hybridmoe.backend.models.layer_description import CLAMPED_SWIGLU
from hybridmoe.backend.formats.int4_weights import Int4Weight, cat_rows
from hybridmoe.backend.formats.int4_weights import from_quant as int4_from_quant
from hybridmoe.backend.formats.int8_weights import Int8Weight, quantize_int8
from hybridmoe.backend.engine.stored_linear import StoredLinear
from hybridmoe.backend.engine.layers import activation
from hybridmoe.backend.formats.weights import WeightSource, dense, missing_tensor, require


@dataclass
class ExpertMatrices:
    """One expert's weights as [out, in] matrices (views allowed): either `gate_up` (fused:
    gate rows then up rows, or interleaved for GPT-OSS) or separate `gate` and `up`; biases
    where the family has them (GPT-OSS)."""

    down: torch.Tensor
    gate_up: torch.Tensor | None = None
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    def fused(self, interleave: bool = False) -> ExpertMatrices:
        """The same expert with gate and up in one matrix (one matmul instead of two)."""
        if self.gate_up is not None:
            return self
        bias = None if self.gate_bias is None else fuse_rows(self.gate_bias, self.up_bias, interleave)
        return ExpertMatrices(down=self.down, gate_up=fuse_rows(self.gate, self.up, interleave), gate_up_bias=bias,
                              down_bias=self.down_bias)


def fuse_rows(gate: torch.Tensor, up: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Gate and up (matrices or biases) as one: gate rows then up rows, or interleaved
    (the GPT-OSS convention: gate in even rows, up in odd rows)."""
    if interleave:
        return torch.stack((gate, up), dim=1).reshape(-1, *gate.shape[1:])
    return torch.cat((gate, up))


class ExpertActivation:
    """The gated nonlinearity between the two projections: a named activation ("silu") of
    gate times up, or CLAMPED_SWIGLU; `interleaved`: a fused gate_up matrix alternates gate
    and up rows (else gate rows, then up rows)."""

    def __init__(self, kind: str = "silu", *, alpha: float = 1.702, limit: float = 7.0, interleaved: bool = False):
        self.kind = kind
        self.alpha, self.limit = alpha, limit
        self.interleaved = interleaved
        self.act = activation(kind) if kind != CLAMPED_SWIGLU else None

    def __call__(self, x: torch.Tensor, m: ExpertMatrices) -> torch.Tensor:
        if m.gate_up is None:
            gate, up = _linear(x, m.gate, m.gate_bias), _linear(x, m.up, m.up_bias)
        else:
            gate_up = _linear(x, m.gate_up, m.gate_up_bias)
            if self.interleaved:
                gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            else:
                gate, up = gate_up.chunk(2, dim=-1)
        if self.kind == CLAMPED_SWIGLU:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return self.act(gate) * up


def _linear(x: torch.Tensor, w: torch.Tensor | Int8Weight | Int4Weight | StoredLinear,
            b: torch.Tensor | None) -> torch.Tensor:
    # Expert biases (GPT-OSS) are added after the product is rounded, as the reference does.
    y = F.linear(x, w) if isinstance(w, torch.Tensor) else w.linear(x)
    return y if b is None else y + b


def expert_mlp(x: torch.Tensor, m: ExpertMatrices, act: ExpertActivation) -> torch.Tensor:
    return _linear(act(x, m), m.down, m.down_bias)


# --- where the experts are stored -----------------------------------------------------


class ExpertStore:
    """One MoE layer's routed experts as the checkpoint stores them (read lazily, kept).

    Per-expert tensors may carry biases (GPT-OSS read from a GGUF file, where llama.cpp
    stores gate and up separately). `fused_xw_with_biases`: the family's fused tensors carry
    ``gate_up_proj_bias`` / ``down_proj_bias``, and stored as floats they are laid out for
    x @ W ([in, out]; GPT-OSS's checkpoints).
    """

    def __init__(self, weights: WeightSource, prefix: str, n_experts: int, hidden: int, intermediate: int,
                 *, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 fused_xw_with_biases: bool = False):
        self.weights = weights
        self.prefix = prefix
        self.n_experts, self.hidden, self.intermediate = n_experts, hidden, intermediate
        self.names = names
        biased = fused_xw_with_biases
        self._stored: dict[int, dict[str, Any]] = {}
        fused = f"{prefix}.experts.gate_up_proj"
        self.layout = "fused" if fused in weights else "per_expert"
        self.transposed = False
        if self.layout == "fused":
            e, h, i = n_experts, hidden, intermediate
            gate_up = weights.get(fused)
            # Float GPT-OSS tensors are stored for x @ W ([in, out]); everything else [out, in].
            self.transposed = biased and isinstance(gate_up, torch.Tensor)
            want_gu, want_down = ((e, h, 2 * i), (e, i, h)) if self.transposed else ((e, 2 * i, h), (e, h, i))
            self._gate_up = require(weights, fused, want_gu)
            self._down = require(weights, f"{prefix}.experts.down_proj", want_down)
            self._gate_up_bias = require(weights, f"{fused}_bias", (e, 2 * i)) if biased else None
            self._down_bias = require(weights, f"{prefix}.experts.down_proj_bias", (e, h)) if biased else None
        else:
            # Presence is checked now (name lookups only) so that an incomplete checkpoint
            # fails at load; shapes are checked when an expert is first read.
            for e in range(n_experts):
                for name in names:
                    if f"{prefix}.experts.{e}.{name}.weight" not in weights:
                        raise missing_tensor(weights, f"{prefix}.experts.{e}.{name}.weight")

    def stored(self, e: int) -> dict[str, Any]:
        """Expert e's stored objects (mmap'd tensors or quant objects, [out, in] unless
        `transposed`), read once and kept: they are views, not copies."""
        got = self._stored.get(e)
        if got is not None:
            return got
        if not 0 <= e < self.n_experts:
            raise ValueError(f"expert {e} out of range for {self.prefix} ({self.n_experts} experts)")
        if self.layout == "fused":
            got = {"gate_up": self._gate_up[e], "down": self._down[e]}
            if self._gate_up_bias is not None:
                got.update(gate_up_bias=self._gate_up_bias[e], down_bias=self._down_bias[e])
        else:
            w, h, i, p = self.weights, self.hidden, self.intermediate, f"{self.prefix}.experts.{e}"
            got = {}
            for role, name, shape in (("gate", self.names[0], (i, h)), ("up", self.names[1], (i, h)),
                                      ("down", self.names[2], (h, i))):
                got[role] = require(w, f"{p}.{name}.weight", shape)
                if f"{p}.{name}.bias" in w:
                    got[f"{role}_bias"] = require(w, f"{p}.{name}.bias", (shape[0],))
        self._stored[e] = got
        return got

    def matrices(self, e: int, dtype: torch.dtype, device: torch.device | str, *, fused: bool = False,
                 interleave: bool = False) -> ExpertMatrices:
        """Expert e as [out, in] matrices in `dtype` on `device` (dequantizing as needed).

        A float tensor already in `dtype` on the CPU comes back as the stored view itself."""
        return matrices_of(self.stored(e), dtype, device, transposed=self.transposed, fused=fused,
                           interleave=interleave)


def matrices_of(stored: dict[str, Any], dtype: torch.dtype, device: torch.device | str | None, *,
                transposed: bool = False, fused: bool = False, interleave: bool = False) -> ExpertMatrices:
    """One expert's stored objects (``ExpertStore.stored``, or copies of them on another device)
    as [out, in] matrices in `dtype` on `device`, dequantized where they are."""
    parts = {role: dense(t, dtype, device) for role, t in stored.items()}
    if transposed:
        parts["gate_up"], parts["down"] = parts["gate_up"].t(), parts["down"].t()
    m = ExpertMatrices(**parts)
    return m.fused(interleave) if fused else m


# --- where the experts run ------------------------------------------------------------


class ExpertGroup:
    """The experts of one layer that run on one device."""

    # Held as the stacks ``decode_experts``' launches read (ResidentExperts), or one at a time.
    stacked: ClassVar[bool] = False

    def __init__(self, ids: Collection[int], n_experts: int, device: torch.device | str, act: ExpertActivation):
        self.ids = tuple(sorted(set(int(e) for e in ids)))
        self.n_experts = n_experts
        self.device = torch.device(device)
        self.act = act
        self.holds = torch.zeros(n_experts + 1, dtype=torch.bool, device=self.device)  # last: id -1
        if self.ids:
            self.holds[list(self.ids)] = True
        self.holds_host = self.holds if self.device.type == "cpu" else self.holds.cpu()

    def __len__(self) -> int:
        return len(self.ids)

    def weights_of(self, e: int) -> ExpertMatrices:
        raise NotImplementedError


class ResidentExperts(ExpertGroup):
    """Experts materialised once on the main device, gate and up fused, in one of four forms:
    ``"dense"`` (the compute dtype), ``"int8"`` (weight-only, one scale per output row; see
    ``int8_weights``), ``"int4"`` (the stored 4-bit codes and group scales as they are; see
    ``int4_weights``; a matrix not stored in a 4-bit format is held as int8) or ``"stored"``
    (a GGUF's blocks as the file stores them, gate and up apart; see ``stored_experts``). Each
    part of all the group's experts is one stacked tensor, so the group's memory is exactly
    ``nbytes`` (what the Plan counts), in a few allocations."""

    FORMS = ("dense", "int8", "int4", "stored")
    stacked = True

    def __init__(self, store: ExpertStore, ids: Collection[int], dtype: torch.dtype, device, act: ExpertActivation,
                 *, form: str = "dense"):
        super().__init__(ids, store.n_experts, device, act)
        if form not in self.FORMS:
            raise ValueError(f"resident expert form {form!r}; expected one of {self.FORMS}")
        self.form = form
        self.slot = {e: j for j, e in enumerate(self.ids)}  # expert id -> index in the stacks
        self._parts: dict[str, torch.Tensor] = {}
        self._int4: dict[str, tuple[str, int]] = {}  # role -> (table, group) of its 4-bit matrices
        self._types: dict[str, tuple[GGMLQuantizationType, int]] = {}  # stored: role -> (type, columns)
        n = len(self.ids)
        for j, e in enumerate(self.ids):
            for name, t in self._expert_parts(store, e, dtype, first=j == 0).items():
                if name not in self._parts:
                    self._parts[name] = torch.empty((n, *t.shape), dtype=t.dtype, device=self.device)
                self._parts[name][j].copy_(t)
        self._matrices = {e: self._view(j) for e, j in self.slot.items()}
        # For the decode kernels (``decode_experts``): each expert's index in the stacks, -1
        # for the experts this group does not hold.
        self.slot_of = torch.full((self.n_experts,), -1, dtype=torch.int32)
        self.slot_of[list(self.slot)] = torch.tensor(list(self.slot.values()), dtype=torch.int32)
        self.slot_of = self.slot_of.to(self.device)
        roles = tuple(self._types) if self.form == "stored" else ("gate_up", "down")
        self.stacks = {role: self._stack(role) for role in roles} if n else {}

    def _expert_parts(self, store: ExpertStore, e: int, dtype: torch.dtype, *, first: bool) -> dict[str, torch.Tensor]:
        if self.form == "stored":
            return self._stored_parts(store, e, dtype, first=first)
        int4 = self._int4_matrices(store, e) if self.form == "int4" else {}
        if first:
            self._int4 = {role: (w.table, w.group) for role, w in int4.items()}
        elif {role: (w.table, w.group) for role, w in int4.items()} != self._int4:
            raise ValueError(f"{store.prefix}: expert {e} is stored in another format than expert {self.ids[0]}")
        # Quantized from float32 so that int8 rounds the checkpoint's numbers once.
        widened = self.form != "dense"
        m = store.matrices(e, torch.float32 if widened else dtype, self.device, fused=True,
                           interleave=self.act.interleaved) if len(int4) < 2 else None
        parts: dict[str, torch.Tensor] = {}
        for role in ("gate_up", "down"):
            if role in int4:
                w = int4[role]
                parts.update({f"{role}_codes": w.codes, f"{role}_scale": w.scale})
                if w.min is not None:
                    parts[f"{role}_min"] = w.min
            elif widened:
                q = quantize_int8(getattr(m, role), dtype)
                parts[role], parts[f"{role}_scale"] = q.q, q.scale
            else:
                parts[role] = getattr(m, role)
        stored = store.stored(e)
        if "gate_bias" in stored:  # GGUF: gate and up apart
            parts["gate_up_bias"] = fuse_rows(stored["gate_bias"], stored["up_bias"], self.act.interleaved)
        elif "gate_up_bias" in stored:
            parts["gate_up_bias"] = stored["gate_up_bias"]
        if "down_bias" in stored:
            parts["down_bias"] = stored["down_bias"]
        for role in ("gate_up_bias", "down_bias"):
            if role in parts:
                parts[role] = parts[role].to(device=self.device, dtype=dtype)
        return parts

    def _stored_parts(self, store: ExpertStore, e: int, dtype: torch.dtype, *, first: bool) -> dict[str, torch.Tensor]:
        """Expert e's gate, up and down as the file's GGUF blocks [rows, bytes a row] (views of the
        file, copied into the stacks), and its biases in the compute dtype."""
        stored = store.stored(e)
        i, interleaved = store.intermediate, self.act.interleaved
        parts: dict[str, torch.Tensor] = {}
        types = {}
        for role in ("gate", "up", "down"):
            source = "gate_up" if role != "down" and "gate_up" in stored else role
            got = stored_experts.blocks_of(stored[source])
            if got is None:
                raise ValueError(f"{store.prefix}: expert {e}'s {source} is {stored[source]!r}; the stored form holds "
                                 "GGUF block matrices of the types the GPU kernels read (hold it as int8 or dense)")
            qtype, blocks = got
            if source == "gate_up":  # a fused matrix's rows: gate then up, or interleaved (GPT-OSS)
                up = int(role == "up")
                blocks = blocks[up::2] if interleaved else blocks[up * i : (up + 1) * i]
            parts[role] = blocks
            types[role] = (qtype, int(stored[source].shape[1]))
        if first:
            self._types = types
        elif types != self._types:
            raise ValueError(f"{store.prefix}: expert {e} is stored in another format than expert {self.ids[0]}")
        if "gate_bias" in stored:
            parts.update(gate_bias=stored["gate_bias"], up_bias=stored["up_bias"])
        elif "gate_up_bias" in stored:
            b = stored["gate_up_bias"]
            parts.update(gate_bias=b[0::2] if interleaved else b[:i], up_bias=b[1::2] if interleaved else b[i:])
        if "down_bias" in stored:
            parts["down_bias"] = stored["down_bias"]
        return {name: t if name in types else t.to(device=self.device, dtype=dtype) for name, t in parts.items()}

    def _int4_matrices(self, store: ExpertStore, e: int) -> dict[str, Int4Weight]:
        """Expert e's matrices that are stored in a 4-bit format, in that form on the device."""
        stored = store.stored(e)
        out = {"down": int4_from_quant(stored["down"], self.device)}
        if "gate_up" in stored:
            out["gate_up"] = int4_from_quant(stored["gate_up"], self.device)
        else:
            halves = [int4_from_quant(stored[role], self.device) for role in ("gate", "up")]
            out["gate_up"] = None if None in halves else cat_rows(halves, interleave=self.act.interleaved)
        return {role: w for role, w in out.items() if w is not None}

    def _view(self, j: int) -> ExpertMatrices:
        p = {name: t[j] for name, t in self._parts.items()}
        if self.form == "stored":
            w = {role: self._stack(role).matrix(j) for role in self._types}
            return ExpertMatrices(down=w["down"], gate=w["gate"], up=w["up"], gate_bias=p.get("gate_bias"),
                                  up_bias=p.get("up_bias"), down_bias=p.get("down_bias"))
        roles = {}
        for role in ("gate_up", "down"):
            if role in self._int4:
                table, group = self._int4[role]
                roles[role] = Int4Weight(p[f"{role}_codes"], p[f"{role}_scale"], p.get(f"{role}_min"), table, group)
            elif self.form != "dense":
                roles[role] = Int8Weight(p[role], p[f"{role}_scale"])
            else:
                roles[role] = p[role]
        return ExpertMatrices(down=roles["down"], gate_up=roles["gate_up"], gate_up_bias=p.get("gate_up_bias"),
                              down_bias=p.get("down_bias"))

    def _stack(self, role: str) -> decode_experts.Stack | stored_experts.StoredStack:
        """All the group's `role` ("gate_up" or "down"; stored: "gate", "up" or "down") matrices as
        one ``decode_experts.Stack`` (``stored_experts.StoredStack``)."""
        p = self._parts
        bias = p.get(f"{role}_bias")
        if self.form == "stored":
            qtype, cols = self._types[role]
            return stored_experts.StoredStack(qtype, p[role], cols, bias)
        if role in self._int4:
            table, group = self._int4[role]
            values = getattr(self._matrices[self.ids[0]], role).table_tensor()  # the same for every expert
            return decode_experts.Stack("int4", p[f"{role}_codes"], p[f"{role}_scale"], p.get(f"{role}_min"),
                                        values, table, group, bias)
        if self.form != "dense":
            return decode_experts.Stack("int8", p[role], p[f"{role}_scale"], bias=bias)
        return decode_experts.Stack("dense", p[role], bias=bias)

    @property
    def nbytes(self) -> int:
        """Bytes the group holds on its device."""
        return sum(t.numel() * t.element_size() for t in self._parts.values())

    def weights_of(self, e: int) -> ExpertMatrices:
        return self._matrices[e]

    def decode(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """``experts_forward`` of a few tokens as the decode kernels' two launches (``decode_experts``,
        or ``stored_experts`` for the stored form)."""
        act, s = self.act, self.stacks
        if self.form == "stored":
            return stored_experts.forward(x, topk_ids, topk_weights, self.slot_of, s["gate"], s["up"], s["down"],
                                          act.kind, alpha=act.alpha, limit=act.limit)
        return decode_experts.forward(x, topk_ids, topk_weights, self.slot_of, s["gate_up"], s["down"], act.kind,
                                      interleaved=act.interleaved, alpha=act.alpha, limit=act.limit)


class HostExperts(ExpertGroup):
    """Experts left in host memory in their stored form; each call dequantizes what it uses."""

    def __init__(self, store: ExpertStore, ids: Collection[int], dtype: torch.dtype, act: ExpertActivation):
        super().__init__(ids, store.n_experts, "cpu", act)
        self.store = store
        self.dtype = dtype

    def weights_of(self, e: int) -> ExpertMatrices:
        return self.store.matrices(e, self.dtype, "cpu")


def routed_groups(topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertGroup,
                  host_ids: torch.Tensor | None = None):
    """(expert id, token indices, routing weights) for each expert of `experts` that the
    (token, slot) pairs reach, in ascending expert id; pairs of other experts (or id -1) are
    left out. topk_ids [T, k] int64 and topk_weights [T, k] on the group's device.

    `host_ids`: the same ids already in host memory. The grouping is then worked out on the
    host and only the token indices go to the device, so the host never waits for the device
    (grouping on a GPU needs its counts back on the host, a wait for all queued work)."""
    if not len(experts):
        return
    k = topk_ids.shape[1]
    if host_ids is None:
        flat, holds = topk_ids.reshape(-1), experts.holds
    else:
        flat, holds = host_ids.reshape(-1), experts.holds_host
    pairs = holds[flat].nonzero().squeeze(1)
    if pairs.numel() == 0:
        return
    ids = flat[pairs]
    order = torch.argsort(ids, stable=True)
    pairs, ids = pairs[order], ids[order]
    counts = torch.bincount(ids, minlength=experts.n_experts).tolist()
    if pairs.device != topk_weights.device:
        pairs = pairs.pin_memory().to(topk_weights.device, non_blocking=True)
    tokens = pairs // k
    weights = topk_weights.reshape(-1)[pairs]
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        yield e, tokens[start : start + count], weights[start : start + count]
        start += count


def add_expert_output(out: torch.Tensor, x: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor,
                      m: ExpertMatrices, act: ExpertActivation) -> None:
    """out[tokens] += weights * expert(x[tokens]), in float32."""
    y = expert_mlp(x[tokens], m, act)
    # The product keeps the router's dtype promotion (bf16 x float32 weights -> float32).
    out.index_add_(0, tokens, (y * weights[:, None]).float())


def decode_kernels_apply(x: torch.Tensor, experts: ExpertGroup) -> bool:
    """Whether `experts_forward` of `x` runs as ``decode_experts``' two kernel launches."""
    return experts.stacked and decode_experts.applies(x, experts.act.kind)


def experts_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: ExpertGroup,
                    host_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over the (token, slot) pairs routed to an expert of `experts` of
    weight * expert(x[token]); pairs of other experts (or id -1) contribute nothing.

    x [T, H], topk_ids [T, k] int64, topk_weights [T, k], all on the group's device.
    Returns [T, H] in float32: the k contributions of a token (and the main-device and CPU
    halves) are summed in float32 and rounded once by the caller, as transformers' default
    (grouped) experts path does. On CUDA, calls of a few tokens run as the two launches of
    ``decode_experts``; others loop over the experts actually hit, each over all its tokens
    at once. `host_ids`: see ``routed_groups``.
    """
    if decode_kernels_apply(x, experts):
        try:
            return experts.decode(x, topk_ids, topk_weights)
        except Exception as error:  # noqa: BLE001 - a card or Triton build the kernels cannot run on
            decode_experts.failed(x.device, error)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, tokens, weights in routed_groups(topk_ids, topk_weights, experts, host_ids):
        add_expert_output(out, x, tokens, weights, experts.weights_of(e), experts.act)
    return out


def cpu_experts_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: HostExperts) -> torch.Tensor:
    """The CPU half of an MoE layer: the partial sum over the CPU-resident experts.

    The plain PyTorch reference for the native CPU kernels (same contract): x [T, H] in the
    compute dtype, topk_ids [T, k] int64 (ids not held by `experts` are skipped),
    topk_weights [T, k]; all on the CPU. Returns the float32 partial sum [T, H].
    """
    return experts_forward(x, topk_ids, topk_weights, experts)
