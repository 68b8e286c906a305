"""On a CPU the native kernels read a norm's rows in float32, as llama.cpp's do: the
projections quantize them per row (or take them into their GEMM) and round only their outputs
to the compute dtype, and the routers' logits are the kernels' float32 sums. Rounding the rows
to bf16 first put a bf16 model's prompts further from the exact product of a file's weights
than llama.cpp's (benchmarks/greedy_vs_llama_cpp.py --reference)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.formats.quant import dequantize
from hybridmoe.backend.formats.weights import open_weights, require
from hybridmoe.backend.models import inspect_model
from tests.convert.conftest import checkpoints, converted  # noqa: F401 - fixtures: tiny checkpoints and GGUFs
from tests.engine.conftest import relative_error

pytestmark = pytest.mark.skipif(not native_kernels.enabled(), reason="without the kernels the rows stay bf16")


def cpu_model(path):
    return build_model(inspect_model(path).spec, open_weights(path), device="cpu", max_context=64)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_projection_reads_the_norms_float32_rows(family, converted):  # noqa: F811
    path = converted(family, "q8_0")
    model = cpu_model(path)
    assert model.dtype == torch.float32 and model.norm.float32  # a GGUF on the CPU: model._default_dtype
    layer = model.layers[0]
    rows = layer.attn_norm(3 * torch.randn(16, layer.attn_norm.weight.shape[0], generator=torch.Generator().manual_seed(0)))
    assert rows.dtype == torch.float32
    name = "kv_a_proj_with_mqa" if layer.attn.latent else "q_proj"
    projection = layer.attn.kv_a if layer.attn.latent else layer.attn.q
    stored = require(open_weights(path), f"model.layers.0.self_attn.{name}.weight")
    exact = rows.double() @ dequantize(stored, torch.float32).double().T
    unrounded, rounded = projection(rows, float32=True), projection(rows.bfloat16(), float32=True)
    assert projection(rows).dtype == model.dtype  # its outputs in the compute dtype
    assert relative_error(unrounded.double(), exact) < relative_error(rounded.double(), exact)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_router_computes_float32_logits_the_same_at_any_row_count(family, converted):  # noqa: F811
    model = cpu_model(converted(family, "q8_0"))
    layer = next(layer for layer in model.layers if hasattr(layer.ffn, "router"))
    router = layer.ffn.router
    rows = layer.ffn_norm(torch.randn(40, layer.ffn_norm.weight.shape[0], generator=torch.Generator().manual_seed(1)))
    for kind in ("prompt", "decode"):
        with native_kernels.rows_are(kind):
            ids, weights = router(rows)
            for a, b in ((0, 1), (1, 17), (17, 40)):
                part_ids, part_weights = router(rows[a:b])
                assert torch.equal(part_ids, ids[a:b]) and torch.equal(part_weights, weights[a:b]), (kind, a, b)
    assert weights.dtype == torch.float32
