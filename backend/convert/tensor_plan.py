"""Which GGUF tensors a Hugging Face checkpoint becomes, and how each is read.

Names come from gguf-py's ``TensorNameMap`` (the table llama.cpp itself maintains); on top of
it, the layouts llama.cpp wants differently from the checkpoint:

* routed experts, stored one tensor per expert, become one ``[E, out, in]`` tensor per
  projection and layer (``blk.N.ffn_{gate,up,down}_exps``), read one expert at a time;
* ``llama`` arch (Mixtral): Q and K rows are permuted so that ggml's interleaved ("normal")
  RoPE computes what transformers' rotate-half RoPE does;
* ``deepseek2`` (DeepSeek-V2/V3, Kimi K2.x): MLA's ``kv_b_proj`` is split into ``attn_k_b``
  (transposed, per head ``[kv_lora, nope]``) and ``attn_v_b`` (``[v, kv_lora]``), the layout
  current llama.cpp requires for its absorbed-MLA attention with the compressed cache;
* DeepSeek's router bias ``e_score_correction_bias`` is ``blk.N.exp_probs_b.bias``.

Each ``OutTensor`` reads its data as a sequence of pieces (consecutive slices along its
first dimension: one expert, or a block of rows) so that memory stays bounded by one piece
whatever the tensor's size. Tensors llama.cpp does not use (MTP layers, vision towers,
rotary caches) are left out.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import torch

from backend.engine.quant import QuantTensor
from backend.errors import ModelError, UnsupportedModelError

Piece = torch.Tensor | QuantTensor
# Pieces of about this many weights: a few tens of MB of float32 while encoding.
PIECE_WEIGHTS = 8 * 1024 * 1024

_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
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


def plan_tensors(source: Any, arch: str, config: dict[str, Any], n_layers: int, *,
                 location: str) -> list[OutTensor]:
    """The GGUF tensors of the text model in `source` (a WeightSource with plain HF names).

    `config` is the text config, `n_layers` the decoder layers kept (MTP layers beyond are
    dropped, as llama.cpp's converter does).
    """
    arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_enum, n_layers)
    tie = bool(config.get("tie_word_embeddings", False))
    n_head = int(config["num_attention_heads"])
    n_kv_head = int(config.get("num_key_value_heads") or n_head)

    out: list[OutTensor] = []
    experts: dict[tuple[int, str], dict[int, str]] = {}
    unknown: list[str] = []
    for hf in sorted(source.keys(), key=_natural):
        if not hf.startswith(("model.", "lm_head.")) or _SKIPPED.match(hf):
            continue  # vision towers, projectors, rotary caches: not part of the text model
        m = _LAYER.match(hf)
        layer = int(m.group(1)) if m else None
        if layer is not None and layer >= n_layers:
            continue  # MTP / NextN layers
        if hf == "lm_head.weight" and tie:
            continue
        e = _EXPERT.fullmatch(hf)
        if e:
            experts.setdefault((int(e.group(1)), _PROJ[e.group(3)]), {})[int(e.group(2))] = hf
            continue
        t = source.get(hf)
        shape, fmt = tuple(int(d) for d in t.shape), _format(t)

        if arch == "deepseek2" and hf.endswith("self_attn.kv_b_proj.weight"):
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
        read = _row_pieces(hf)
        if arch == "llama" and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
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


def _natural(name: str) -> tuple:
    """Sort key putting layer 10 after layer 9."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))
