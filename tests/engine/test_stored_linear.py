"""Always-read projections held as the GGUF stores them on a GPU (``stored_linear``): the
kernels decode every block type the engine reads to the reference decoders' values bit for
bit, and a projection computes what PyTorch's matmul over the dequantized matrix computes, for
few tokens (the GEMV kernel) and many (dequantized tiles into a matmul), at shapes the kernels'
blocks do not divide.

On CUDA these run compiled; elsewhere Triton's interpreter runs them on CPU tensors, in a
process of its own (the interpreter is chosen when Triton is imported).
"""

from __future__ import annotations

import importlib.util
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from tests.convert.conftest import checkpoints, converted  # noqa: F401 - fixtures: tiny checkpoints and GGUFs
from tests.engine.conftest import run_kernel_check

# Where each type keeps an fp16 super-scale (random bytes there could be inf or NaN).
HALVES = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
          Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,), Q.IQ2_XXS: (0,),
          Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,), Q.IQ1_S: (0,)}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid GGUF bytes of a [rows, cols] matrix of any block type: random codes, sub-scales,
    grid indices and signs, with finite fp16 super-scales of both signs."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in HALVES.get(qtype, ()):
        d = (rng.standard_normal(len(data)) * 0.01).astype(np.float16)
        data[:, offset : offset + 2] = d.view(np.uint8).reshape(-1, 2)
    if qtype == Q.MXFP4:
        data[:, 0] = rng.integers(110, 135, size=len(data))  # e8m0 exponents near 2^0
    if qtype == Q.IQ1_M:  # d's sixteen bits sit in the top nibbles of the four scale words
        d = (rng.standard_normal(len(data)) * 0.01).astype(np.float16).view(np.uint16)
        for i in range(4):
            data[:, 49 + 2 * i] = (data[:, 49 + 2 * i] & 0x0F) | (((d >> (4 * i)) & 0xF) << 4).astype(np.uint8)
    return data.reshape(rows, -1)


CHECK = textwrap.dedent("""
    import json, sys
    DEVICE = sys.argv[2]
    import torch
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as Q
    from hybridmoe.backend.engine import stored_linear
    from hybridmoe.backend.formats import quant
    from tests.engine.test_stored_linear import random_blocks

    stored_linear.TILE_BYTES = 4096  # prompts' calls in several tiles, even at these widths
    g = torch.Generator().manual_seed(0)
    out = []
    for case in json.loads(sys.argv[1]):
        qtype = Q[case["type"]]
        rows, cols = case["rows"], case["cols"]
        stored = quant.from_gguf(random_blocks(qtype, rows, cols, seed=rows), qtype, (rows, cols)).to(DEVICE)
        ref = stored.dequantize()
        bias = torch.randn(rows, generator=g).to(DEVICE) if case["bias"] else None
        lin = stored_linear.StoredLinear(stored, bias)
        got = lin.dequantize(torch.float32)
        row = {**case, "exact": bool(torch.equal(got, ref)), "finite": bool(ref.isfinite().all()), "calls": []}
        for tokens in case["tokens"]:
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(tokens, cols, generator=g).to(DEVICE, dtype)
                y = lin(x)
                want = F.linear(x.float(), ref, None if bias is None else bias.float())
                err = float((y.float() - want).abs().max() / want.abs().max())
                row["calls"].append({"tokens": tokens, "dtype": str(dtype), "out": str(y.dtype),
                                     "shape": list(y.shape), "err": err})
        out.append(row)
    print(json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_every_type_decodes_bit_for_bit_and_multiplies_as_the_dequantized_matrix(tmp_path):
    from hybridmoe.backend.engine.stored_linear import GEMV_TOKENS, KERNEL_TYPES

    cases = []
    for qtype in sorted(KERNEL_TYPES, key=int):
        block = GGML_QUANT_SIZES[qtype][0]
        # 13 rows: no multiple of the kernels' row blocks; 160 columns of a 32-weight type: no
        # multiple of their column step; a single 256-weight block as a row.
        shapes = [(13, 160), (5, 32)] if block == 32 else [(13, 768), (3, 256)]
        for rows, cols in shapes:
            cases.append({"type": qtype.name, "rows": rows, "cols": cols, "bias": rows == 13,
                          "tokens": [1, 3, GEMV_TOKENS, GEMV_TOKENS + 1, 20] if rows == 13 else [2]})
    results = run_kernel_check(CHECK, cases, tmp_path, timeout=900)
    assert {r["type"] for r in results} == {t.name for t in KERNEL_TYPES}
    for row in results:
        assert row["finite"] and row["exact"], row  # the stored blocks decode to ggml's values
        for call in row["calls"]:
            assert call["out"] == call["dtype"] and call["shape"] == [call["tokens"], row["rows"]], (row["type"], call)
            # float32: the same products summed in another order; bfloat16 inputs and a bf16 result
            # (the interpreter rounds by truncation: up to one bf16 step).
            tolerance = 1e-5 if call["dtype"] == "torch.float32" else 2e-2
            assert call["err"] < tolerance, (row["type"], row["rows"], row["cols"], call)


def test_the_kernel_table_is_the_engines_block_types():
    """One kernel branch per GGML block type the engine reads, numbered as gguf numbers them."""
    from hybridmoe.backend.engine import stored_linear
    from hybridmoe.backend.formats import quant

    assert stored_linear.KERNEL_TYPES == quant.GGUF_SUPPORTED_TYPES - set(quant.GGUF_FLOAT_TYPES)
    if importlib.util.find_spec("triton") is not None:
        from hybridmoe.backend.engine import stored_linear_kernels as kernels

        numbered = {name: getattr(kernels, name) for name in dir(kernels) if name in Q.__members__}
        assert numbered == {t.name: int(t) for t in stored_linear.KERNEL_TYPES}


def test_a_device_the_kernels_fail_on_dequantizes_with_pytorch(monkeypatch, caplog):
    """Where Triton cannot run the kernels (standing in here: CPU tensors, which compiled
    kernels cannot read), a call computes the same with the torch decoders, the device is
    remembered (no second try) and the reason is logged once."""
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        pytest.skip("needs Triton and CPU tensors compiled kernels cannot read")
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter reads CPU tensors")
    from hybridmoe.backend.engine import stored_linear
    from hybridmoe.backend.formats import quant

    monkeypatch.setattr(stored_linear, "_failed", {})
    stored = quant.from_gguf(random_blocks(Q.Q4_K, 6, 512), Q.Q4_K, (6, 512))
    lin = stored_linear.StoredLinear(stored)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.linear(x, stored.dequantize())
    with caplog.at_level("WARNING", logger=stored_linear.__name__):
        assert torch.equal(lin(x), want)
        assert torch.equal(lin(x), want)
    assert list(stored_linear._failed) == [torch.device("cpu")]
    assert len([r for r in caplog.records if "stored-form kernels unavailable" in r.getMessage()]) == 1


SERVE = textwrap.dedent("""
    import json, os, sys
    DEVICE = sys.argv[2]
    if DEVICE == "cpu":
        os.environ["HYBRIDMOE_NATIVE"] = "0"  # the CPU stands in for the card: no native projections
    import torch
    from hybridmoe.backend.engine import stored_linear
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model
    from tests.engine.greedy_steps import max_relative, prompt_then_greedy

    def run(path, as_stored):
        stored_linear.serves = lambda device: as_stored  # on the CPU stand-in too
        model = build_model(inspect_model(path).spec, open_weights(path), device=DEVICE, max_context=64)
        held = sorted({m.qtype.name for m in model.modules() if isinstance(m, stored_linear.StoredLinear)})
        held += ["embedding"] if model.embed_stored is not None else []
        held += ["tied head"] if model.lm_head is model.embed_stored else []
        prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3)).to(DEVICE)
        # the prompt: dequantized tiles into matmuls; each token after it: the GEMV kernel
        return held, *prompt_then_greedy(model, prompt)

    out = []
    for case in json.loads(sys.argv[1]):
        held, tokens, logits = run(case["path"], True)
        _, want, want_logits = run(case["path"], False)
        err = max_relative(logits, want_logits)
        out.append({**case, "held": held, "tokens": tokens, "want": want, "err": err})
    print(json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_a_quantized_file_served_as_stored_gives_the_dequantized_models_tokens(converted, tmp_path):  # noqa: F811
    """Tiny models with their always-read projections and embedding as stored on the (stand-in)
    card give the tokens of the same file widened at load: MLA's projections (DeepSeek), permuted
    Q/K rows (Mixtral), biases (GPT-OSS), a head tied to the embedding (Qwen2-MoE), K-quant and
    legacy blocks."""
    from hybridmoe.backend.convert import to_gguf
    from tests.convert.conftest import build_checkpoint
    from tests.engine.test_held_weights import K_QUANT_SIZES, MLA_K_QUANT

    cases = [{"path": str(converted(family, fmt)), "family": family, "format": fmt}
             for family, fmt in (("mixtral", "q4_0"), ("gpt_oss", "q8_0"))]
    for family, fmt, sizes in (("deepseek_v3", "q4_k_m", MLA_K_QUANT), ("qwen3_moe", "q4_k_m", K_QUANT_SIZES["q4_k_m"]),
                               ("qwen2_moe", "q8_0", {"tie_word_embeddings": True})):
        hf = build_checkpoint(tmp_path / family, family, overrides=sizes).path
        cases.append({"path": str(to_gguf(hf, tmp_path / f"{family}-{fmt}.gguf", fmt)), "family": family,
                      "format": fmt})
    results = run_kernel_check(SERVE, cases, tmp_path, timeout=900)
    for row in results:
        assert "embedding" in row["held"], row  # the projections and the embedding are held as stored
        assert row["tokens"] == row["want"], row
        # bf16 activations, sums in another order, and the interpreter's truncating bf16 rounding,
        # through every layer: the logits agree to a few bf16 steps.
        assert row["err"] < 4e-2, row
    held = {row["family"]: set(row["held"]) for row in results}
    assert {"Q4_K", "Q6_K"} <= held["deepseek_v3"] and {"Q4_K", "Q6_K"} <= held["qwen3_moe"], held
    assert "Q4_0" in held["mixtral"] and "Q8_0" in held["gpt_oss"], held
    assert "tied head" in held["qwen2_moe"], held  # the head reads the embedding's blocks
