"""Tensor classes (docs/sizing.md §1) and the builders of ``TensorInventory``.

Names are classified by the module path they belong to, so quantization companions
(compressed-tensors ``weight_packed``/``weight_scale``/``weight_shape``, fp8
``weight_scale_inv``, GPT-OSS ``_blocks``/``_scales``) land in the class of their weight.
Layers at or beyond ``num_layers`` are MTP/NextN layers and count as other.

Three builders: from the tensor list of the files (safetensors headers or GGUF tensor
infos), and from the config alone for a chosen storage format (planning before download,
or for a conversion not yet made).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.families import family_by_name
from hybridmoe.backend.models.families.common import TensorShape
from hybridmoe.backend.models.formats import (
    CPU_KERNEL_DTYPES,
    GGUF_GPU_KERNEL_TYPES,
    TORCH_DTYPES,
    file_type_name,
    get_format,
    gguf_row_fallback,
    mix_tensor_format,
    tensor_bytes,
)
from hybridmoe.backend.models.inventory import ALWAYS_READ, GpuForm, TensorClass, TensorInventory, TypeUse
from hybridmoe.backend.models.safetensors_files import TensorRecord
from hybridmoe.backend.models.spec import ModelSpec

C = TensorClass


@dataclass(frozen=True)
class Classified:
    cls: TensorClass
    layer: int | None  # decoder layer (block) index, None for model-level tensors
    known: bool = True  # False: no rule matched, counted as other


_VISION = re.compile(
    r"^(?:model\.)?(?:vision_tower|vision_model|visual|multi_modal_projector|mm_projector|"
    r"vision_encoder|audio_tower|audio_model)(?:\.|$)"
)
_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_HF_RULES: tuple[tuple[re.Pattern[str], TensorClass], ...] = tuple(
    (re.compile(p), c)
    for p, c in (
        (r"^(?:self_attn|attention|attn)\.", C.ATTENTION),
        (r"^[^.]*norm[^.]*\.", C.ATTENTION),  # input_layernorm, post_attention_layernorm, ...
        # experts.E.*, fused experts.gate_up_proj[_blocks|_scales|_bias], experts.down_proj*
        (r"^(?:mlp|block_sparse_moe|feed_forward|moe)\.experts\.", C.ROUTED_EXPERTS),
        (r"^mlp\.shared_experts?\.", C.SHARED_EXPERTS),
        (r"^mlp\.shared_expert_gate\.", C.SHARED_EXPERTS),
        (r"^(?:mlp|block_sparse_moe|feed_forward|moe)\.(?:gate|router)\.[^.]+$", C.ROUTER),
        (r"^mlp\.(?:gate_proj|up_proj|down_proj|gate_up_proj|fc1|fc2|w1|w2|w3)\.", C.DENSE_FFN),
    )
)

_HF_EMBEDDING = re.compile(r"(?:^|\.)(?:embed_tokens|wte|tok_embeddings)\.")
_HF_LM_HEAD = re.compile(r"(?:^|\.)lm_head\.")
_HF_FINAL_NORM = re.compile(r"(?:^|\.)(?:norm|final_layernorm|ln_f)\.")


def classify_hf(name: str, num_layers: int) -> Classified:
    """Class of a safetensors tensor name (``model.layers.3.mlp.experts.7.up_proj.weight``)."""
    if _VISION.match(name):
        return Classified(C.OTHER, None)
    m = _HF_LAYER.search(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= num_layers:
            return Classified(C.OTHER, layer)  # MTP / NextN layers
        for pattern, cls in _HF_RULES:
            if pattern.search(rest):
                return Classified(cls, layer)
        return Classified(C.OTHER, layer, known=False)
    if _HF_EMBEDDING.search(name):
        return Classified(C.EMBEDDING, None)
    if _HF_LM_HEAD.search(name):
        return Classified(C.LM_HEAD, None)
    if _HF_FINAL_NORM.search(name):
        return Classified(C.ATTENTION, None)
    return Classified(C.OTHER, None, known=False)


_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_GGUF_RULES: tuple[tuple[re.Pattern[str], TensorClass], ...] = tuple(
    (re.compile(p), c)
    for p, c in (
        (r"^nextn\.", C.OTHER),
        (r"^[^.]*norm[^.]*\.", C.ATTENTION),  # attn_norm, ffn_norm, post_attention_norm, ...
        (r"^attn_", C.ATTENTION),  # q/k/v/output, MLA q_a/q_b/kv_a_mqa/kv_b/k_b/v_b, sinks
        (r"^ffn_(?:gate|up|down|gate_up)_exps\.", C.ROUTED_EXPERTS),
        (r"^ffn_(?:gate|up|down)\.\d+\.", C.ROUTED_EXPERTS),  # pre-2024 Mixtral GGUFs: one per expert
        (r"^ffn_gate_inp_shexp\.", C.SHARED_EXPERTS),
        (r"^ffn_(?:gate|up|down)_shexp\.", C.SHARED_EXPERTS),
        (r"^(?:ffn_gate_inp|exp_probs_b)\.", C.ROUTER),
        (r"^ffn_(?:gate|up|down)\.", C.DENSE_FFN),
    )
)


def classify_gguf(name: str, num_layers: int) -> Classified:
    """Class of a GGUF tensor name (``blk.3.ffn_up_exps.weight``, llama.cpp naming)."""
    m = _GGUF_LAYER.match(name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= num_layers:
            return Classified(C.OTHER, layer)  # NextN layers (GLM-4.5 keeps them in the GGUF)
        for pattern, cls in _GGUF_RULES:
            if pattern.search(rest):
                return Classified(cls, layer)
        return Classified(C.OTHER, layer, known=False)
    if name.startswith("token_embd_norm."):
        return Classified(C.ATTENTION, None)
    if name.startswith("token_embd."):
        return Classified(C.EMBEDDING, None)
    if name.startswith("output."):
        return Classified(C.LM_HEAD, None)
    if name.startswith(("output_norm.", "rope_freqs.")):
        return Classified(C.ATTENTION, None)
    return Classified(C.OTHER, None, known=False)


# --- from files ---------------------------------------------------------------------------


_SCALES = re.compile(r"(?:\.weight_scale(?:_inv)?|\.weight_shape|_scales)$")  # a quantized weight's companions
# MLA's kv_b whole, as a checkpoint (kv_b_proj, with an fp8 checkpoint's scales) or an older GGUF
# (attn_kv_b) names it. (Split into attn_k_b and attn_v_b, as newer GGUFs store it, the CPU
# reads each as stored where the kernels read its format: engine/latent_maps.py.)
_KV_B_WHOLE = re.compile(r"(?:\.self_attn\.kv_b_proj\.|\.attn_kv_b\.)")


def _copy_extra(fmt: str, shape: tuple[int, ...], nbytes: int) -> int:
    """Bytes the engine's CPU copy of a matrix takes beyond the stored ones: a Q4_K matrix
    whose rows come in eights goes into the row-interleaved layout with unpacked scales
    (native/src/formats.h, q4_kx8: 148 bytes a row and super-block where the file has 144)."""
    if fmt != "q4_k" or len(shape) < 2 or shape[-2] % 8:
        return 0
    return nbytes * 4 // 144


_FP8_SCALES = re.compile(r"\.weight_scale_inv$")  # an fp8 weight's block scales
_INT4_PARTS = re.compile(r"\.weight_(?:packed|scale|shape|zero_point)$")  # compressed-tensors int4, read in place


def _widened(c: Classified, name: str, fmt: str, shape: tuple[int, ...], gguf: bool) -> bool:
    """Whether the engine holds this always-read tensor in its compute dtype on the CPU
    whatever the file stores: the embedding table (lookups; a GGUF's in a type the kernels read
    stays as stored, its rows dequantized as they are looked up: model._table_as_stored), MLA's
    kv_b stored whole (its decode step reads it so), vectors (norms, biases), and matrices in a
    format the kernels do not read (with their scales)."""
    if c.cls is C.EMBEDDING:
        return not (gguf and fmt.lower() in CPU_KERNEL_DTYPES)
    if c.cls is C.ATTENTION and _KV_B_WHOLE.search(name):
        return True
    if c.cls not in (C.ATTENTION, C.DENSE_FFN, C.SHARED_EXPERTS, C.LM_HEAD) or _INT4_PARTS.search(name):
        return False
    return len(shape) < 2 or _FP8_SCALES.search(name) is not None or fmt.lower() not in CPU_KERNEL_DTYPES


def _widened_on_gpu(c: Classified, name: str, fmt: str, shape: tuple[int, ...]) -> bool:
    """Whether the engine holds this always-read tensor in its compute dtype on a GPU: all but
    the matrices stored in a GGUF block type its GPU kernels read (engine/stored_linear.py:
    projections, the head, and the embedding table, whose lookups dequantize the rows they read;
    engine/stored_latent.py: MLA's kv_b, whole or split into k_b and v_b, whose per-head
    products read its blocks in decode steps); vectors and float matrices are."""
    if c.cls not in (C.ATTENTION, C.DENSE_FFN, C.SHARED_EXPERTS, C.LM_HEAD, C.EMBEDDING):
        return False
    return len(shape) < 2 or fmt.lower() not in GGUF_GPU_KERNEL_TYPES


# The routers' score-correction biases (DeepSeek-V3, GLM): the engine routes with them in float32
# whatever the file stores (a bf16 checkpoint keeps them in bf16).
_SCORE_BIAS = re.compile(r"(?:\.e_score_correction_bias|\.exp_probs_b)(?:\.|$)")


@dataclass
class _Held:
    """Where the engine holds a model otherwise than its file stores it (TensorInventory's
    ``widened``, ``copy_extra``, ``copy_extra_by_layer``; on a GPU ``gpu_widened`` and, type by
    type, ``gpu_forms``), tensor by tensor."""

    gguf: bool  # the tensors are a GGUF's
    widened: dict[TensorClass, tuple[int, int]] = field(default_factory=dict)
    extra: dict[TensorClass, int] = field(default_factory=dict)
    extra_by_layer: dict[int, int] = field(default_factory=dict)
    gpu_widened: dict[TensorClass, tuple[int, int]] = field(default_factory=dict)
    gpu_forms: dict[TensorClass, dict[tuple[str, bool], GpuForm]] = field(default_factory=dict)
    float32_router: tuple[int, int] = (0, 0)
    router_vectors: tuple[int, int] = (0, 0)

    def add(self, c: Classified, name: str, fmt: str, shape: tuple[int, ...], elements: int, nbytes: int,
            tensors: int = 1) -> None:
        if c.cls is C.ROUTER and _SCORE_BIAS.search(name):
            self.float32_router = (self.float32_router[0] + nbytes, self.float32_router[1] + elements)
        elif c.cls is C.ROUTER and len(shape) < 2:
            self.router_vectors = (self.router_vectors[0] + nbytes, self.router_vectors[1] + elements)
        if c.cls in ALWAYS_READ and c.cls is not C.ROUTER:
            on_gpu = _widened_on_gpu(c, name, fmt, shape)
            if on_gpu:
                stored, count = self.gpu_widened.get(c.cls, (0, 0))
                self.gpu_widened[c.cls] = (stored + nbytes, count + elements)
            forms = self.gpu_forms.setdefault(c.cls, {})
            key = (fmt.lower(), on_gpu)
            forms[key] = forms[key].plus(tensors, nbytes, elements) if key in forms else GpuForm(
                fmt.lower(), on_gpu, tensors, nbytes, elements, name)
        if _widened(c, name, fmt, shape, self.gguf):
            stored, count = self.widened.get(c.cls, (0, 0))
            self.widened[c.cls] = (stored + nbytes, count + elements)
        elif c.cls is not C.OTHER and (extra := _copy_extra(fmt, shape, nbytes)):
            self.extra[c.cls] = self.extra.get(c.cls, 0) + extra
            if c.cls is C.ROUTED_EXPERTS:
                self.extra_by_layer[c.layer] = self.extra_by_layer.get(c.layer, 0) + extra

    def fields(self) -> dict:
        return {"widened": self.widened, "copy_extra": self.extra,
                "copy_extra_by_layer": dict(sorted(self.extra_by_layer.items())),
                "gpu_widened": self.gpu_widened, "router_float32_vectors": self.float32_router,
                "router_vectors": self.router_vectors,
                "gpu_forms": {cls: tuple(forms.values()) for cls, forms in self.gpu_forms.items()}}


@dataclass
class _Types:
    """The storage types of each class, and the routed experts' formats as the CPU reads them
    (TensorInventory's ``types_by_class``, ``routed_formats``, ``routed_format_bytes_by_layer``)."""

    by_class: dict[TensorClass, dict[str, TypeUse]] = field(default_factory=dict)
    routed: dict[str, TypeUse] = field(default_factory=dict)
    routed_by_layer: dict[int, dict[str, int]] = field(default_factory=dict)

    def add(self, c: Classified, name: str, stored: str, read_as: str, tensors: int, nbytes: int) -> None:
        """One tensor `name` (or `tensors` alike) stored as `stored`, which the engine reads as `read_as`."""
        _count(self.by_class.setdefault(c.cls, {}), stored, name, tensors, nbytes)
        if c.cls is C.ROUTED_EXPERTS:
            _count(self.routed, read_as, name, tensors, nbytes)
            layer = self.routed_by_layer.setdefault(c.layer, {})
            layer[read_as] = layer.get(read_as, 0) + nbytes

    def fields(self) -> dict:
        return {"types_by_class": self.by_class, "routed_formats": self.routed,
                "routed_format_bytes_by_layer": dict(sorted(self.routed_by_layer.items()))}


def _count(uses: dict[str, TypeUse], key: str, name: str, tensors: int, nbytes: int) -> None:
    uses[key] = uses[key].plus(tensors, nbytes) if key in uses else TypeUse(tensors, nbytes, name)


def inventory_from_records(records: Iterable[TensorRecord], spec: ModelSpec, *, source: str,
                           files: Iterable[str] = (), expert_format: str | None = None) -> TensorInventory:
    """Inventory of real tensors (``source`` "safetensors" or "gguf")."""
    classify = classify_gguf if source == "gguf" else classify_hf
    by_class = {c: 0 for c in TensorClass}
    by_layer: dict[int, int] = {}
    router_params = router_bytes = 0  # the routers' matrices
    held = _Held(source == "gguf")
    types = _Types()
    # A GGUF tensor is read in its own type; a safetensors expert's parts (fp8 weights and
    # their scales, int4 codes and group scales) in the checkpoint's expert format.
    expert_read_as = expert_format or spec.expert_format
    unknown: list[str] = []
    for r in records:
        c = classify(r.name, spec.num_layers)
        by_class[c.cls] += r.nbytes
        types.add(c, r.name, r.dtype, r.dtype if source == "gguf" else expert_read_as, 1, r.nbytes)
        # A weight's elements; its quantization scales, none.
        held.add(c, r.name, r.dtype, r.shape, 0 if _SCALES.search(r.name) else math.prod(r.shape), r.nbytes)
        if c.cls is C.ROUTER and len(r.shape) >= 2:
            router_params += math.prod(r.shape)
            router_bytes += r.nbytes
        if c.cls is C.ROUTED_EXPERTS:
            by_layer[c.layer] = by_layer.get(c.layer, 0) + r.nbytes
        if not c.known:
            unknown.append(r.name)
    files = tuple(str(f) for f in files)
    _check_expert_layers(spec, by_layer, files)
    notes = []
    if unknown:
        notes.append(f"{len(unknown)} tensor(s) not recognised and counted as other, e.g. {unknown[0]}")
    return TensorInventory(
        bytes_by_class=by_class,
        routed_bytes_by_layer=dict(sorted(by_layer.items())),
        n_routed_experts=spec.n_routed_experts,
        source=source,
        expert_format=expert_format or spec.expert_format,
        expert_bits_per_weight=_expert_bits(spec, by_class[C.ROUTED_EXPERTS]),
        files=files,
        notes=tuple(notes),
        router_matrix_params=router_params,
        router_matrix_bytes=router_bytes,
        **held.fields(),
        **types.fields(),
    )


def _check_expert_layers(spec: ModelSpec, by_layer: Mapping[int, int], files: tuple[str, ...]) -> None:
    found, expected = set(by_layer), set(spec.moe_layers)
    if found == expected:
        return
    where = files[0] if len(files) == 1 else f"the {len(files)} files of this model"
    if expected - found:
        layers = sorted(expected - found)
        raise ModelError(
            f"The config puts routed experts in layer {layers[0]}"
            f"{f' (and {len(layers) - 1} more)' if len(layers) > 1 else ''}, but {where} hold none there.",
            "The checkpoint is incomplete or does not match its config; download it again.",
        )
    layers = sorted(found - expected)
    raise ModelError(
        f"{where} hold routed experts in layer {layers[0]}, which the config describes as dense.",
        "The config does not match the weights; download both from the same repository revision.",
    )


def check_complete(spec: ModelSpec, records: Iterable[TensorRecord], where: str) -> None:
    """Raise ``ModelError`` naming the first tensor the family's layout requires of a
    checkpoint of this config that ``records`` (safetensors tensors) lack: the engine would
    refuse the model at load, so inspecting and planning say it first."""
    missing = missing_tensors(spec, (r.name for r in records))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelError(
            f"{where} lacks tensor '{missing[0]}'{more}, which a {spec.family} checkpoint of this config holds.",
            "The download is incomplete or does not match config.json; download it again "
            "(`hybridmoe pull` resumes and checks every file).",
        )


def missing_tensors(spec: ModelSpec, names: Iterable[str]) -> list[str]:
    """The tensors of ``family.expected_tensors(spec)`` absent from ``names``, in order.

    Quantized weights count under the name of their weight (``X.weight_packed`` for
    ``X.weight``, ``X_blocks`` for ``X``), fused experts (``experts.gate_up_proj``) stand for
    the per-expert ones, and what servers and converters commonly drop is not required:
    MTP/NextN layers and vision towers.
    """
    logical = set()
    for name in names:
        logical.add(name)
        if name.endswith(".weight_packed"):
            logical.add(name.removesuffix("_packed"))
        elif name.endswith("_blocks"):
            logical.add(name.removesuffix("_blocks"))
    missing = []
    for t in family_by_name(spec.family).expected_tensors(spec):
        layer = classify_hf(t.name, spec.num_layers).layer
        if t.role == "vision" or (layer is not None and layer >= spec.num_layers):
            continue
        for name in _each_expert(t):
            if name not in logical and not _held_fused(name, logical):
                missing.append(name)
    return missing


_PER_EXPERT = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.")


def _each_expert(t: TensorShape) -> Iterable[str]:
    """The names an entry stands for: one per expert for ``experts.0.*`` with a count."""
    if t.count > 1 and ".experts.0." in t.name:
        return (t.name.replace(".experts.0.", f".experts.{e}.", 1) for e in range(t.count))
    return (t.name,)


def _held_fused(name: str, logical: set[str]) -> bool:
    """A per-expert weight of a layer stored fused (all experts in one gate_up and one down tensor)."""
    m = _PER_EXPERT.match(name)
    return bool(m) and {f"{m['experts']}.gate_up_proj", f"{m['experts']}.down_proj"} <= logical


def _expert_bits(spec: ModelSpec, routed_bytes: int) -> float:
    weights = spec.n_moe_layers * spec.n_routed_experts * spec.params_per_expert
    return 8 * routed_bytes / weights if weights else 0.0


def gguf_storage_formats(records: Iterable[TensorRecord], metadata: Mapping[str, object],
                         num_layers: int) -> tuple[str, str]:
    """(expert_format, other_format) of a GGUF, from its tensor types.

    A single type when all routed-expert matrices share one; otherwise the file's mix
    (``general.file_type``, e.g. ``q4_k_m``) where its types are among theirs, else the type
    holding most of their bytes.
    """
    file_type = metadata.get("general.file_type")
    mix = file_type_name(int(file_type)) if isinstance(file_type, int) else None
    expert_bytes: Counter[str] = Counter()
    other_bytes: Counter[str] = Counter()
    for r in records:
        if len(r.shape) < 2 or r.name.endswith(".bias"):
            continue  # norms and biases (GPT-OSS expert biases are 2-D) stay in float
        cls = classify_gguf(r.name, num_layers).cls
        if cls is C.ROUTED_EXPERTS:
            expert_bytes[r.dtype] += r.nbytes
        elif cls in (C.ATTENTION, C.DENSE_FFN, C.SHARED_EXPERTS):
            other_bytes[r.dtype] += r.nbytes

    def pick(counter: Counter[str]) -> str:
        if len(counter) == 1:
            return next(iter(counter))
        if not counter:
            return mix or "f16"
        if mix and any(t == mix or mix.startswith(t + "_") for t in counter):
            return mix
        # A dynamic mix (unsloth's UD files: IQ2/IQ3 experts) records a file type none of its
        # expert tensors has, or none: the type holding most of their bytes says more.
        return counter.most_common(1)[0][0]

    return pick(expert_bytes), pick(other_bytes)


# --- from the config ----------------------------------------------------------------------


def default_other_format(spec: ModelSpec, expert_format: str) -> str:
    """Format for the non-expert weights when only the expert format was chosen: a GGUF type
    or mix applies to the whole file (as ``llama-quantize`` does); a safetensors layout keeps
    the checkpoint's other weights as they are (16 bit when the model was read from a GGUF)."""
    ef = get_format(expert_format)
    if ef.is_gguf:
        return ef.name
    if get_format(spec.other_format).is_gguf:
        return TORCH_DTYPES.get(spec.torch_dtype, "bf16")
    return spec.other_format


def inventory_from_config(spec: ModelSpec, *, expert_format: str | None = None,
                          other_format: str | None = None) -> TensorInventory:
    """Inventory computed from the config for the given storage formats (default: as the
    checkpoint stores them). Exact for the tensors a checkpoint of this family holds; a vision
    tower is estimated from ``vision_config``."""
    family = family_by_name(spec.family)
    ef = get_format(expert_format or spec.expert_format).name
    of = get_format(other_format or (default_other_format(spec, ef) if expert_format else spec.other_format)).name
    gguf_mode = get_format(of).is_gguf or get_format(ef).is_gguf
    plain = "f32" if gguf_mode else TORCH_DTYPES.get(spec.torch_dtype, "bf16")
    n_blocks = spec.num_layers + (spec.n_mtp_layers if family.GGUF_KEEPS_MTP else 0)
    # The mix recipe's "8-expert model" rule reads the expert count of the model.
    n_expert = spec.n_routed_experts

    by_class = {c: 0 for c in TensorClass}
    by_layer: dict[int, int] = {}
    router_params = router_bytes = 0  # the routers' matrices
    held = _Held(gguf_mode)
    types = _Types()
    tensors = family.expected_tensors(spec)
    for t in (part for t in tensors for part in _as_gguf_stores(t, spec)) if gguf_mode else tensors:
        c = classify_hf(t.name, spec.num_layers)
        if gguf_mode and (t.role == "vision" or (c.layer is not None and c.layer >= spec.num_layers
                                                 and not family.GGUF_KEEPS_MTP)):
            continue  # not in a text GGUF: the converter drops it or writes it to an mmproj file
        structural = classify_hf(t.name, 1 << 30).cls  # an MTP layer's experts are still experts
        fmt = _config_tensor_format(t, structural, c.layer, ef, of, plain, gguf_mode, n_blocks, n_expert)
        nbytes = _bytes(fmt, t.shape, gguf_mode) * t.count
        by_class[c.cls] += nbytes
        if c.cls is C.ROUTER and len(t.shape) >= 2:
            router_params += math.prod(t.shape) * t.count
            router_bytes += nbytes
        held.add(c, t.name, fmt, t.shape, math.prod(t.shape) * t.count, nbytes, t.count)
        types.add(c, t.name, fmt, fmt, t.count, nbytes)
        if c.cls is C.ROUTED_EXPERTS:
            by_layer[c.layer] = by_layer.get(c.layer, 0) + nbytes

    notes = [f"computed from the config: routed experts in {ef}, other weights in {of}"]
    if spec.vision_params and not gguf_mode:
        notes.append("vision tower size estimated from vision_config")
    return TensorInventory(
        bytes_by_class=by_class,
        routed_bytes_by_layer=dict(sorted(by_layer.items())),
        n_routed_experts=spec.n_routed_experts,
        source="config",
        expert_format=ef,
        expert_bits_per_weight=_expert_bits(spec, by_class[C.ROUTED_EXPERTS]),
        notes=tuple(notes),
        router_matrix_params=router_params,
        router_matrix_bytes=router_bytes,
        **held.fields(),
        **types.fields(),
    )


def _as_gguf_stores(t: TensorShape, spec: ModelSpec) -> Iterator[TensorShape]:
    """A checkpoint's tensor as a GGUF stores it: MLA's kv_b_proj split into attn_k_b (each
    head's nope rows transposed: rows of qk_nope_head_dim, which take a K-quant's 32-weight
    fallback) and attn_v_b (rows of kv_lora_rank), as llama.cpp's converter and ours write it;
    the CPU reads both as stored (engine/latent_maps.py). Anything else as it is."""
    if not t.name.endswith(".self_attn.kv_b_proj.weight"):
        yield t
        return
    heads, c, base = spec.num_attention_heads, spec.kv_lora_rank, t.name.removesuffix("kv_b_proj.weight")
    yield TensorShape(f"{base}k_b.weight", (heads * c, spec.qk_nope_head_dim), t.role, t.count)
    yield TensorShape(f"{base}v_b.weight", (heads * spec.v_head_dim, c), t.role, t.count)


def _config_tensor_format(t: TensorShape, cls: TensorClass, layer: int | None, ef: str, of: str,
                          plain: str, gguf_mode: bool, n_blocks: int, n_expert: int) -> str:
    if t.role in ("vector", "router"):
        return plain
    if t.role == "fp32":
        return "f32" if gguf_mode else "fp32"
    if not gguf_mode:
        # Quantized safetensors checkpoints keep embeddings, head, routers, the MTP merge
        # projection and vision towers in 16 bit (every published ignore list says so).
        if t.role in ("token_embd", "output", "mtp", "vision"):
            return plain
        return ef if cls is C.ROUTED_EXPERTS else of
    fmt = ef if cls is C.ROUTED_EXPERTS else of
    row = t.shape[-1]
    if get_format(fmt).kind == "mix":
        return mix_tensor_format(fmt, t.role, layer, n_blocks, n_expert, row)
    if t.role == "output" and fmt not in ("q8_0", "f16", "bf16", "f32"):
        return gguf_row_fallback("q6_k", row)  # llama-quantize's output.weight rule
    if get_format(fmt).kind == "gguf":
        return gguf_row_fallback(fmt, row)
    return fmt


def _bytes(fmt: str, shape: tuple[int, ...], gguf_mode: bool) -> int:
    try:
        return tensor_bytes(fmt, shape)
    except ValueError:
        # A row that is not a whole number of blocks: llama.cpp's fallback type, else 16 bit.
        return tensor_bytes(gguf_row_fallback(fmt, shape[-1]) if gguf_mode else "bf16", shape)
