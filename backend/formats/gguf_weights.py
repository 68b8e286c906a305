"""A GGUF file (or a split set) as a weight source under Hugging Face tensor names.

The engine's model code asks for ``model.layers.3.self_attn.q_proj.weight`` whether the
weights come from safetensors or from a GGUF; this module translates llama.cpp's names
(``blk.3.attn_q.weight``) and layouts back. Files are opened with the project's GGUF reader
(``hybridmoe.backend.models.gguf_reader``), which maps them read-only: ``get`` returns views of the
file, quantized ones as ``QuantTensor``, float ones (F32/F16/BF16) as plain torch tensors,
and nothing is copied except where llama.cpp changed a layout that the HF-convention code
needs undone:

* ``llama`` arch (Mixtral): llama.cpp's converter permutes the rows of Q and K so that
  ggml's interleaved ("normal") RoPE gives HF's rotate-half result; ``q_proj``/``k_proj``
  are returned with that permutation undone (a gather of those rows: attention weights, small).
* ``deepseek2`` conversions newer than spring 2025 store MLA's ``kv_b_proj`` split into
  ``attn_k_b`` (transposed) and ``attn_v_b``; ``kv_b_proj.weight`` is rebuilt from them
  (dequantized, float32) when the file has no ``attn_kv_b``, and ``kv_b_split`` gives the two
  as stored (the CPU decode reads them so: ``engine/latent_maps``).

Routed experts: llama.cpp merges them into one ``[E, out, in]`` tensor per projection
(``ffn_gate_exps`` ...); each expert is exposed as a view
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`` (and ``.bias`` for GPT-OSS), the
same for every family. The router is ``mlp.gate.weight`` (GPT-OSS: ``mlp.router.weight``
and ``.bias``, its HF names); Mixtral's checkpoint names (``block_sparse_moe.gate``,
``experts.E.w1/w2/w3``) are accepted by ``get`` as aliases. Returned tensors share the
read-only mapping: clone or move them before modifying them in place.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch

from hybridmoe.backend.formats.quant import GGUF_SUPPORTED_TYPES, QuantTensor, from_gguf
from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models.families import FAMILIES, family_by_gguf_arch
from hybridmoe.backend.models.gguf_reader import GGUFFile, GGUFTensorInfo, open_gguf_set
from hybridmoe.backend.models.model_files import resolve_model_files

__all__ = ["SUPPORTED_ARCHITECTURES", "GGUFWeights", "open_gguf"]

# The GGUF architectures of the registry's families (llama: Mixtral's, and dense Llama's).
SUPPORTED_ARCHITECTURES = tuple(f.GGUF_ARCH for f in FAMILIES)

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
}

# blk.N.<gguf suffix> -> model.layers.N.<hf suffix>. Names per llama.cpp (gguf-py
# constants.TENSOR_NAMES) and the HF checkpoints of the families listed above; the test
# suite cross-checks every entry against gguf-py's own HF->GGUF TensorNameMap.
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # gpt-oss, glm4moe
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_sinks": "self_attn.sinks",
    # MLA (deepseek2: DeepSeek-V2/V3/R1, Kimi K2)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    # router
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",  # HF ...e_score_correction_bias
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
    # dense MLP (leading dense layers of DeepSeek / GLM; plain llama)
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # shared experts
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    # NextN / multi-token-prediction layers (GLM-4.5): HF keeps them as extra decoder layers
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
}

_EXPERT_PROJ = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Old Mixtral GGUFs (before llama.cpp merged experts, early 2024): blk.N.ffn_gate.E.weight
_OLD_EXPERT = re.compile(r"ffn_(gate|up|down)\.(\d+)\.weight")
_BLK = re.compile(r"blk\.(\d+)\.(.+)")

# Mixtral checkpoint names -> the names used here (llama arch only).
@dataclass(frozen=True)
class _Entry:
    """How one HF-named tensor is made from the file."""

    gguf: str  # GGUF tensor name (for kv_b rebuilt from k_b/v_b: the k_b name)
    expert: int | None = None  # index into a merged [E, ...] tensor
    op: str = "view"  # "view", "unpermute_q", "unpermute_k", "kv_b", "row_vector"
    layer: int | None = None
    extra: str | None = None  # second GGUF tensor (v_b for op "kv_b")


class GGUFWeights:
    """Tensors of one GGUF model (one file or a split set) under HF names. See the module doc."""

    checkpoint = "gguf"

    def __init__(self, files: list[Path], readers: list[GGUFFile]):
        self.files = tuple(files)
        self._readers = readers
        self._tensors: dict[str, tuple[GGUFTensorInfo, GGUFFile]] = {}
        for reader in readers:
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise ModelError(f"GGUF tensor '{t.name}' appears twice ({self._tensors[t.name][1].path} and "
                                     f"{reader.path}).")
                self._tensors[t.name] = (t, reader)
        self._metadata: dict[str, Any] | None = None
        self.architecture = self._scalar("general.architecture")
        if not isinstance(self.architecture, str):
            raise ModelError(f"{files[0]} has no general.architecture key.", "The file is not a llama.cpp model GGUF.")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{files[0]}: GGUF architecture '{self.architecture}' is not supported by the embedded engine.",
                "Supported: " + ", ".join(SUPPORTED_ARCHITECTURES) + ". The llama.cpp backend may run it.",
            )
        self._family = family_by_gguf_arch(self.architecture, str(files[0]))
        self._map: dict[str, _Entry] = {}
        self.unmapped: tuple[str, ...] = ()  # GGUF tensors with no HF name (rope_freqs, ...)
        self._build_map()
        self._check_types()

    # ---- metadata ----------------------------------------------------------------------

    def _scalar(self, key: str, default: Any = None) -> Any:
        return self._readers[0].get(key, default)

    @property
    def metadata(self) -> dict[str, Any]:
        """GGUF key -> Python value (str, int, float, bool or list) from the first file."""
        if self._metadata is None:
            # Decoded lazily: the tokenizer arrays hold ~10^5 strings.
            self._metadata = self._readers[0].metadata
        return self._metadata

    def _arch_int(self, key: str, layer: int | None) -> int | None:
        v = self._scalar(f"{self.architecture}.{key}")
        if isinstance(v, list):  # per-layer arrays (some archs vary head counts by layer)
            v = v[layer or 0]
        return None if v is None else int(v)

    # ---- name map ----------------------------------------------------------------------

    def _build_map(self) -> None:
        arch_block = {**_BLOCK, **self._family.GGUF_TENSOR_NAMES}
        unmapped: list[str] = []
        for name, (t, _) in self._tensors.items():
            if name in _GLOBAL:
                self._map[_GLOBAL[name]] = _Entry(name)
                continue
            m = _BLK.fullmatch(name)
            if not m:
                unmapped.append(name)
                continue
            layer, rest = int(m.group(1)), m.group(2)
            prefix = f"model.layers.{layer}."
            base, _, kind = rest.rpartition(".")
            if base in _EXPERT_PROJ and kind in ("weight", "bias"):
                n_expert = int(t.ne[-1])  # ggml ne is reversed: the expert dim is last
                proj = _EXPERT_PROJ[base]
                for e in range(n_expert):
                    self._map[f"{prefix}mlp.experts.{e}.{proj}.{kind}"] = _Entry(name, expert=e, layer=layer)
                continue
            old = _OLD_EXPERT.fullmatch(rest)
            if old:
                proj = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}[old.group(1)]
                self._map[f"{prefix}mlp.experts.{int(old.group(2))}.{proj}.weight"] = _Entry(name, layer=layer)
                continue
            if rest in arch_block:
                op = "view"
                if self._family.GGUF_PERMUTES_QK and rest in ("attn_q.weight", "attn_q.bias"):
                    op = "unpermute_q"
                elif self._family.GGUF_PERMUTES_QK and rest in ("attn_k.weight", "attn_k.bias"):
                    op = "unpermute_k"
                elif rest == "ffn_gate_inp_shexp.weight":
                    op = "row_vector"  # HF shape [1, hidden]; llama.cpp may store [hidden]
                self._map[prefix + arch_block[rest]] = _Entry(name, op=op, layer=layer)
                continue
            if rest in ("attn_k_b.weight", "attn_v_b.weight"):
                continue  # handled below, as kv_b_proj
            unmapped.append(name)

        # MLA: rebuild kv_b_proj from the split k_b / v_b where the file has no attn_kv_b.
        for name in self._tensors:
            m = _BLK.fullmatch(name)
            if m and m.group(2) == "attn_k_b.weight":
                layer = int(m.group(1))
                hf = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
                v_b = f"blk.{layer}.attn_v_b.weight"
                if hf not in self._map and v_b in self._tensors:
                    self._map[hf] = _Entry(name, op="kv_b", layer=layer, extra=v_b)
        self.unmapped = tuple(unmapped)

    def _check_types(self) -> None:
        used = {e.gguf for e in self._map.values()} | {e.extra for e in self._map.values() if e.extra}
        bad = [(n, self._tensors[n][0].ggml_type) for n in sorted(used)
               if self._tensors[n][0].ggml_type not in GGUF_SUPPORTED_TYPES]
        if bad:
            by_type: dict[str, list[str]] = {}
            for name, qtype in bad:
                by_type.setdefault(qtype.name, []).append(name)
            # Each type with how many tensors and the first of them: a mix may hold several.
            listed = "; ".join(f"{qtype}: {len(names)} tensor{'s' if len(names) > 1 else ''}, e.g. '{names[0]}'"
                               for qtype, names in sorted(by_type.items()))
            raise UnsupportedModelError(
                f"{self.files[0]}: {len(bad)} tensor(s) use GGUF type(s) the embedded engine cannot read ({listed}).",
                "Run this model on llama.cpp (--backend llamacpp; --backend auto does so by itself), or use a GGUF "
                "of it quantized to types the engine reads: "
                + ", ".join(sorted(t.name for t in GGUF_SUPPORTED_TYPES)) + ".",
            )

    def _canonical(self, name: str) -> str:
        if name in self._map:
            return name
        for pattern, repl in self._family.HF_NAME_ALIASES:  # the family's own checkpoint names
            alias = pattern.fullmatch(name)
            if alias:
                return alias.expand(repl)
        return name

    # ---- mapping-like access -----------------------------------------------------------

    def keys(self) -> list[str]:
        return list(self._map)

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._canonical(name) in self._map

    def _entry(self, name: str) -> _Entry:
        try:
            return self._map[self._canonical(name)]
        except KeyError:
            raise KeyError(f"{name!r} is not in {self.files[0].name} ({self.architecture})") from None

    def gguf_name(self, name: str) -> str:
        """The GGUF tensor a HF name is read from (for reports and error messages)."""
        return self._entry(name).gguf

    def tensor_format(self, name: str) -> str:
        """Storage format of the tensor behind `name`: ``q4_k``, ``q8_0``, ``f32``, ``bf16``, ..."""
        return self._tensors[self._entry(name).gguf][0].type_name

    def get_gguf(self, gguf_name: str) -> QuantTensor | torch.Tensor:
        """A tensor by its GGUF name, as stored (merged experts stay [E, out, in])."""
        t, reader = self._tensors[gguf_name]
        return from_gguf(reader.tensor_bytes(t), t.ggml_type, t.shape, name=gguf_name)

    def get(self, name: str) -> QuantTensor | torch.Tensor:
        """The tensor HF calls `name`: a QuantTensor for block types, else a torch tensor.

        Views of the read-only file mapping except where a layout is undone (see module doc).
        """
        e = self._entry(name)
        raw = self.get_gguf(e.gguf)
        if e.expert is not None:
            return raw[e.expert]
        if e.op == "view":
            return raw
        if e.op in ("unpermute_q", "unpermute_k"):
            return self._unpermute(raw, e)
        if e.op == "row_vector":
            return raw.reshape(1, -1) if isinstance(raw, torch.Tensor) and raw.dim() == 1 else raw
        if e.op == "kv_b":  # rebuilt from the split parts
            return join_kv_b(*self.kv_b_split(name), self._arch_int("attention.head_count", e.layer))
        raise AssertionError(e.op)

    def _unpermute(self, raw: QuantTensor | torch.Tensor, e: _Entry) -> QuantTensor | torch.Tensor:
        """Undo convert_hf_to_gguf.py's LlamaModel.permute on Q/K rows.

        The converter does ``w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)``: GGUF
        row ``h*hd + 2i + j`` is HF row ``h*hd + j*hd/2 + i``. Rows are whole quantized rows,
        so the inverse is a row gather; K uses the KV head count.
        """
        n_head = self._arch_int("attention.head_count", e.layer)
        if e.op == "unpermute_k":
            n_head = self._arch_int("attention.head_count_kv", e.layer) or n_head
        rows = raw.shape[0]
        if not n_head or rows % (2 * n_head):
            raise ModelError(
                f"{self.files[0]}: cannot undo the Q/K permutation of '{e.gguf}' "
                f"({rows} rows, {n_head} heads).", "The GGUF metadata does not match its tensors."
            )
        perm = torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)
        return raw[perm]

    def kv_b_split(self, name: str) -> tuple[Any, Any] | None:
        """MLA's kv_b_proj (`name`) as the file stores it where it is split: attn_k_b as rows
        [n_head * kv_lora, nope] (each head's W_UK transposed) and attn_v_b as rows
        [n_head * v, kv_lora] (W_UV), views of the mapping, quantized or not; None where the
        file stores kv_b whole."""
        e = self._entry(name)
        if e.op != "kv_b":
            return None
        k, v = _as_rows(self.get_gguf(e.gguf)), _as_rows(self.get_gguf(e.extra))
        n_head = self._arch_int("attention.head_count", e.layer)
        if not n_head or k.shape[0] % n_head or v.shape[0] % n_head or k.shape[0] // n_head != v.shape[1]:
            raise ModelError(f"{self.files[0]}: attn_k_b {tuple(k.shape)} and attn_v_b {tuple(v.shape)} of layer "
                             f"{e.layer} do not fit together ({n_head} heads).")
        return k, v

    # ---- lifetime ----------------------------------------------------------------------

    def close(self) -> None:
        """Release the mappings (tensors handed out keep theirs, which outlive this object)."""
        for reader in self._readers:
            reader.close()
        self._readers = []
        self._tensors = {}
        self._map = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFWeights({self.files[0].name!r}, arch={self.architecture!r}, {len(self._map)} tensors)"


def _as_rows(t: Any) -> Any:
    """A stored [..., K] tensor (quantized or not) as the 2-D rows [N, K] of the same bytes."""
    if t.dim() == 2:
        return t
    if isinstance(t, torch.Tensor):
        return t.reshape(-1, t.shape[-1])
    data = t.parts["data"]
    return from_gguf(data.reshape(-1, data.shape[-1]), t.meta["ggml_type"], (data.numel() // data.shape[-1], t.shape[-1]))


def join_kv_b(k_b: Any, v_b: Any, n_head: int) -> torch.Tensor:
    """kv_b_proj [n_head * (nope + v), kv_lora] from GGUF's split rows (``kv_b_split``): each
    head's nope rows (k_b transposed back) then its v rows, dequantized. Float32 unless both
    parts share a float dtype."""
    floats = [t for t in (k_b, v_b) if isinstance(t, torch.Tensor)]
    dtype = floats[0].dtype if len(floats) == 2 and floats[0].dtype == floats[1].dtype else torch.float32
    k = (k_b.dequantize(dtype) if isinstance(k_b, QuantTensor) else k_b.to(dtype)).reshape(n_head, -1, k_b.shape[-1])
    v = (v_b.dequantize(dtype) if isinstance(v_b, QuantTensor) else v_b.to(dtype)).reshape(n_head, -1, v_b.shape[-1])
    return torch.cat((k.transpose(1, 2), v), dim=1).reshape(-1, v.shape[-1])


# --------------------------------------------------------------------------------------
# Opening files
# --------------------------------------------------------------------------------------


def open_gguf(path: str | Path) -> GGUFWeights:
    """Open a GGUF model for reading weights: a GGUF file (any part of a split set) or a folder
    holding one GGUF model, as ``resolve_model_files`` decides (projector files are not models).
    Raises ``ModelError`` (missing, not GGUF, truncated, corrupt, incomplete split, a folder with
    no model or two) or ``UnsupportedModelError`` (architecture or tensor types).
    """
    found = resolve_model_files(path)
    if found.kind != "gguf":
        raise ModelError(f"{path} holds no GGUF model.", "Point at the .gguf file to use.")
    # Every part is parsed and checked: header, tensor directory, each tensor within the file
    # (a partial download fails here, not at the first read of a missing page), the set's
    # split.* keys and tensor count. Big-endian files are refused (UnsupportedModelError):
    # torch cannot view byte-swapped data.
    readers = open_gguf_set(found.path)
    files = [r.path for r in readers]
    return GGUFWeights(files, readers)
