"""What the family modules share: reading config fields with clear errors, the storage
format a checkpoint declares in ``quantization_config``, and the tensor shapes of the usual
building blocks (GQA attention, SwiGLU MLPs, routed experts) for config-only inventories.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from backend.errors import ModelError, UnsupportedModelError
from backend.models.formats import TORCH_DTYPES, get_format

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
        key, value = self._lookup(names)
        if value is _MISSING:
            if default is _MISSING:
                raise self.missing(names)
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ModelError(
                f"{self.what.capitalize()} '{key}' in {self.source} should be a whole number, not {value!r}.",
                "The file looks damaged or hand-edited; restore the original from the model repository.",
            )
        return int(value)

    def float(self, *names: str, default: Any = _MISSING) -> float:
        key, value = self._lookup(names)
        if value is _MISSING:
            if default is _MISSING:
                raise self.missing(names)
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelError(
                f"{self.what.capitalize()} '{key}' in {self.source} should be a number, not {value!r}.",
                "The file looks damaged or hand-edited; restore the original from the model repository.",
            )
        return float(value)

    def get(self, *names: str, default: Any = None) -> Any:
        value = self._lookup(names)[1]
        return default if value is _MISSING else value

    def int_list(self, *names: str, default: Any = ()) -> tuple[int, ...]:
        key, value = self._lookup(names)
        if value is _MISSING:
            return tuple(default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
            raise ModelError(
                f"{self.what.capitalize()} '{key}' in {self.source} should be a list of layer indices, "
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


def sliding_layers_from_types(layer_types: Iterable[str]) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")


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


def gqa_attention(prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, *,
                  qkv_bias: bool = False, o_bias: bool = False, q_norm: int = 0, k_norm: int = 0,
                  sinks: bool = False) -> Iterator[TensorShape]:
    """q/k/v/o projections; ``q_norm``/``k_norm`` are the widths of those norms (0: none)."""
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


def routed_experts(prefix: str, n_experts: int, hidden: int, inter: int,
                   names=("gate_proj", "up_proj", "down_proj")) -> Iterator[TensorShape]:
    """Per-expert tensors ``{prefix}.{e}.{gate,up,down}`` as the published checkpoints hold
    them, one entry per projection with ``count`` = the number of experts."""
    for t in swiglu(f"{prefix}.0", hidden, inter, names):
        yield TensorShape(t.name, t.shape, t.role, n_experts)


def decoder_norms(prefix: str, hidden: int) -> Iterator[TensorShape]:
    yield norm(f"{prefix}.input_layernorm.weight", hidden)
    yield norm(f"{prefix}.post_attention_layernorm.weight", hidden)


def embeddings(vocab: int, hidden: int, tie: bool, prefix: str = "model") -> Iterator[TensorShape]:
    yield TensorShape(f"{prefix}.embed_tokens.weight", (vocab, hidden), "token_embd")
    yield norm(f"{prefix}.norm.weight", hidden)
    if not tie:
        lm = "lm_head.weight" if prefix == "model" else prefix.rsplit(".", 1)[0] + ".lm_head.weight"
        yield TensorShape(lm, (vocab, hidden), "output")


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


def gguf_common_config(f: Fields, arch: str, metadata: Mapping[str, Any],
                       tensor_shapes: Mapping[str, tuple[int, ...]] | None) -> dict[str, Any]:
    """The HF config fields every GGUF decoder has, translated from ``{arch}.*`` keys."""
    vocab = gguf_vocab_size(metadata, arch, tensor_shapes)
    if vocab is None:
        raise f.missing(["vocab_size"])
    heads = f.int("attention.head_count")
    cfg: dict[str, Any] = {
        "hidden_size": f.int("embedding_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": f.int("attention.head_count_kv", default=heads),
        "max_position_embeddings": f.int("context_length"),
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
    for src, dst in (("general.name", "_name_or_path"),):
        if metadata.get(src):
            cfg[dst] = metadata[src]
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        cfg["eos_token_id"] = int(eos)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = int(bos)
    return cfg


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


def qwen_sliding_layers(f: Fields, n_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(sliding_window, sliding layers) of Qwen2/Qwen3 configs: ``layer_types`` when given
    (transformers 5 writes it), else ``use_sliding_window`` from ``max_window_layers`` on."""
    window = f.int("sliding_window", default=None)
    types = f.get("layer_types")
    if isinstance(types, list) and types:
        layers = sliding_layers_from_types(types)
        return (window, layers) if window and layers else (None, ())
    if not f.get("use_sliding_window", default=False) or not window:
        return None, ()
    start = f.int("max_window_layers", default=0)
    return window, tuple(range(start, n_layers))


def check_routing(n_experts: int, top_k: int, source: str) -> None:
    if n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ModelError(
            f"{source} selects {top_k} of {n_experts} routed experts per token, which is impossible.",
            "Restore the original config from the model repository.",
        )
