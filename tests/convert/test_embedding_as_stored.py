"""A GGUF's embedding table on the CPU: held as the file stores it, each lookup dequantizing the
rows it reads in float32 as ggml does (llama.cpp's get_rows), and counted so by the planner."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.engine.native_linear import NativeLinear
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.inventory import TensorClass
from tests.quant.test_dequant_vs_llama_cpp import ggml_type_traits, llama_cpp_dequantize  # noqa: F401


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_a_gguf_table_is_looked_up_in_its_blocks(converted, quant, ggml_type_traits):  # noqa: F811
    path = converted("qwen3_moe", quant)
    inspected = inspect_model(path)
    model = build_model(inspected.spec.config, open_weights(path), max_context=32)
    assert model.embed is None and isinstance(model.embed_stored, NativeLinear)

    stored = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    qtype = GGMLQuantizationType(stored.tensor_type)
    rows = np.asarray(stored.data)  # [vocab, row bytes]
    ids = [0, 17, 5, 17, rows.shape[0] - 1]
    theirs = llama_cpp_dequantize(ggml_type_traits, qtype, rows[ids].reshape(-1, GGML_QUANT_SIZES[qtype][1]))
    ours = model.embed_stored.rows(torch.tensor(ids), torch.float32)
    assert torch.equal(ours.reshape(-1), torch.from_numpy(theirs))

    inventory = inspected.inventory
    assert inventory.held_bytes(TensorClass.EMBEDDING, 2, 4) == inventory.bytes_by_class[TensorClass.EMBEDDING]
