"""A GGUF in other tensor types: the same model shape, metadata and tokenizer, each matrix
rewritten as random valid blocks of the type a rule gives it, at the spread of the source
tensor's values (``hybridmoe bench generate --types``, benchmarks/retype_gguf.py).

The community GGUFs of the giant models are dynamic mixes: routed experts in IQ1_S..IQ3_S,
attention and shared experts in Q4_K..Q8_0, types changing from layer to layer, files split in
parts. llama.cpp's own quantizer refuses the lowest of those types without an importance
matrix, which cannot be handed to it through llama-cpp-python, and requantizing the 10 GB
benchmark model takes many minutes a type on two cores. The benchmark models are random
anyway (benchmarks/make_midsize_qwen3.py), so random blocks of the target type are as good a
model (synthetic_experts.random_matrix makes the blocks): the same bytes per token, the same
layouts to decode, every code and scale field exercised, and llama.cpp and the engine read
the very same file.

``experts=T`` sets every routed expert tensor (gate, up, down) to T and keeps the others as
stored. ``mix="ud-q2_k_xl"`` is shaped like Unsloth's UD-Q2_K_XL of DeepSeek-V3: gate/up
experts IQ2_XXS (IQ3_XXS in the first and last MoE layers), down experts IQ3_XXS, attention
Q4_K with the value (and latent) projections Q6_K, shared experts and dense layers Q6_K,
embedding Q4_K, head Q8_0. ``mix="ud-iq1_s"``, like the UD-IQ1_S of DeepSeek-R1 (the
"1.58-bit" file most people run it from): gate/up experts IQ1_S (IQ2_XXS in the first and
last MoE layers), down experts IQ2_XXS, the rest as UD-Q2_K_XL's but a Q6_K head. A row that
is not whole blocks of its type takes llama.cpp's fallback type. ``parts=N`` writes N files,
``NAME-0000i-of-0000N.gguf``, as gguf-split does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

# mix -> the routed experts' gate/up type, gate/up's in the first and last MoE layers, down's;
# the head's
MIXES = {
    "ud-q2_k_xl": ("iq2_xxs", "iq3_xxs", "iq3_xxs", "q8_0"),
    "ud-iq1_s": ("iq1_s", "iq2_xxs", "iq2_xxs", "q6_k"),
}
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def mix_type(mix: str, name: str, first_moe: int, last_layer: int) -> str | None:
    """The type the Unsloth-shaped `mix` gives tensor `name` (None: keep it as stored)."""
    gate_up, edge, down, head = MIXES[mix]
    m = _EXPERTS.fullmatch(name)
    if m:
        layer, proj = int(m.group(1)), m.group(2)
        if proj == "down":
            return down
        return edge if layer in (first_moe, last_layer) else gate_up
    if name == "token_embd.weight":
        return "q4_k"
    if name == "output.weight":
        return head
    b = _BLOCK.fullmatch(name)
    if not b or not b.group(2).endswith(".weight") or "norm" in b.group(2) or "ffn_gate_inp" in b.group(2):
        return None
    part = b.group(2)
    if part.startswith(("attn_v", "attn_kv_b", "attn_k_b", "attn_v_b")) or "shexp" in part or part.startswith("ffn_"):
        return "q6_k"
    return "q4_k"


def retype(src: str | Path, dst: str | Path, *, experts: str | None = None, mix: str | None = None, parts: int = 1,
           seed: int = 0, on_tensor: Callable[[str, str, str], None] | None = None) -> list[Path]:
    """Write `src` retyped to `dst` (see the module); returns the files written.
    on_tensor(name, old type, new type) hears each matrix that changes type."""
    import gguf

    from hybridmoe.backend.bench.synthetic_experts import random_matrix
    from hybridmoe.backend.models.formats import gguf_row_fallback
    from hybridmoe.backend.models.gguf_reader import open_gguf_file

    if (experts is None) == (mix is None):
        raise ValueError("give one of experts= and mix=")
    if mix is not None and mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (known: {', '.join(MIXES)})")
    source = open_gguf_file(src)
    arch = source["general.architecture"]
    layers = int(source[f"{arch}.block_count"])
    first_moe = int(source.get(f"{arch}.leading_dense_block_count", 0))

    def target(name: str, row: int) -> str | None:
        fmt = experts if _EXPERTS.fullmatch(name) else None
        if mix is not None:
            fmt = mix_type(mix, name, first_moe, layers - 1)
        return gguf_row_fallback(fmt, row) if fmt else None

    per_part = -(-len(source.tensors) // parts) if parts > 1 else 0
    writer = gguf.GGUFWriter(None, arch, split_max_tensors=per_part)
    for key, field in source.fields.items():
        # general.file_type names the source's mix, which the new types no longer are.
        if key.startswith(("GGUF.", "split.")) or key in ("general.architecture", "general.alignment",
                                                            "general.file_type"):
            continue
        writer.add_key_value(key, source[key], field.type, sub_type=field.item_type)

    def byte_shape(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> tuple[int, ...]:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return (*shape[:-1], shape[-1] // block * size)

    rng = np.random.default_rng(seed)
    plan = []
    for t in source.tensors:
        fmt = target(t.name, t.shape[-1])
        if fmt == t.type_name:
            fmt = None
        qtype = t.ggml_type if fmt is None else gguf.GGMLQuantizationType[fmt.upper()]
        shape = byte_shape(t.shape, qtype)
        plan.append((t, fmt, shape))
        writer.add_tensor_info(t.name, shape, np.dtype(np.uint8), int(np.prod(shape)), qtype)

    writer.write_header_to_file(Path(dst))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t, fmt, shape in plan:
        stored = source.tensor_bytes(t)
        if fmt is None:
            writer.write_tensor_data(stored)
            continue
        # The spread of the source's values, from its first rows.
        rows = stored.reshape(-1, byte_shape(t.shape, t.ggml_type)[-1])[:64]
        scale = float(np.std(gguf.quants.dequantize(rows, t.ggml_type)))
        new = random_matrix(rng, fmt, t.shape, scale=scale or 0.02)
        writer.write_tensor_data(new.parts["data"].numpy().reshape(-1))
        if on_tensor is not None:
            on_tensor(t.name, t.type_name.upper(), fmt.upper())
    writer.close()
    source.close()
    return written_parts(Path(dst), parts)


def written_parts(dst: Path, parts: int) -> list[Path]:
    """The files a retype to `dst` in `parts` parts wrote (gguf-split's names)."""
    if parts <= 1:
        return [dst]
    stem = dst.with_suffix("")
    return [Path(f"{stem}-{i:05d}-of-{parts:05d}.gguf") for i in range(1, parts + 1)]
