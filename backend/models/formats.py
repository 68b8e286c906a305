"""Storage formats of weights: how many bytes a tensor of a given shape takes (docs/sizing.md §1).

A format is named for what it stores, llama.cpp style: ``bf16``, ``fp8_block`` (DeepSeek-V3
fp8 with one fp32 scale per 128x128 block), ``int4_g32`` (compressed-tensors
``pack-quantized``: int4 in int32 words plus one bf16 scale per 32 weights), ``mxfp4``
(GPT-OSS experts), and the GGUF block types (``q8_0``, ``q4_k``, ...). ``tensor_bytes``
does the exact block arithmetic for a tensor shape; ``bits_per_weight`` is the resulting
average, scales included, and is what the planner prints.

Shapes are given in PyTorch order (``[..., out_features, in_features]``): the last
dimension is the contiguous row, which is the dimension GGUF blocks and int4 groups run
along (GGUF's ``ne[0]``). Leading dimensions (fused experts ``[E, out, in]``) are a batch.

``q4_k_m`` is not a storage type but llama.cpp's *mix*: each tensor gets its own GGML type
by a recipe. ``mix_tensor_format`` applies that recipe tensor by tensor for config-only
estimates; ``FORMATS["q4_k_m"].bits_per_weight`` is the average it gives routed experts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from hybridmoe.backend.errors import ModelError


@dataclass(frozen=True)
class StorageFormat:
    name: str
    bits_per_weight: float  # average over a tensor whose rows are whole blocks; scales included
    kind: str  # "float", "gguf" (GGML block type), "hf_quant" (safetensors quantization), "mix"
    block_size: int = 1  # weights per block along the row (GGUF), group size (int4_gN)
    block_bytes: int = 0  # bytes per block (GGUF)
    ggml_type: GGMLQuantizationType | None = None
    description: str = ""

    @property
    def is_gguf(self) -> bool:
        """Whether this names a GGUF tensor type (or mix) rather than a safetensors layout."""
        return self.kind in ("gguf", "mix") or self.name in ("f32", "f16")


def _gguf(name: str, qtype: GGMLQuantizationType, description: str) -> StorageFormat:
    block, size = GGML_QUANT_SIZES[qtype]
    return StorageFormat(name, 8 * size / block, "gguf", block, size, qtype, description)


# Average bits of a Q4_K_M routed expert, from llama.cpp's recipe (llama-quant.cpp,
# llama_tensor_get_type, LLAMA_FTYPE_MOSTLY_Q4_K_M): the default type is Q4_K, so
# ffn_gate_exps and ffn_up_exps are Q4_K (4.5 bits); ffn_down (dense, _exps and _shexp
# alike) becomes Q6_K in the layers where use_more_bits(i, n) holds -- the first and last
# eighth of the blocks plus every third block in between, i.e. half of them -- and stays Q4_K
# in the others: (4.5 + 4.5 + (6.5625 + 4.5) / 2) / 3 = 4.84375. attn_v follows the same
# half-and-half rule, output.weight is Q6_K, token_embd stays Q4_K, routers and norms stay
# F32. ``mix_tensor_format`` applies the rule per layer; this average is for callers that
# need one number (and is exact when the MoE layers split evenly, as Qwen3-30B-A3B's 48 do).
Q4_K_M_EXPERT_BITS = (4.5 + 4.5 + (6.5625 + 4.5) / 2) / 3

FORMATS: dict[str, StorageFormat] = {
    f.name: f
    for f in (
        StorageFormat("fp32", 32, "float", description="IEEE float32"),
        StorageFormat("bf16", 16, "float", description="bfloat16"),
        StorageFormat("fp16", 16, "float", description="IEEE float16"),
        StorageFormat("f32", 32, "float", ggml_type=GGMLQuantizationType.F32, description="GGUF F32"),
        StorageFormat("f16", 16, "float", ggml_type=GGMLQuantizationType.F16, description="GGUF F16"),
        StorageFormat("fp8_block", 8 + 32 / (128 * 128), "hf_quant", 128,
                      description="float8_e4m3fn weight + one fp32 weight_scale_inv per 128x128 block"),
        StorageFormat("fp8", 8, "hf_quant", description="float8_e4m3fn, one scale per tensor"),
        StorageFormat("int4_g32", 4 + 16 / 32, "hf_quant", 32,
                      description="compressed-tensors pack-quantized: int4 packed 8 per int32 "
                                  "+ one bf16 scale per 32 weights (symmetric)"),
        StorageFormat("int4_g128", 4 + 16 / 128, "hf_quant", 128,
                      description="compressed-tensors pack-quantized, group 128"),
        StorageFormat("mxfp4", 4.25, "hf_quant", 32, 17, GGMLQuantizationType.MXFP4,
                      description="32 x e2m1 + one e8m0 scale (GPT-OSS experts; GGUF MXFP4)"),
        _gguf("q8_0", GGMLQuantizationType.Q8_0, "32 int8 + fp16 scale"),
        _gguf("q5_0", GGMLQuantizationType.Q5_0, "32 x 5 bit + fp16 scale"),
        _gguf("q5_1", GGMLQuantizationType.Q5_1, "32 x 5 bit + fp16 scale and min"),
        _gguf("q4_0", GGMLQuantizationType.Q4_0, "32 x 4 bit + fp16 scale"),
        _gguf("q4_1", GGMLQuantizationType.Q4_1, "32 x 4 bit + fp16 scale and min"),
        _gguf("iq4_nl", GGMLQuantizationType.IQ4_NL, "32 x 4 bit non-linear + fp16 scale"),
        _gguf("q2_k", GGMLQuantizationType.Q2_K, "256-weight super-blocks, 2 bit"),
        _gguf("q3_k", GGMLQuantizationType.Q3_K, "256-weight super-blocks, 3 bit"),
        _gguf("q4_k", GGMLQuantizationType.Q4_K, "256-weight super-blocks, 6-bit sub-scales and mins"),
        _gguf("q5_k", GGMLQuantizationType.Q5_K, "256-weight super-blocks, 5 bit"),
        _gguf("q6_k", GGMLQuantizationType.Q6_K, "256-weight super-blocks, 6 bit"),
        _gguf("iq4_xs", GGMLQuantizationType.IQ4_XS, "256-weight super-blocks, 4 bit non-linear"),
        # The grid i-quants of the community mixes (routed experts of DeepSeek, Kimi, Qwen3 and
        # GLM GGUFs): groups of 8 (IQ3: 4) weights coded as an index into a fixed grid, with signs.
        _gguf("iq3_s", GGMLQuantizationType.IQ3_S,
              "256-weight super-blocks, 3.4375 bit: 512-entry grid of 4, sign bits, 4-bit scale per 32"),
        _gguf("iq3_xxs", GGMLQuantizationType.IQ3_XXS,
              "256-weight super-blocks, 3.0625 bit: 256-entry grid of 4, 7-bit sign codes, 4-bit scale per 32"),
        _gguf("iq2_s", GGMLQuantizationType.IQ2_S,
              "256-weight super-blocks, 2.5625 bit: 1024-entry grid of 8, sign bits, 4-bit scale per 16"),
        _gguf("iq2_xs", GGMLQuantizationType.IQ2_XS,
              "256-weight super-blocks, 2.3125 bit: 512-entry grid of 8, 7-bit sign codes, 4-bit scale per 16"),
        _gguf("iq2_xxs", GGMLQuantizationType.IQ2_XXS,
              "256-weight super-blocks, 2.0625 bit: 256-entry grid of 8, 7-bit sign codes, 4-bit scale per 32"),
        _gguf("iq1_m", GGMLQuantizationType.IQ1_M,
              "256-weight super-blocks, 1.75 bit: 2048-entry ternary grid of 8, 3-bit scale per 16"),
        _gguf("iq1_s", GGMLQuantizationType.IQ1_S,
              "256-weight super-blocks, 1.5625 bit: 2048-entry ternary grid of 8, 3-bit scale per 32"),
        # Ternary types (llama.cpp writes them for BitNet-style models only).
        _gguf("tq2_0", GGMLQuantizationType.TQ2_0, "256-weight super-blocks, 2.0625 bit: ternary, 2 bits each"),
        _gguf("tq1_0", GGMLQuantizationType.TQ1_0, "256-weight super-blocks, 1.6875 bit: ternary, 5 per byte"),
        StorageFormat("q4_k_m", Q4_K_M_EXPERT_BITS, "mix",
                      description="llama.cpp Q4_K_M mix: Q4_K, with Q6_K for half the ffn_down and "
                                  "attn_v tensors and for output.weight"),
    )
}

# GGML types that have their own name above; every other GGML type is named by lowercasing.
_GGML_NAMES = {f.ggml_type: f.name for f in FORMATS.values() if f.ggml_type is not None}
_GGML_NAMES[GGMLQuantizationType.BF16] = "bf16"

# Safetensors dtypes -> (bytes per element, storage format name for float dtypes).
SAFETENSORS_DTYPES: dict[str, tuple[float, str | None]] = {
    "F64": (8, None), "F32": (4, "fp32"), "F16": (2, "fp16"), "BF16": (2, "bf16"),
    "I64": (8, None), "I32": (4, None), "I16": (2, None), "I8": (1, None),
    "U64": (8, None), "U32": (4, None), "U16": (2, None), "U8": (1, None), "BOOL": (1, None),
    "F8_E4M3": (1, "fp8"), "F8_E5M2": (1, "fp8"), "F8_E8M0": (1, None),
}

TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


# GGUF types the CPU kernels read in place (native/src/formats.h); the engine widens a dense
# projection stored in any other to its compute dtype on the CPU.
GGUF_CPU_KERNEL_TYPES = frozenset({
    "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4",
    "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
})
# The same for a tensor record's dtype (GGUF type or safetensors dtype), floats included; a
# compressed-tensors int4 matrix's parts (weight_packed, ...) count as read in place.
CPU_KERNEL_DTYPES = GGUF_CPU_KERNEL_TYPES | {"bf16", "f16", "f32", "fp16", "fp32", "int4_g32"}
# GGUF types the engine's GPU kernels read in place (engine/stored_linear.py): a GPU holds an
# always-read projection stored in one of them as stored, any other in its compute dtype.
GGUF_GPU_KERNEL_TYPES = frozenset({
    "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4",
    "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m",
})


# Stored 4-bit formats a GPU can hold as they are (hybridmoe.backend.formats.int4_weights):
# their group of weights per scale, and whether a group also has a min (an affine code).
_INT4_RESIDENT = {"q4_0": (32, False), "q4_1": (32, True), "q4_k": (32, True), "iq4_nl": (32, False),
                  "iq4_xs": (32, False), "mxfp4": (32, False)}


def int4_resident_layout(name: str) -> tuple[int, bool] | None:
    """(group, has_min) of the 4-bit form a GPU holds weights stored as `name` in (the same
    codes, one 16-bit scale per group and, for Q4_1 and Q4_K, one 16-bit min); None for a
    format that is not 4-bit (those are widened: dense or int8)."""
    key = name.lower()
    m = re.fullmatch(r"int4_g(\d+)", key)
    if m and int(m.group(1)) > 0 and int(m.group(1)) % 2 == 0:
        return int(m.group(1)), False
    return _INT4_RESIDENT.get(key)


def get_format(name: str) -> StorageFormat:
    """The format called `name` (case-insensitive); ``int4_gN`` works for any group N."""
    key = name.lower()
    if key in FORMATS:
        return FORMATS[key]
    m = re.fullmatch(r"int4_g(\d+)", key)
    if m and int(m.group(1)) > 0:
        group = int(m.group(1))
        return StorageFormat(key, 4 + 16 / group, "hf_quant", group,
                             description=f"compressed-tensors pack-quantized, group {group}")
    if key.upper() in GGMLQuantizationType.__members__:
        return ggml_format(GGMLQuantizationType[key.upper()])
    raise ModelError(
        f"Unknown storage format '{name}'.",
        "Use one of: " + ", ".join(sorted(FORMATS)) + ".",
    )


def ggml_format(qtype: GGMLQuantizationType | int) -> StorageFormat:
    """The storage format of a GGUF tensor type."""
    qtype = GGMLQuantizationType(qtype)
    name = _GGML_NAMES.get(qtype, qtype.name.lower())
    if name in FORMATS:
        return FORMATS[name]
    block, size = GGML_QUANT_SIZES[qtype]
    return StorageFormat(name, 8 * size / block, "gguf", block, size, qtype, f"GGUF {qtype.name}")


def ggml_type_name(qtype: GGMLQuantizationType | int) -> str:
    return ggml_format(qtype).name


def file_type_name(ftype: int) -> str | None:
    """GGUF ``general.file_type`` (llama_ftype) -> a format name such as ``q4_k_m``."""
    try:
        member = LlamaFileType(int(ftype))
    except ValueError:
        return None
    if member.name == "GUESSED":
        return None
    name = member.name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
    return {"f16": "f16", "f32": "f32"}.get(name, name)


def tensor_bytes(fmt: str | StorageFormat, shape: Sequence[int]) -> int:
    """Bytes a tensor of `shape` (PyTorch order) takes in `fmt`, scales included.

    Exact for every block format; raises ``ValueError`` when a row is not a whole number of
    blocks (llama.cpp then falls back to another type: see ``gguf_row_fallback``).
    """
    f = fmt if isinstance(fmt, StorageFormat) else get_format(fmt)
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    if n == 0:
        return 0
    row = shape[-1]
    rows = n // row
    if f.kind == "float":
        return n * int(f.bits_per_weight) // 8
    if f.kind == "mix":
        # A mix has no single layout; callers that know the tensor's role use
        # mix_tensor_format. This is the documented average.
        return math.ceil(n * f.bits_per_weight / 8)
    if f.name == "fp8":
        return n + 4  # one fp32 scale for the tensor
    if f.name == "fp8_block":
        # weight_scale_inv is fp32 [ceil(out/128), ceil(in/128)] per 2-D matrix.
        out = shape[-2] if len(shape) >= 2 else 1
        batch = n // (out * row)
        return n + batch * math.ceil(out / 128) * math.ceil(row / 128) * 4
    if f.name.startswith("int4_g"):
        # weight_packed int32 [out, in/8] (4 bits each) + weight_scale bf16 [out, in/group].
        return rows * math.ceil(row / 8) * 4 + rows * math.ceil(row / f.block_size) * 2
    # GGUF block types and mxfp4: whole blocks along the row.
    if row % f.block_size:
        raise ValueError(f"row of {row} weights is not a multiple of the {f.name} block ({f.block_size})")
    return rows * (row // f.block_size) * f.block_bytes


_ROW_FALLBACK = {
    "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "tq1_0": "q4_0", "tq2_0": "q4_0",
    **dict.fromkeys(("q2_k", "q3_k", "iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s"),
                    "iq4_nl"),
}


def gguf_row_fallback(fmt: str, row: int) -> str:
    """The type llama.cpp's quantizer uses when a row is not a whole number of `fmt` blocks.

    From llama-quant.cpp (``convert_incompatible_tensor``): K-quants and IQ types fall back to
    a 32-weight type (every 2- and 3-bit type, the i-quants and IQ4_XS to IQ4_NL; the ternary
    types to Q4_0), and to F16 when even that does not divide the row (GPT-OSS's 2880-wide
    rows are 11.25 super-blocks).
    """
    f = get_format(fmt)
    if f.kind not in ("gguf",) or row % f.block_size == 0:
        return f.name
    fallback = _ROW_FALLBACK.get(f.name, "f16")
    if fallback != "f16" and row % get_format(fallback).block_size:
        fallback = "f16"
    return fallback


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the _M mixes."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def mix_tensor_format(mix: str, role: str, layer: int | None, n_layers: int, n_expert: int, row: int) -> str:
    """GGML type llama.cpp's quantizer gives one tensor of a ``q4_k_m`` (or ``q5_k_m``) mix.

    `role` is the tensor's llama.cpp role: ``token_embd``, ``output``, ``attn_v``,
    ``attn_output``, ``ffn_down``, ``router``, ``vector`` (norms, biases) or ``matrix``
    (any other 2-D weight). `n_layers` is the GGUF block count, `n_expert` the expert count.
    """
    mix = mix.lower()
    if mix not in ("q4_k_m", "q5_k_m"):
        raise ModelError(f"No llama.cpp recipe known for the mix '{mix}'.", "Use q4_k_m or q5_k_m.")
    base = "q4_k" if mix == "q4_k_m" else "q5_k"
    if role in ("vector", "router"):
        return "f32"  # 1-D tensors are never quantized; ffn_gate_inp is kept as converted (F32)
    if role == "output":
        chosen = "q6_k"
    elif role == "token_embd":
        chosen = base
    elif role == "attn_v":
        chosen = "q6_k" if layer is not None and use_more_bits(layer, n_layers) else base
        if n_expert == 8:
            chosen = "q8_0"  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    elif role == "attn_output" and n_expert == 8:
        chosen = "q5_k"
    elif role == "ffn_down":
        chosen = "q6_k" if layer is not None and use_more_bits(layer, n_layers) else base
    else:
        chosen = base
    return gguf_row_fallback(chosen, row)
