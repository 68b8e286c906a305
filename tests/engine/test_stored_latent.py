"""MLA's kv_b held on a GPU as the GGUF stores it (``stored_latent``): the per-head products of
the absorbed form (W_UK folded into the queries, W_UV after attention) compute what PyTorch's
matmuls over the dequantized maps compute, for kv_b whole (rows of kv_lora) and split (attn_k_b's
rows of nope, attn_v_b's of kv_lora), in the types real DeepSeek/Kimi GGUFs use for it, at odd
head counts and widths the kernels' blocks do not divide; and a tiny DeepSeek GGUF gives the
same tokens with kv_b so held as with kv_b dequantized at load, in the paged decode step and in
the reference attention.

On CUDA these run compiled; elsewhere Triton's interpreter runs them on CPU tensors, in a process
of its own (the interpreter is chosen when Triton is imported).
"""

from __future__ import annotations

import importlib.util
import os
import textwrap

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.convert.conftest import needs_llama_cpp
from tests.engine.conftest import run_kernel_check
from tests.engine.test_stored_linear import random_blocks

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

CHECK = textwrap.dedent("""
    import json, sys
    DEVICE = sys.argv[2]
    import torch
    from gguf import GGMLQuantizationType as Q
    from hybridmoe.backend.engine import stored_latent
    from hybridmoe.backend.engine.stored_linear import StoredLinear
    from hybridmoe.backend.formats import quant
    from hybridmoe.backend.formats.gguf_weights import join_kv_b
    from tests.engine.test_stored_linear import random_blocks

    def held(qtype, rows, cols, seed):
        if qtype == "F32":  # a float part: held in the compute dtype
            return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        t = getattr(Q, qtype)
        return StoredLinear(quant.from_gguf(random_blocks(t, rows, cols, seed=seed), t, (rows, cols)).to(DEVICE))

    def widened(m):
        return m.float() if isinstance(m, torch.Tensor) else m.stored.dequantize()

    g = torch.Generator().manual_seed(0)
    out = []
    for case in json.loads(sys.argv[1]):
        h, nope, v, c = case["heads"], case["nope"], case["v"], case["kv_lora"]
        if case["form"] == "whole":
            whole = held(case["type"], h * (nope + v), c, seed=h + nope)
            maps = stored_latent.StoredLatent(h, nope, v, c, whole=whole)
            ref = widened(whole)
        else:
            k_b, v_b = held(case["k_b"], h * c, nope, seed=h), held(case["v_b"], h * v, c, seed=h + 1)
            maps = stored_latent.StoredLatent(h, nope, v, c, k_b=k_b, v_b=v_b)
            ref = join_kv_b(widened(k_b), widened(v_b), h)
        w = ref.view(h, nope + v, c).double()
        row = {**case, "dense_exact": bool(torch.equal(maps.dense(torch.float32), ref)),
               "finite": bool(ref.isfinite().all()), "calls": []}
        for tokens in case["tokens"]:
            for dtype in (getattr(torch, name) for name in case["dtypes"]):
                # q_nope as the decode step hands it over: a view of q [n, H, nope + rope] per head
                q = torch.randn(tokens, h, nope + 8, generator=g).to(DEVICE, dtype)
                q_nope = q[:, :, :nope].transpose(0, 1)
                attended = torch.randn(h, tokens, c, generator=g).to(DEVICE, dtype)
                got_q, got_v = maps.query(q_nope), maps.values(attended)
                want_q = torch.matmul(q_nope.double(), w[:, :nope])
                want_v = torch.matmul(attended.double(), w[:, nope:].transpose(1, 2))
                row["calls"].append({
                    "tokens": tokens, "dtype": str(dtype), "out": [str(got_q.dtype), str(got_v.dtype)],
                    "shapes": [list(got_q.shape), list(got_v.shape)],
                    "err": [float((got_q.double() - want_q).abs().max() / want_q.abs().max()),
                            float((got_v.double() - want_v).abs().max() / want_v.abs().max())]})
        out.append(row)
    print(json.dumps(out))
""")

# kv_b's types in the GGUFs people run DeepSeek-V3/R1 and Kimi K2 from: whole kv_b (rows of
# kv_lora = 512) in any block type; split, attn_k_b's rows of nope = 128 take only 32-weight
# blocks (a K-quant file writes them in Q5_0, Q8_0 or Q4_0; IQ4_NL for IQ4_XS), attn_v_b's rows
# of kv_lora any type; a float k_b beside a quantized v_b.
WHOLE = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "IQ4_NL", "IQ4_XS"]
SPLIT = [("Q8_0", "Q8_0"), ("Q5_0", "Q4_K"), ("Q4_0", "Q6_K"), ("IQ4_NL", "IQ4_XS"), ("Q5_0", "Q5_K"),
         ("F32", "Q4_0")]


@needs_triton
def test_the_per_head_products_over_stored_kv_b_are_the_dequantized_maps_products(tmp_path):
    from hybridmoe.backend.engine.stored_latent import GEMV_CALLS
    from hybridmoe.backend.engine.stored_linear import GEMV_TOKENS

    # Tokens: one launch (1, 3), two (GEMV_TOKENS + 1), past the launches' limit (the layer
    # dequantized), in float32 and bfloat16, for the first two cases of each form; the other
    # types (their blocks' dequantizing) at one launch of 3 tokens in float32: the interpreter
    # runs a program at a time, and the whole grid per type took most of this test's minutes.
    tokens = [1, 3, GEMV_TOKENS + 1, GEMV_TOKENS * GEMV_CALLS + 1]

    def calls(i: int) -> dict:
        return {"tokens": tokens, "dtypes": ["float32", "bfloat16"]} if i < 2 else {"tokens": [3], "dtypes": ["float32"]}

    # Odd head counts; nope and v no multiple of the kernels' row blocks (whole: the head's rows
    # are nope + v in one matrix).
    cases = [{"form": "whole", "type": t, "heads": 3 if i % 2 else 5, "nope": 40, "v": 24, "kv_lora": 512, **calls(i)}
             for i, t in enumerate(WHOLE)]
    cases += [{"form": "split", "k_b": k, "v_b": v, "heads": 5 if i % 2 else 3, "nope": 128, "v": 24,
               "kv_lora": 512, **calls(i)} for i, (k, v) in enumerate(SPLIT)]
    results = run_kernel_check(CHECK, cases, tmp_path, timeout=900)
    assert len(results) == len(cases)
    for row in results:
        assert row["finite"] and row["dense_exact"], row  # the expanded form's kv_b: the dequantizers' values
        for call in row["calls"]:
            n, h = call["tokens"], row["heads"]
            assert call["out"] == [call["dtype"]] * 2, (row, call)
            assert call["shapes"] == [[h, n, row["kv_lora"]], [h, n, row["v"]]], (row, call)
            # float32: the same products summed in another order; bfloat16 inputs and results (the
            # interpreter rounds by truncation: up to one bf16 step).
            tolerance = 1e-5 if call["dtype"] == "torch.float32" else 2e-2
            assert max(call["err"]) < tolerance, (row, call)


def test_a_device_the_kernels_fail_on_dequantizes_with_pytorch(monkeypatch, caplog):
    """Where Triton cannot run the kernels (standing in here: CPU tensors, which compiled kernels
    cannot read), the products are computed through the dequantized maps, the device is
    remembered with stored_linear's (no second try) and the reason is logged once."""
    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        pytest.skip("needs Triton and CPU tensors compiled kernels cannot read")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter reads CPU tensors")
    from hybridmoe.backend.engine import stored_latent, stored_linear
    from hybridmoe.backend.formats import quant

    monkeypatch.setattr(stored_linear, "_failed", {})
    h, nope, v, c = 3, 32, 32, 256
    stored = quant.from_gguf(random_blocks(Q.Q4_K, h * (nope + v), c), Q.Q4_K, (h * (nope + v), c))
    maps = stored_latent.StoredLatent(h, nope, v, c, whole=stored_linear.StoredLinear(stored))
    w = stored.dequantize().view(h, nope + v, c)
    g = torch.Generator().manual_seed(1)
    q_nope, attended = torch.randn(h, 2, nope, generator=g), torch.randn(h, 2, c, generator=g)
    with caplog.at_level("WARNING", logger=stored_linear.__name__):
        assert torch.allclose(maps.query(q_nope), torch.matmul(q_nope, w[:, :nope]), rtol=1e-6, atol=1e-6)
        assert torch.allclose(maps.values(attended), torch.matmul(attended, w[:, nope:].transpose(1, 2)),
                              rtol=1e-6, atol=1e-6)
    assert list(stored_linear._failed) == [torch.device("cpu")]
    assert len([r for r in caplog.records if "stored-form kernels unavailable" in r.getMessage()]) == 1


SERVE = textwrap.dedent("""
    import json, os, sys
    DEVICE = sys.argv[2]
    if DEVICE == "cpu":
        os.environ["HYBRIDMOE_NATIVE"] = "0"  # the CPU stands in for the card: no native projections
    import torch
    from hybridmoe.backend.engine import build_layers, paged_decode, stored_latent, stored_latent_kernels, stored_linear
    from hybridmoe.backend.engine.mla import MLAttention
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model
    from tests.engine.greedy_steps import max_relative, prompt_then_greedy

    stored_linear.serves = lambda device: True  # the projections as stored on the CPU stand-in too
    held_latent = build_layers.stored_latent

    class Counted:  # a kernel's launches
        def __init__(self, kernel):
            self.kernel, self.launches = kernel, 0

        def __getitem__(self, grid):
            self.launches += 1
            return self.kernel[grid]

    launches = [Counted(stored_latent_kernels.head_gemv_kernel), Counted(stored_latent_kernels.head_gemv_t_kernel)]
    stored_latent_kernels.head_gemv_kernel, stored_latent_kernels.head_gemv_t_kernel = launches
    paged = {"on": False}
    # The paged decode step on the stand-in: every condition of its kernels' but the device's.
    paged_decode._decode_rows = lambda x, segments: paged["on"] and all(
        s.n == 1 and s.start < paged_decode.MAX_KEYS for s in segments)

    def run(path, kv_b_stored, paged_step):
        build_layers.stored_latent = held_latent if kv_b_stored else (lambda *args: None)
        paged["on"] = paged_step
        model = build_model(inspect_model(path).spec, open_weights(path), device=DEVICE, max_context=64)
        maps = [m.stored_kv_b for m in model.modules() if isinstance(m, MLAttention)]
        forms = sorted({repr(m) for m in maps})
        widened = sum(m.kv_b_weight is not None for m in model.modules() if isinstance(m, MLAttention))
        prompt = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3)).to(DEVICE)
        before = sum(k.launches for k in launches)
        # the prompt: the expanded form (kv_b dequantized for the call); each token after it: absorbed
        tokens, logits = prompt_then_greedy(model, prompt)
        return forms, widened, sum(k.launches for k in launches) - before, tokens, logits

    out = []
    for case in json.loads(sys.argv[1]):
        for paged_step in (True, False) if case["reference_too"] else (True,):
            forms, widened, launched, tokens, logits = run(case["path"], True, paged_step)
            _, widened_ref, _, want, want_logits = run(case["path"], False, paged_step)
            out.append({**case, "paged": paged_step, "forms": forms, "widened": widened, "widened_ref": widened_ref,
                        "launches": launched, "tokens": tokens, "want": want,
                        "err": max_relative(logits, want_logits)})
    print(json.dumps(out))
""")


@needs_triton
@needs_llama_cpp
def test_a_deepseek_gguf_with_kv_b_as_stored_gives_the_tokens_of_kv_b_dequantized(tmp_path, monkeypatch):
    """Tiny DeepSeek GGUFs on the (stand-in) card, kv_b held as stored against kv_b dequantized at
    load (the rest as stored in both): split (Q4_K_M: attn_k_b Q5_0, attn_v_b Q4_K; Q8_0) and
    whole (an older conversion's attn_kv_b, which Q4_K_M writes in Q8_0: three heads, and five),
    through the paged decode step and through the reference attention."""
    from hybridmoe.backend.convert import to_gguf
    from hybridmoe.backend.models.families import deepseek
    from tests.convert.conftest import build_checkpoint
    from tests.engine.test_held_weights import MLA_K_QUANT

    cases = []
    for family, fmt, split, sizes in (("deepseek_v3", "q4_k_m", True, MLA_K_QUANT),
                                      ("deepseek_v3", "q8_0", True, MLA_K_QUANT),
                                      ("deepseek_v3", "q4_k_m", False, {**MLA_K_QUANT, "num_attention_heads": 3}),
                                      ("deepseek_v3", "q8_0", False, {"num_attention_heads": 5})):
        name = f"{family}-{fmt}-{'split' if split else 'whole'}"
        hf = build_checkpoint(tmp_path / name, family, overrides=sizes).path
        with monkeypatch.context() as m:
            m.setattr(deepseek, "GGUF_SPLITS_KV_B", split)
            path = to_gguf(hf, tmp_path / f"{name}.gguf", fmt)
        # (the reference attention too for two: the second's prompt takes the absorbed form, in two launches)
        cases.append({"path": str(path), "name": name, "split": split,
                      "reference_too": name in ("deepseek_v3-q4_k_m-split", "deepseek_v3-q8_0-whole")})
    results = run_kernel_check(SERVE, cases, tmp_path, timeout=900)
    assert len(results) == len(cases) + 2
    for row in results:
        assert row["widened"] == 0 and row["widened_ref"] > 0, row  # every layer's kv_b as stored, or widened
        assert all(("k_b" in f) == row["split"] for f in row["forms"]), row
        # each decode step's layers read the stored blocks: two products a layer, whole kv_b's
        # W_UK by the transposed kernel
        assert row["launches"] >= 4 * 2 * 2, row
        assert row["tokens"] == row["want"], row
        # bf16 activations, sums in another order, the interpreter's truncating bf16 rounding
        assert row["err"] < 4e-2, row
    forms = {row["name"]: row["forms"] for row in results}
    assert all("k_b Q5_0, v_b Q4_K" in f for f in forms["deepseek_v3-q4_k_m-split"]), forms
    assert all("k_b Q8_0, v_b Q8_0" in f for f in forms["deepseek_v3-q8_0-split"]), forms
    assert all("heads=3" in f and "whole" in f for f in forms["deepseek_v3-q4_k_m-whole"]), forms
    assert all("heads=5" in f and "whole Q8_0" in f for f in forms["deepseek_v3-q8_0-whole"]), forms
