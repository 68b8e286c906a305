"""What the family modules share, so that a family module holds only what is particular to it.

- Reading a config.json: ``Fields`` (typed reads with clear errors), ``DecoderConfig`` (the
  fields every family reads the same way, and the ``ModelSpec`` built from them), the storage
  format a checkpoint declares in ``quantization_config``, and layer rules several families
  use (Qwen's sparse step and sliding window).
- Tensor shapes of the usual building blocks (GQA attention, SwiGLU MLPs, the router with its
  routed experts, DeepSeek-style MoE MLPs and MTP layers) for config-only inventories.
- GGUF metadata -> config: ``gguf_to_config`` reads the keys every GGUF decoder has and then
  a family's ``GGUFKey`` table.
- Layer descriptions (``models/layer_description``) of the usual blocks, for a family's
  ``describe_layers``: ``rms_norms``, ``rotation``, ``grouped_query``, ``latent``, ``dense``,
  ``mixture``, ``softmax_topk``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models.formats import TORCH_DTYPES, get_format
from hybridmoe.backend.models.hf_config import HFConfig
from hybridmoe.backend.models.layer_description import (
    SILU,
    DenseFeedForward,
    GroupedQueryAttention,
    LatentAttention,
    Loading,
    MixtureOfExperts,
    Norm,
    Rotation,
    Router,
    activation_name,
)
from hybridmoe.backend.models.spec import ModelSpec

_MISSING = object()


class Fields:
    """Typed access to a config.json (or GGUF metadata) that names the field and the file
    when something is missing or of the wrong type."""

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = "", what: str = "field"):
        self.data = data
        self.source = source
        self.prefix = prefix  # GGUF keys are "{arch}.<key>"
        self.what = what

    def _lookup(self, names: tuple[str, ...]) -> tuple[str, Any]:
        for name in names:
            value = self.data.get(self.prefix + name, _MISSING)
            if value is not _MISSING and value is not None:
                return self.prefix + name, value
        return self.prefix + names[0], _MISSING

    def has(self, *names: str) -> bool:
        return self._lookup(names)[1] is not _MISSING

    def int(self, *names: str, default: Any = _MISSING) -> int:
        return self._number(names, default, whole=True)

    def float(self, *names: str, default: Any = _MISSING) -> float:
        return self._number(names, default, whole=False)

    def count(self, *names: str, default: Any = _MISSING) -> int:
        """A whole number of at least 1: a size or a count of heads, layers or experts, which
        the arithmetic downstream divides by."""
        value = self.int(*names, default=default)
        if value is not None and value < 1:
            raise ModelError(
                f"{self.what[0].upper() + self.what[1:]} '{self._lookup(names)[0]}' in {self.source} is {value}; it must be 1 or more.",
                "The file looks damaged or hand-edited; restore the original from the model repository.",
            )
        return value

    def _number(self, names: tuple[str, ...], default: Any, *, whole: bool) -> Any:
        key, value = self._lookup(names)
        if value is _MISSING:
            if default is _MISSING:
                raise self.missing(names)
            return default
        # bool is an int subclass, but a true/false where a size belongs is a damaged file.
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and value != int(value)):
            kind = "a whole number" if whole else "a number"
            raise ModelError(
                f"{self.what[0].upper() + self.what[1:]} '{key}' in {self.source} should be {kind}, not {value!r}.",
                "The file looks damaged or hand-edited; restore the original from the model repository.",
            )
        return int(value) if whole else float(value)

    def get(self, *names: str, default: Any = None) -> Any:
        value = self._lookup(names)[1]
        return default if value is _MISSING else value

    def int_list(self, *names: str, default: Any = ()) -> tuple[int, ...]:
        key, value = self._lookup(names)
        if value is _MISSING:
            return tuple(default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
            raise ModelError(
                f"{self.what[0].upper() + self.what[1:]} '{key}' in {self.source} should be a list of layer indices, "
                f"not {value!r}.",
                "Restore the original file from the model repository.",
            )
        return tuple(value)

    def missing(self, names: Iterable[str]) -> ModelError:
        names = [self.prefix + n for n in names]
        alias = f" (or {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
        return ModelError(
            f"Required {self.what} '{names[0]}'{alias} is missing from {self.source}.",
            "The file is incomplete or belongs to a different model variant; download it again "
            "from the model repository.",
        )


def text_config(config: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The language model's config and whether the checkpoint also holds a vision model.

    Multimodal wrappers (Kimi K2.5/K2.6 ``KimiK25ForConditionalGeneration``) keep the language
    model's config under ``text_config``; everything the planner needs is in there.
    """
    has_vision = bool(config.get("vision_config"))
    inner = config.get("text_config")
    if isinstance(inner, Mapping) and inner:
        text = dict(inner)
        # Fields some wrappers keep only at the top level.
        for key in ("quantization_config", "tie_word_embeddings", "torch_dtype", "dtype"):
            if key not in text and key in config:
                text[key] = config[key]
        return text, has_vision
    return dict(config), has_vision


def architecture_of(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return archs[0]
    return str(config.get("model_type", "unknown"))


def torch_dtype_of(config: Mapping[str, Any]) -> str:
    dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return str(dtype).removeprefix("torch.")


def float_format(config: Mapping[str, Any]) -> str:
    """Storage format of unquantized weights: the checkpoint's torch dtype."""
    return TORCH_DTYPES.get(torch_dtype_of(config), "bf16")


# Representative module names of each tensor class, for matching quantization ignore lists.
_PROBE_MODULES = {
    "experts": ("model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.0.down_proj",
                "model.layers.1.block_sparse_moe.experts.0.w1", "model.layers.1.mlp.experts"),
    "other": ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj",
              "model.layers.1.self_attn.kv_b_proj", "model.layers.1.self_attn.q_b_proj"),
}


def _ignored(module: str, patterns: Iterable[str]) -> bool:
    """compressed-tensors ``ignore`` / transformers ``modules_to_not_convert`` matching:
    ``re:``-prefixed entries are regular expressions matched from the start of the module
    name; other entries match a whole module name, a dotted suffix of it, or an fnmatch-style
    ``*`` glob."""
    for pattern in patterns:
        if not isinstance(pattern, str):
            continue
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif "*" in pattern:
            if re.match(re.escape(pattern).replace(r"\*", r"[^.]+") + r"(\.|$)", module):
                return True
        elif module == pattern or module.endswith("." + pattern) or module.startswith(pattern + "."):
            return True
    return False


def _all_ignored(group: str, patterns: list[str]) -> bool:
    # A class counts as unquantized when its representative modules are all ignored, with or
    # without a multimodal wrapper's "language_model." prefix.
    probes = _PROBE_MODULES[group]
    return all(
        _ignored(p, patterns) or _ignored("language_model." + p, patterns) for p in probes
    )


def storage_formats(config: Mapping[str, Any], source: str) -> tuple[str, str]:
    """(expert_format, other_format) as the checkpoint stores its weights.

    ``other_format`` is the format of the other Linear weights (attention, dense and shared
    MLPs); embeddings, norms and routers stay in the float format whatever it says.
    """
    plain = float_format(config)
    q = config.get("quantization_config")
    if not q:
        return plain, plain
    if not isinstance(q, Mapping):
        raise ModelError(f"'quantization_config' in {source} is not an object.",
                         "Restore the original config.json from the model repository.")
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is None:
            return "fp8", "fp8"
        if list(block) != [128, 128]:
            raise UnsupportedModelError(
                f"{source} declares fp8 weights with weight_block_size {list(block)}; only 128x128 "
                "blocks (DeepSeek-V3 style) are supported.",
                "Use a bf16 or GGUF version of this model.",
            )
        ignore = list(q.get("modules_to_not_convert") or q.get("ignored_layers") or [])
        experts = plain if _all_ignored("experts", ignore) else "fp8_block"
        other = plain if _all_ignored("other", ignore) else "fp8_block"
        return experts, other
    if method == "compressed-tensors":
        return _compressed_tensors_formats(q, plain, source)
    if method == "mxfp4":
        ignore = list(q.get("modules_to_not_convert") or [])
        experts = plain if _all_ignored("experts", ignore) else "mxfp4"
        # transformers' mxfp4 quantizer only converts the fused expert tensors.
        return experts, plain
    raise UnsupportedModelError(
        f"{source} declares quant_method '{method or q!r}', which hybridmoe does not read.",
        "Supported: fp8 (128x128 blocks), compressed-tensors int4 pack-quantized, mxfp4; or use a "
        "bf16 checkpoint or a GGUF file.",
    )


def _compressed_tensors_formats(q: Mapping[str, Any], plain: str, source: str) -> tuple[str, str]:
    fmt = str(q.get("format", ""))
    groups = q.get("config_groups") or {}
    schemes = [g.get("weights") for g in groups.values() if isinstance(g, Mapping) and g.get("weights")]
    if not schemes:
        raise UnsupportedModelError(
            f"{source}: compressed-tensors quantization_config has no weight scheme in config_groups.",
            "Use a bf16 checkpoint or a GGUF file of this model.",
        )
    w = schemes[0]
    bits, group, kind = w.get("num_bits"), w.get("group_size"), w.get("type", "int")
    if fmt != "pack-quantized" or bits != 4 or kind != "int" or not group or w.get("strategy") != "group":
        raise UnsupportedModelError(
            f"{source}: compressed-tensors scheme format={fmt!r}, {bits}-bit {kind}, "
            f"strategy={w.get('strategy')!r}, group_size={group!r} is not supported; hybridmoe reads "
            "int4 pack-quantized with group scales (Kimi K2.x).",
            "Use a bf16 checkpoint or a GGUF file of this model.",
        )
    if not w.get("symmetric", True):
        raise UnsupportedModelError(
            f"{source}: asymmetric int4 (with zero points) is not supported.",
            "Use a bf16 checkpoint or a GGUF file of this model.",
        )
    quant = get_format(f"int4_g{int(group)}").name
    ignore = list(q.get("ignore") or [])
    experts = plain if _all_ignored("experts", ignore) else quant
    other = plain if _all_ignored("other", ignore) else quant
    return experts, other


# --- the fields every family reads the same way --------------------------------------------


def check_routing(n_experts: int, top_k: int, source: str) -> None:
    if n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ModelError(
            f"{source} selects {top_k} of {n_experts} routed experts per token, which is impossible.",
            "Restore the original config from the model repository.",
        )


@dataclass(frozen=True)
class DecoderConfig:
    """A config.json read as far as every family reads it alike.

    A family module calls ``read()``, reads what is particular to it (which layers have
    experts, shared experts, sliding windows) from ``fields``, and hands that to ``spec()``
    under ModelSpec's field names.
    """

    config: Mapping[str, Any]  # as given: a multimodal wrapper's architecture names the model
    text: dict[str, Any]  # the language model's config (a wrapper's text_config)
    has_vision: bool
    fields: Fields  # typed reads of ``text``
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    n_routed_experts: int
    experts_per_token: int

    @classmethod
    def read(cls, config: Mapping[str, Any], source: str, *, expert_count: tuple[str, ...],
             experts_per_token: tuple[str, ...] = ("num_experts_per_tok",)) -> DecoderConfig:
        """``expert_count``/``experts_per_token``: the names the family's configs give those
        two numbers, the published configs' name first (it is the one an error names).
        transformers 5 renames some: it writes Qwen3-MoE's num_experts as num_local_experts."""
        text, has_vision = text_config(config)
        f = Fields(text, source)
        n_layers = f.count("num_hidden_layers")
        hidden = f.count("hidden_size")
        heads = f.count("num_attention_heads")
        n_experts = f.count(*expert_count)
        top_k = f.count(*experts_per_token)
        check_routing(n_experts, top_k, source)
        return cls(config, text, has_vision, f, n_layers, hidden, heads, n_experts, top_k)

    def spec(self, name: str, family: str, *, moe_layers: tuple[int, ...], attention: str = "gqa",
             head_dim: int | None = None, **particular: Any) -> ModelSpec:
        """The ModelSpec: what ``read()`` and this method read, plus the family's
        ``particular`` ModelSpec fields. The layers without routed experts are the dense
        ones. ``head_dim`` is the config's, else hidden_size / num_attention_heads; MLA
        families give their own."""
        f, heads = self.fields, self.num_attention_heads
        expert_format, other_format = storage_formats(self.text, f.source)
        if head_dim is None:
            head_dim = f.count("head_dim", default=self.hidden_size // heads)
        return ModelSpec(
            name=name,
            family=family,
            architecture=architecture_of(self.config),
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            vocab_size=f.count("vocab_size"),
            num_attention_heads=heads,
            num_kv_heads=f.count("num_key_value_heads", default=heads),
            head_dim=head_dim,
            attention=attention,
            max_context=f.int("max_position_embeddings"),
            moe_layers=moe_layers,
            dense_layers=tuple(i for i in range(self.num_layers) if i not in moe_layers),
            n_routed_experts=self.n_routed_experts,
            experts_per_token=self.experts_per_token,
            tie_word_embeddings=bool(self.text.get("tie_word_embeddings", False)),
            has_vision=self.has_vision,
            expert_format=expert_format,
            other_format=other_format,
            torch_dtype=torch_dtype_of(self.text),
            config=self.text,
            **particular,
        )


# --- layer rules more than one family uses ---------------------------------------------------


def sliding_layers_from_types(layer_types: Iterable[str]) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")


def sparse_step_moe_layers(f: Fields, n_layers: int, n_experts: int) -> tuple[int, ...]:
    """Qwen2-MoE / Qwen3-MoE rule: layer i has experts unless listed in ``mlp_only_layers``,
    and only every ``decoder_sparse_step``-th layer (counting from 1) does."""
    step = f.int("decoder_sparse_step", default=1)
    if step < 1:
        raise ModelError(f"'decoder_sparse_step' in {f.source} must be at least 1, not {step}.",
                         "Restore the original config.json from the model repository.")
    dense = set(f.int_list("mlp_only_layers"))
    return tuple(i for i in range(n_layers)
                 if n_experts > 0 and i not in dense and (i + 1) % step == 0)


def qwen2_sliding_layers(f: Fields, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, sliding layers) of a Qwen2-MoE config, as transformers' Qwen2MoeConfig
    decides: the window only with ``use_sliding_window``; the layers from ``layer_types`` when
    given (transformers 5 writes it), else every other layer (0, 2, 4, ...) below
    ``max_window_layers`` (default 28)."""
    window = f.int("sliding_window", default=4096) if f.get("use_sliding_window", default=False) else None
    types = f.get("layer_types")
    if isinstance(types, list) and types:
        layers = sliding_layers_from_types(types)
    else:
        below = f.int("max_window_layers", default=28)
        layers = tuple(i for i in range(n_layers) if i % 2 == 0 and i < below)
    return (window, layers) if window and layers else (None, ())


def qwen3_sliding_layers(f: Fields, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, sliding layers) of a Qwen3-MoE config, as transformers' Qwen3MoeConfig
    decides: with ``use_sliding_window`` every layer slides (``max_window_layers`` is not read)."""
    window = f.int("sliding_window", default=4096) if f.get("use_sliding_window", default=False) else None
    return (window, tuple(range(n_layers))) if window else (None, ())


# --- tensor shapes for config-only inventories ---------------------------------------------


@dataclass(frozen=True)
class TensorShape:
    """One tensor a checkpoint of this config holds, named as the safetensors files name it.

    ``role`` drives the storage format in a config-only inventory: ``matrix`` (a Linear
    weight, quantized like the others of its class), ``vector`` (norms, biases: kept in
    float), ``fp32`` (a vector the checkpoints keep in float32, like DeepSeek's
    ``e_score_correction_bias``), ``router``, ``token_embd``, ``output``, ``mtp`` (the MTP
    merge projection, kept in 16 bit), the llama.cpp mix roles ``attn_v``, ``attn_output``,
    ``ffn_down``, and ``vision`` for an estimate of a vision tower.
    """

    name: str
    shape: tuple[int, ...]
    role: str = "matrix"
    # Identical tensors this entry stands for: the routed experts of one layer are listed
    # once (named for expert 0) rather than 384 times.
    count: int = 1

    @property
    def n_weights(self) -> int:
        return math.prod(self.shape) * self.count


def norm(name: str, width: int) -> TensorShape:
    return TensorShape(name, (width,), "vector")


def linear(name: str, out: int, inp: int, role: str = "matrix", bias: bool = False) -> Iterator[TensorShape]:
    yield TensorShape(f"{name}.weight", (out, inp), role)
    if bias:
        yield TensorShape(f"{name}.bias", (out,), "vector")


def gqa_attention(prefix: str, s: ModelSpec, *, qkv_bias: bool = False, o_bias: bool = False,
                  q_norm: int = 0, k_norm: int = 0, sinks: bool = False) -> Iterator[TensorShape]:
    """q/k/v/o projections of the spec's heads; ``q_norm``/``k_norm`` are the widths of
    those norms (0: none)."""
    hidden, heads, kv_heads, head_dim = s.hidden_size, s.num_attention_heads, s.num_kv_heads, s.head_dim
    yield from linear(f"{prefix}.q_proj", heads * head_dim, hidden, bias=qkv_bias)
    yield from linear(f"{prefix}.k_proj", kv_heads * head_dim, hidden, bias=qkv_bias)
    yield from linear(f"{prefix}.v_proj", kv_heads * head_dim, hidden, "attn_v", bias=qkv_bias)
    yield from linear(f"{prefix}.o_proj", hidden, heads * head_dim, "attn_output", bias=o_bias)
    if q_norm:
        yield norm(f"{prefix}.q_norm.weight", q_norm)
    if k_norm:
        yield norm(f"{prefix}.k_norm.weight", k_norm)
    if sinks:
        yield TensorShape(f"{prefix}.sinks", (heads,), "vector")


def swiglu(prefix: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> Iterator[TensorShape]:
    gate, up, down = names
    yield from linear(f"{prefix}.{gate}", inter, hidden)
    yield from linear(f"{prefix}.{up}", inter, hidden)
    yield from linear(f"{prefix}.{down}", hidden, inter, "ffn_down")


def routed_moe(prefix: str, s: ModelSpec, *, correction_bias: bool = False,
               names=("gate_proj", "up_proj", "down_proj")) -> Iterator[TensorShape]:
    """The router ``{prefix}.gate`` and the routed experts ``{prefix}.experts.{e}.{gate,up,down}``
    as the published checkpoints hold them (per expert, not fused): one entry per projection
    with ``count`` = the number of experts. ``correction_bias``: DeepSeek-V3-style routing's
    per-expert ``e_score_correction_bias``."""
    yield TensorShape(f"{prefix}.gate.weight", (s.n_routed_experts, s.hidden_size), "router")
    if correction_bias:
        yield TensorShape(f"{prefix}.gate.e_score_correction_bias", (s.n_routed_experts,), "fp32")
    for t in swiglu(f"{prefix}.experts.0", s.hidden_size, s.moe_intermediate_size, names):
        yield TensorShape(t.name, t.shape, t.role, s.n_routed_experts)


def deepseek_style_mlp(prefix: str, s: ModelSpec, moe: bool, *, correction_bias: bool) -> Iterator[TensorShape]:
    """The MLP of a DeepSeek-V3-style layer (GLM-4.5 has the same): a dense SwiGLU, or in a
    MoE layer the router, the routed experts and ``shared_experts`` (one MLP as wide as all
    the shared experts together)."""
    if not moe:
        yield from swiglu(prefix, s.hidden_size, s.dense_intermediate_size)
        return
    yield from routed_moe(prefix, s, correction_bias=correction_bias)
    if s.n_shared_experts:
        yield from swiglu(f"{prefix}.shared_experts", s.hidden_size, s.shared_intermediate_size)


def mtp_layer_extras(prefix: str, s: ModelSpec) -> Iterator[TensorShape]:
    """What a DeepSeek-V3 MTP / GLM-4.5 NextN layer holds beyond its decoder layer: its own
    copies of the embedding and the head, and the projection merging the two streams."""
    h = s.hidden_size
    yield TensorShape(f"{prefix}.embed_tokens.weight", (s.vocab_size, h), "token_embd")
    yield norm(f"{prefix}.enorm.weight", h)
    yield norm(f"{prefix}.hnorm.weight", h)
    yield TensorShape(f"{prefix}.eh_proj.weight", (h, 2 * h), "mtp")
    yield norm(f"{prefix}.shared_head.norm.weight", h)
    yield TensorShape(f"{prefix}.shared_head.head.weight", (s.vocab_size, h), "output")


def decoder_norms(prefix: str, hidden: int) -> Iterator[TensorShape]:
    yield norm(f"{prefix}.input_layernorm.weight", hidden)
    yield norm(f"{prefix}.post_attention_layernorm.weight", hidden)


def embeddings(vocab: int, hidden: int, tie: bool, prefix: str = "model") -> Iterator[TensorShape]:
    yield TensorShape(f"{prefix}.embed_tokens.weight", (vocab, hidden), "token_embd")
    yield norm(f"{prefix}.norm.weight", hidden)
    if not tie:
        lm = "lm_head.weight" if prefix == "model" else prefix.rsplit(".", 1)[0] + ".lm_head.weight"
        yield TensorShape(lm, (vocab, hidden), "output")


# --- GGUF metadata -> config -----------------------------------------------------------------

# A GGUFKey default: the key must be in the file.
REQUIRED: Any = _MISSING
# A GGUFKey default: embedding_length / head_count, what llama.cpp assumes for a missing
# attention.key_length.
HIDDEN_PER_HEAD: Any = object()


@dataclass(frozen=True)
class GGUFKey:
    """One Hugging Face config key and the ``{arch}.*`` key(s) llama.cpp's converter stores it
    under; of several, the first one present is read."""

    hf: str
    gguf: str | tuple[str, ...]
    default: Any = REQUIRED
    kind: type = int  # int, float, or bool (a flag; give a default)

    def read(self, f: Fields, cfg: Mapping[str, Any]) -> Any:
        names = (self.gguf,) if isinstance(self.gguf, str) else self.gguf
        default = self.default
        if default is HIDDEN_PER_HEAD:
            default = cfg["hidden_size"] // cfg["num_attention_heads"]
        if self.kind is bool:
            return bool(f.get(*names, default=default))
        if self.kind is float:
            return f.float(*names, default=default)
        return f.int(*names, default=default)


# The DeepSeek-V3-style MoE settings, which GLM-4.5 names alike and llama.cpp stores alike
# for deepseek2 and glm4moe. block_count counts the NextN/MTP layers too: those families
# take num_nextn_predict_layers off num_hidden_layers.
DEEPSEEK_STYLE_MOE_KEYS = (
    GGUFKey("num_nextn_predict_layers", "nextn_predict_layers", default=0),
    GGUFKey("intermediate_size", "feed_forward_length"),
    GGUFKey("moe_intermediate_size", "expert_feed_forward_length"),
    GGUFKey("n_routed_experts", "expert_count"),
    GGUFKey("n_shared_experts", "expert_shared_count", default=0),
    GGUFKey("first_k_dense_replace", "leading_dense_block_count", default=0),
    GGUFKey("routed_scaling_factor", "expert_weights_scale", default=1.0, kind=float),
)


def gguf_vocab_size(metadata: Mapping[str, Any], arch: str, tensor_shapes: Mapping[str, tuple[int, ...]] | None) -> int | None:
    """Vocabulary size of a GGUF: the ``{arch}.vocab_size`` key, else the tokenizer's token
    list, else the rows of ``token_embd.weight``."""
    if metadata.get(f"{arch}.vocab_size"):
        return int(metadata[f"{arch}.vocab_size"])
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    if tensor_shapes and "token_embd.weight" in tensor_shapes:
        return int(tensor_shapes["token_embd.weight"][0])
    return None


def gguf_to_config(metadata: Mapping[str, Any], source: str, tensor_shapes: Mapping[str, tuple[int, ...]] | None,
                   arch: str, keys: Iterable[GGUFKey]) -> tuple[dict[str, Any], Fields]:
    """A GGUF's metadata as a Hugging Face text config: the keys every llama.cpp MoE decoder
    stores, then the family's ``keys``. Also returns the ``{arch}.*`` Fields, for what the
    family computes rather than copies (its ``architectures`` and ``model_type`` included)."""
    f = Fields(metadata, source, prefix=f"{arch}.", what="GGUF key")
    vocab = gguf_vocab_size(metadata, arch, tensor_shapes)
    if vocab is None:
        raise f.missing(["vocab_size"])
    heads = f.count("attention.head_count")
    cfg: dict[str, Any] = {
        "hidden_size": f.count("embedding_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": f.count("attention.head_count_kv", default=heads),
        "max_position_embeddings": f.count("context_length"),
        "vocab_size": vocab,
        "rms_norm_eps": f.float("attention.layer_norm_rms_epsilon", default=1e-6),
        "torch_dtype": "bfloat16",
    }
    if f.has("rope.freq_base"):
        cfg["rope_theta"] = f.float("rope.freq_base")
    if tensor_shapes is not None:
        cfg["tie_word_embeddings"] = "output.weight" not in tensor_shapes
    scaling = f.get("rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {
            "type": scaling,
            "rope_type": scaling,
            "factor": f.float("rope.scaling.factor", default=1.0),
            "original_max_position_embeddings": f.int("rope.scaling.original_context_length", default=None),
        }
    if metadata.get("general.name"):
        cfg["_name_or_path"] = metadata["general.name"]
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    cfg["num_hidden_layers"] = f.count("block_count")
    cfg["num_experts_per_tok"] = f.count("expert_used_count")
    for key in keys:
        cfg[key.hf] = key.read(f, cfg)
    return cfg, f


# --- layer descriptions ---------------------------------------------------------------------


def hidden_act(s: ModelSpec) -> str:
    """The dense and shared MLPs' activation, as a description names it."""
    return activation_name(str(s.config.get("hidden_act", SILU)))


def rms_norms(s: ModelSpec, eps: float, *, weight_before_rounding: bool = False) -> Norm:
    """The RMSNorms of the config's epsilon (`eps` where it has none)."""
    return Norm(float(HFConfig(s.config).get("rms_norm_eps", eps)), weight_before_rounding)


def rotation(s: ModelSpec, theta: float, partial: float = 1.0, *, dim: int | None = None, layout: str = "halves",
             float32: bool = False) -> Rotation:
    """The rotary embedding of the config's rope settings (`theta` and `partial` where it has
    none) over `dim` features of each head (default: all)."""
    params = HFConfig(s.config).rope(default_theta=theta, default_partial=partial)
    return Rotation(params, s.head_dim if dim is None else dim, layout, float32)


def grouped_query(s: ModelSpec, i: int, loading: Loading, rotary: Rotation, *, qk_norm: str | None = None,
                  sinks: bool = False, clip_qkv: float | None = None) -> GroupedQueryAttention:
    """Layer i's grouped-query attention with the spec's heads and, for a sliding layer, its
    window (none where the window is as long as the context: it never bites). `qk_norm`:
    "per_head", "whole" or None."""
    window = s.window_of(i)
    return GroupedQueryAttention(
        heads=s.num_attention_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim, value_dim=s.head_dim,
        qk_norm=qk_norm, window=window if window is not None and window < loading.context else None, sinks=sinks,
        clip_qkv=clip_qkv, rotary=rotary, projections_native=loading.projections_native,
        cache_dtype=loading.cache_dtype)


def latent(s: ModelSpec, loading: Loading, rotary: Rotation) -> LatentAttention:
    """Multi-head latent attention with the spec's ranks (kv_b as stored or in the compute
    dtype, both of which the absorbed kernels read)."""
    return LatentAttention(
        heads=s.num_attention_heads, nope_dim=s.qk_nope_head_dim, rope_dim=s.qk_rope_head_dim,
        value_dim=s.v_head_dim, kv_lora_rank=s.kv_lora_rank, q_lora_rank=s.q_lora_rank or None,
        absorbed_allowed=True, rotary=rotary, projections_native=loading.projections_native,
        kv_b_native=True, cache_dtype=loading.cache_dtype)


def dense(s: ModelSpec, loading: Loading) -> DenseFeedForward:
    """A dense gated MLP (or shared experts) with the config's activation."""
    return DenseFeedForward(activation=hidden_act(s), projections_native=loading.projections_native)


def mixture(s: ModelSpec, i: int, loading: Loading, router: Router, *, shared: bool = False,
            shared_gate: bool = False, experts_native: str | None = None, **experts) -> MixtureOfExperts:
    """Layer i's routed experts under `router`, split as `loading` places them; `shared`:
    shared experts (an MLP of the spec's shared width), `shared_gate`: a sigmoid gate on them;
    `experts_native`: the family's reason its host experts are not read natively (else the
    loading's); `experts`: the fields in which these experts differ from the usual ones
    (``activation``, else the config's; ``tensors``; the clamped SwiGLU's)."""
    experts.setdefault("activation", hidden_act(s))
    on_main = loading.experts_on_main.get(i, 0)
    on_host = s.n_routed_experts - on_main
    return MixtureOfExperts(
        # The router's matrix is read natively where the projections are (``routing._keep_weight``).
        router=replace(router, matrix_native=loading.projections_native),
        shared=dense(s, loading) if shared and s.shared_intermediate_size else None,
        shared_gate=shared_gate and bool(s.shared_intermediate_size),
        shared_gate_native=shared_gate and bool(s.shared_intermediate_size) and loading.projections_native,
        experts_on_main=on_main, experts_on_host=on_host,
        experts_native=(experts_native or loading.experts_native.get(i)) if on_host else None,
        streamed=loading.streamed, **experts)


def softmax_topk(s: ModelSpec, loading: Loading, *, weights_float32: bool = False) -> Router:
    """Softmax over all experts, top k, renormalised as the spec's routing says (Qwen, OLMoE, Mixtral)."""
    return Router("softmax_topk", s.experts_per_token, normalize=s.routing.normalize,
                  matrix_float32=loading.router_float32, weights_float32=weights_float32)
