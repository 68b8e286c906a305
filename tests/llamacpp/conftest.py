"""Tiny GGUFs of three families for the llama.cpp backend, and plans for them.

The files come from tiny transformers checkpoints (tests/convert's builders: random weights,
a trained tokenizer, a chat template) through the project's converter, so the backend is tested
on what users get from `hybridmoe convert`: qwen3moe (byte-level BPE, ChatML), deepseek2 (MLA,
shared experts, a leading dense block) and llama/Mixtral (SentencePiece with byte fallback).

Greedy equality with the engine needs both sides to compute the same numbers: llama.cpp rounds
activations to bf16 for bf16 weights and the engine rounds its logits to bf16, which in a random
400-token model leaves exact ties every few steps. ``ggufs(family, "f32")`` is the converted
file with every tensor in F32 (bf16 weights widen exactly), on which both compute in float32.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from tests.convert.conftest import build_checkpoint

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral")


def copy_gguf(src: Path, dst: Path, *, f32: bool = False, arch: str | None = None,
              values: dict | None = None) -> Path:
    """A copy of the GGUF ``src``: with every tensor stored as F32 (``f32``), under another
    architecture name (``arch``: its "ARCH.*" keys renamed too), with string ``values`` replaced."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch or old_arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type" and f32:
            writer.add_file_type(LlamaFileType.ALL_F32)
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        value = (values or {}).get(name, field.contents())
        if arch and name.startswith(f"{old_arch}."):
            name = f"{arch}." + name.removeprefix(f"{old_arch}.")
        writer.add_key_value(name, value, kind, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(shape))
        elif f32:
            writer.add_tensor(t.name, dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # bytes as stored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def byte_token_types(path: Path) -> dict:
    """Token types with <0xNN> marked BYTE. The test's SentencePiece tokenizer registers its
    byte tokens as added special tokens, which the converter faithfully writes as CONTROL;
    in real Mixtral/Llama vocabularies they are plain entries, written as BYTE, and llama.cpp
    renders a CONTROL "<0x0A>" as that text rather than as the byte."""
    from hybridmoe.backend.text.tokenizer import GGUF_BYTE, read_gguf_metadata

    meta = read_gguf_metadata(path)
    types = [GGUF_BYTE if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else k
             for t, k in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], strict=True)]
    return {"tokenizer.ggml.token_type": types}


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            directory = tmp_path_factory.mktemp(family)
            build_checkpoint(directory, family)
            cache[family] = directory
        return cache[family]

    return get


@pytest.fixture(scope="session")
def ggufs(tmp_path_factory, checkpoint_dirs):
    """ggufs(family, quant="bf16") -> a converted GGUF; quant "f32" widens the bf16 file."""
    from hybridmoe.backend.convert import to_gguf

    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, quant: str = "bf16") -> Path:
        key = (family, quant)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"gguf_{family}")
            if quant == "f32":
                cache[key] = copy_gguf(get(family, "bf16"), out / f"{family}-f32.gguf", f32=True)
            elif family == "mixtral":
                converted = to_gguf(checkpoint_dirs(family), out / f"converted-{quant}.gguf", quant)
                cache[key] = copy_gguf(converted, out / f"{family}-{quant}.gguf", values=byte_token_types(converted))
            else:
                cache[key] = to_gguf(checkpoint_dirs(family), out / f"{family}-{quant}.gguf", quant)
        return cache[key]

    return get


def make_plan(path: Path, *, gpu_moe_layers: int | None = None, context: int = 256, **llama_cpp):
    """A plan for this machine (CPU only) whose llama.cpp settings are those the planner gives a
    machine with a GPU that holds the experts of the last ``gpu_moe_layers`` MoE layers (the
    others' experts then stay on the CPU through overrides), then ``llama_cpp`` on top."""
    from hybridmoe.backend.hardware.presets import preset
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make
    from hybridmoe.backend.plan.llamacpp import translate

    model = inspect_model(path)
    plan = make(model.spec, model.inventory, preset("cpu-only"), Workload(context=context))
    settings = dict(plan.llama_cpp)
    if gpu_moe_layers is not None:
        by_layer = model.inventory.routed_bytes_by_layer
        budget = sum(by_layer[i] for i in model.spec.moe_layers[len(model.spec.moe_layers) - gpu_moe_layers:])
        settings = translate(model.spec, by_layer, budget, [1 << 34], 2, context, 1, "bf16")
    # One thread: these models are tiny, and on a busy two-core CI machine llama.cpp's spinning
    # OpenMP workers slow a run down several times over.
    settings.update({"n_threads": 1, **llama_cpp})
    return dataclasses.replace(plan, llama_cpp=settings)
