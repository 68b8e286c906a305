"""Which GGUF tensors a Hugging Face checkpoint becomes, and how each is read.

Names come from gguf-py's ``TensorNameMap`` (the table llama.cpp itself maintains); on top of
it, the layouts llama.cpp wants differently from the checkpoint:

* routed experts, stored one tensor per expert, become one ``[E, out, in]`` tensor per
  projection and layer (``blk.N.ffn_{gate,up,down}_exps``), read one expert at a time;
* ``llama`` arch (Mixtral): Q and K rows are permuted so that ggml's interleaved ("normal")
  RoPE computes what transformers' rotate-half RoPE does;
* where the family says so (``GGUF_SPLITS_KV_B``: DeepSeek-V2/V3, Kimi K2.x): MLA's ``kv_b_proj`` is split into ``attn_k_b``
  (transposed, per head ``[kv_lora, nope]``) and ``attn_v_b`` (``[v, kv_lora]``), the layout
  current llama.cpp requires for its absorbed-MLA attention with the compressed cache;
* DeepSeek's and GLM's router bias ``e_score_correction_bias`` is ``blk.N.exp_probs_b.bias``;
* where the family says so (``GGUF_SPLITS_FUSED_EXPERTS``: GPT-OSS): the fused expert tensors (``mlp.experts.gate_up_proj`` with gate and up
  interleaved row by row, ``down_proj``, and their biases) are split into
  ``ffn_{gate,up,down}_exps`` and their ``.bias`` tensors, de-interleaved; MXFP4 blocks stay
  MXFP4 blocks (rows are whole blocks, so selecting every other row needs no re-encoding);
  the float layout transformers writes (``[E, in, out]``, for ``x @ W``) is transposed back
  to ``[E, out, in]``; the attention sinks are ``blk.N.attn_sinks.weight``;
* ``glm4moe``: the NextN (MTP) layers after the decoder stack are kept as further blocks,
  their extra tensors under ``blk.N.nextn.*``, as llama.cpp's converter keeps them (its
  loader expects them when ``nextn_predict_layers`` is set; see ``mtp_layers``).

Each ``OutTensor`` reads its data as a sequence of pieces (consecutive slices along its
first dimension: one expert, or a block of rows) so that memory stays bounded by one piece
whatever the tensor's size. Tensors llama.cpp does not use (MTP layers of the families whose
llama.cpp graph has no place for them, vision towers, rotary caches) are left out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import torch

from hybridmoe.backend.formats.quant import QuantTensor
from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models.families import family_by_gguf_arch

Piece = torch.Tensor | QuantTensor
# Pieces of about this many weights: a few tens of MB of float32 while encoding.
PIECE_WEIGHTS = 8 * 1024 * 1024

_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# GPT-OSS fused experts: model.layers.N.mlp.experts.{gate_up_proj,down_proj}[_bias]
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_SKIPPED = re.compile(r".*(rotary_emb\.inv_freq|\.rotary_emb\..*)$")


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the GGUF file.

    ``role`` drives its storage type (see ``types``): ``vector`` (norms, biases, 1-D),
    ``router``, ``token_embd``, ``output``, ``experts`` or ``matrix``. ``read(source)`` yields
    the pieces from an open weight source; ``layer`` groups tensors read together.
    """

    name: str
    shape: tuple[int, ...]  # torch order (outermost first); GGUF's ne is the reverse
    role: str
    sources: tuple[str, ...]  # the checkpoint tensors it is made of, for messages
    source_format: str  # "float", or the QuantTensor format of its sources ("int4_g32", "fp8_block", ...)
    read: Callable[[Any], Iterator[Piece]]
    layer: int | None = None

    @property
    def row(self) -> int:
        return self.shape[-1]

    @property
    def n_weights(self) -> int:
        return math.prod(self.shape)


def _format(t: Any) -> str:
    return t.format if isinstance(t, QuantTensor) else "float"


def _floats(t: Piece) -> torch.Tensor:
    return t.dequantize(torch.float32) if isinstance(t, QuantTensor) else t.to(torch.float32)


def _row_pieces(name: str) -> Callable[[Any], Iterator[Piece]]:
    """One checkpoint tensor, in blocks of rows (views of the file mapping)."""

    def read(source: Any) -> Iterator[Piece]:
        t = source.get(name)
        if t.dim() < 2:
            yield t
            return
        per_row = math.prod(t.shape[1:])
        step = max(1, PIECE_WEIGHTS // per_row)
        for a in range(0, t.shape[0], step):
            yield t[a : a + step]

    return read


def _expert_pieces(names: list[str]) -> Callable[[Any], Iterator[Piece]]:
    def read(source: Any) -> Iterator[Piece]:
        for name in names:
            yield source.get(name)

    return read


def _llama_permute(name: str, n_head: int) -> Callable[[Any], Iterator[Piece]]:
    """Q/K rows reordered from rotate-half pairs (i, i + d/2) to interleaved pairs (2i, 2i+1):
    row h*d + 2i + j of the result is row h*d + j*d/2 + i of the checkpoint."""

    def read(source: Any) -> Iterator[Piece]:
        w = _floats(source.get(name))
        rows = w.shape[0]
        yield w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    return read


def _kv_b_part(name: str, n_head: int, nope: int, v: int, part: str) -> Callable[[Any], Iterator[Piece]]:
    """attn_k_b [n_head, kv_lora, nope] (the nope rows of each head, transposed) or
    attn_v_b [n_head, v, kv_lora] from kv_b_proj [n_head * (nope + v), kv_lora]."""

    def read(source: Any) -> Iterator[Piece]:
        kv = _floats(source.get(name))
        kv = kv.reshape(n_head, nope + v, kv.shape[-1])
        if part == "k":
            yield kv[:, :nope, :].transpose(1, 2).contiguous()
        else:
            yield kv[:, nope:, :].contiguous()

    return read


def _role(gguf_name: str, n_dims: int) -> str:
    if gguf_name == "token_embd.weight":
        return "token_embd"
    if gguf_name == "output.weight":
        return "output"
    if n_dims <= 1 or not gguf_name.endswith(".weight") or gguf_name.endswith("_norm.weight"):
        return "vector"
    if gguf_name.endswith("ffn_gate_inp.weight"):
        return "router"
    return "matrix"


def mtp_layers(source: Any, arch: str, config: dict[str, Any], n_layers: int, *, location: str) -> int:
    """How many NextN / MTP layers (``model.layers.N`` for N >= `n_layers`) the GGUF keeps.

    Only families with ``GGUF_KEEPS_MTP`` keep them, and only what the checkpoint holds:
    transformers' save_pretrained and many finetunes drop them although the config still
    announces ``num_nextn_predict_layers``, and such a file is written without (its
    ``nextn_predict_layers`` says 0). A layer held in part would make llama.cpp refuse the
    file, so it is reported as a damaged checkpoint instead.
    """
    if not family_by_gguf_arch(arch, location).GGUF_KEEPS_MTP:
        return 0
    announced = int(config.get("num_nextn_predict_layers") or 0)
    by_layer: dict[int, set[str]] = {}
    for name in source.keys():
        m = _LAYER.match(name)
        if m:
            by_layer.setdefault(int(m.group(1)), set()).add(name[m.end():])
    extra = sorted(i for i in by_layer if i >= n_layers)
    if not extra:
        return 0
    if extra != list(range(n_layers, n_layers + announced)):
        raise ModelError(
            f"{location}: the checkpoint holds layers {extra[0]}..{extra[-1]} after its {n_layers} decoder "
            f"layers, but config.json announces {announced} NextN layer(s).",
            "The checkpoint does not match its config.json; download it again.",
        )
    # A NextN layer is a decoder layer (like the last one) plus its merge projection and norms.
    needed = by_layer.get(n_layers - 1, set()) | {"eh_proj.weight", "enorm.weight", "hnorm.weight"}
    for i in extra:
        missing = sorted(needed - by_layer[i])
        if missing:
            raise ModelError(f"{location}: NextN layer {i} is incomplete (no model.layers.{i}.{missing[0]}).",
                             "The checkpoint is incomplete; download it again.")
    return len(extra)


def plan_tensors(source: Any, arch: str, config: dict[str, Any], n_layers: int, *,
                 location: str, n_mtp: int = 0) -> list[OutTensor]:
    """The GGUF tensors of the text model in `source` (a WeightSource with plain HF names).

    `config` is the text config, `n_layers` the decoder layers, `n_mtp` the NextN layers after
    them that are kept (``mtp_layers``); layers beyond are dropped, as llama.cpp's converter
    does for architectures whose graph has no place for them.
    """
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    kept_layers = n_layers + n_mtp
    names = gguf.get_tensor_name_map(arch_enum, kept_layers)
    tie = bool(config.get("tie_word_embeddings", False))
    n_head = int(config["num_attention_heads"])
    n_kv_head = int(config.get("num_key_value_heads") or n_head)
    family = family_by_gguf_arch(arch, location)
    permutes_qk = family.GGUF_PERMUTES_QK

    out: list[OutTensor] = []
    experts: dict[tuple[int, str], dict[int, str]] = {}
    fused: dict[int, dict[str, str]] = {}
    unknown: list[str] = []
    for hf in sorted(source.keys(), key=_natural):
        if not hf.startswith(("model.", "lm_head.")) or _SKIPPED.match(hf):
            continue  # vision towers, projectors, rotary caches: not part of the text model
        m = _LAYER.match(hf)
        layer = int(m.group(1)) if m else None
        if layer is not None and layer >= kept_layers:
            continue  # MTP / NextN layers llama.cpp has no use for
        if hf == "lm_head.weight" and tie:
            continue
        e = _EXPERT.fullmatch(hf)
        if e:
            experts.setdefault((int(e.group(1)), _PROJ[e.group(3)]), {})[int(e.group(2))] = hf
            continue
        f = _FUSED.fullmatch(hf) if family.GGUF_SPLITS_FUSED_EXPERTS else None
        if f:
            fused.setdefault(int(f.group(1)), {})[f.group(2) + (f.group(3) or "")] = hf
            continue
        t = source.get(hf)
        shape, fmt = tuple(int(d) for d in t.shape), _format(t)

        if family.GGUF_SPLITS_KV_B and hf.endswith("self_attn.kv_b_proj.weight"):
            nope, v = int(config["qk_nope_head_dim"]), int(config["v_head_dim"])
            kv_lora = shape[-1]
            if shape[0] != n_head * (nope + v):
                raise ModelError(f"{location}: {hf} has shape {shape}, expected "
                                 f"[{n_head * (nope + v)}, {kv_lora}] from the config.",
                                 "The checkpoint does not match its config.json; download it again.")
            for part, gshape in (("k", (n_head, kv_lora, nope)), ("v", (n_head, v, kv_lora))):
                out.append(OutTensor(f"blk.{layer}.attn_{part}_b.weight", gshape, "matrix", (hf,), fmt,
                                     _kv_b_part(hf, n_head, nope, v, part), layer))
            continue
        if hf.endswith("mlp.gate.e_score_correction_bias"):
            out.append(OutTensor(f"blk.{layer}.exp_probs_b.bias", shape, "vector", (hf,), fmt,
                                 _row_pieces(hf), layer))
            continue
        gguf_name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            unknown.append(hf)
            continue
        if hf.endswith("self_attn.sinks"):
            gguf_name += ".weight"  # llama.cpp loads the sinks as blk.N.attn_sinks.weight
        read = _row_pieces(hf)
        if permutes_qk and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = n_head if ".q_proj." in hf else n_kv_head
            read = _llama_permute(hf, heads)
        out.append(OutTensor(gguf_name, shape, _role(gguf_name, len(shape)), (hf,), fmt, read, layer))

    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UnsupportedModelError(
            f"{location}: tensors {', '.join(unknown[:3])}{more} have no GGUF counterpart for arch '{arch}'.",
            "The checkpoint holds parts this converter does not know; use a GGUF published for this model.",
        )
    out.extend(_merged_experts(source, experts, location))
    hidden = int(config["hidden_size"])
    for layer, parts in sorted(fused.items()):
        out.extend(_split_fused_experts(source, layer, parts, hidden, location))
    out.sort(key=lambda t: (-1 if t.layer is None and t.name.startswith("token_embd") else
                            (t.layer if t.layer is not None else 1 << 30), t.name))
    return out


def _merged_experts(source: Any, experts: dict[tuple[int, str], dict[int, str]], location: str) -> list[OutTensor]:
    out = []
    for (layer, proj), by_index in sorted(experts.items()):
        n = max(by_index) + 1
        missing = [i for i in range(n) if i not in by_index]
        if missing:
            raise ModelError(f"{location}: layer {layer} has no {proj} projection for expert {missing[0]}.",
                             "The checkpoint is incomplete; download it again.")
        ordered = [by_index[i] for i in range(n)]
        first = source.get(ordered[0])
        shape = tuple(int(d) for d in first.shape)
        out.append(OutTensor(f"blk.{layer}.ffn_{proj}_exps.weight", (n, *shape), "experts", tuple(ordered),
                             _format(first), _expert_pieces(ordered), layer))
    return out


def _split_fused_experts(source: Any, layer: int, parts: dict[str, str], hidden: int,
                         location: str) -> list[OutTensor]:
    """GPT-OSS: one layer's fused experts as llama.cpp's separate gate / up / down tensors.

    ``gate_up_proj`` interleaves the two projections by output row (gate rows 0, 2, 4, ...,
    up rows 1, 3, 5, ...; the bias likewise), which is how GPT-OSS computes them; llama.cpp
    wants them apart. MXFP4 tensors arrive ``[E, out, in]`` and float ones ``[E, in, out]``
    (transformers keeps them for ``x @ W``); both leave as ``[E, out, in]``.
    """
    prefix = f"model.layers.{layer}.mlp.experts"
    for key in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        if key not in parts:
            raise ModelError(f"{location}: layer {layer} has no {prefix}.{key}.",
                             "The checkpoint is incomplete; download it again.")
    gate_up, down = source.get(parts["gate_up_proj"]), source.get(parts["down_proj"])
    stored_for_x_at_w = isinstance(gate_up, torch.Tensor)
    n, a, b = (int(d) for d in gate_up.shape)
    two_i = b if stored_for_x_at_w else a
    inner = two_i // 2
    want_gu = (n, hidden, two_i) if stored_for_x_at_w else (n, two_i, hidden)
    want_down = (n, inner, hidden) if stored_for_x_at_w else (n, hidden, inner)
    for name, t, want in ((parts["gate_up_proj"], gate_up, want_gu), (parts["down_proj"], down, want_down)):
        if tuple(int(d) for d in t.shape) != want or two_i % 2:
            raise ModelError(f"{location}: {name} has shape {tuple(t.shape)}, expected {list(want)} "
                             f"from hidden_size {hidden}.",
                             "The checkpoint does not match its config.json; download it again.")

    def rows(name: str, parity: int) -> Callable[[Any], Iterator[Piece]]:
        def read(src: Any) -> Iterator[Piece]:
            t = src.get(name)
            for e in range(n):
                w = t[e].t() if stored_for_x_at_w else t[e]  # [2I, H]
                # MXFP4 rows are whole blocks: a row gather keeps them as they are.
                yield w[parity::2] if isinstance(w, torch.Tensor) else w[torch.arange(parity, two_i, 2)]
        return read

    def down_rows(src: Any) -> Iterator[Piece]:
        t = src.get(parts["down_proj"])
        for e in range(n):
            yield t[e].t() if stored_for_x_at_w else t[e]

    def bias(name: str, parity: int | None) -> Callable[[Any], Iterator[Piece]]:
        def read(src: Any) -> Iterator[Piece]:
            t = src.get(name)
            yield t if parity is None else t[:, parity::2]
        return read

    fmt = _format(gate_up)
    blk = f"blk.{layer}"
    gu_name, down_name = parts["gate_up_proj"], parts["down_proj"]
    gu_bias, down_bias = parts["gate_up_proj_bias"], parts["down_proj_bias"]
    return [
        OutTensor(f"{blk}.ffn_gate_exps.weight", (n, inner, hidden), "experts", (gu_name,), fmt,
                  rows(gu_name, 0), layer),
        OutTensor(f"{blk}.ffn_up_exps.weight", (n, inner, hidden), "experts", (gu_name,), fmt,
                  rows(gu_name, 1), layer),
        OutTensor(f"{blk}.ffn_down_exps.weight", (n, hidden, inner), "experts", (down_name,), _format(down),
                  down_rows, layer),
        OutTensor(f"{blk}.ffn_gate_exps.bias", (n, inner), "vector", (gu_bias,), "float", bias(gu_bias, 0), layer),
        OutTensor(f"{blk}.ffn_up_exps.bias", (n, inner), "vector", (gu_bias,), "float", bias(gu_bias, 1), layer),
        OutTensor(f"{blk}.ffn_down_exps.bias", (n, hidden), "vector", (down_bias,), "float",
                  bias(down_bias, None), layer),
    ]


def _natural(name: str) -> tuple:
    """Sort key putting layer 10 after layer 9."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
