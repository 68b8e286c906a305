"""Routed experts held on the main device as a GGUF stores them (``stored_experts``): the decode
kernels compute what the dequantized experts compute for every block type, at shapes their
blocks do not divide; a hybrid model holding its GPU experts so gives the tokens of the same
experts dequantized; and the bytes they take are the plan's.

On CUDA the kernels run compiled; elsewhere Triton's interpreter runs them on CPU tensors, in a
process of its own (the interpreter is chosen when Triton is imported), the CPU standing in for
the card.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch

from tests.convert.conftest import checkpoints, converted, needs_llama_cpp  # noqa: F401 - fixtures
from tests.engine.conftest import run_kernel_check

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

KERNELS = textwrap.dedent("""
    import json, sys
    DEVICE = sys.argv[2]
    import torch
    import torch.nn.functional as F
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q
    from hybridmoe.backend.engine import stored_experts
    from hybridmoe.backend.formats import quant
    from tests.engine.test_stored_linear import random_blocks

    g = torch.Generator().manual_seed(0)
    out = []
    for case in json.loads(sys.argv[1]):
        hidden, inter, held, n_experts = case["hidden"], case["inter"], case["held"], 7
        dtype = getattr(torch, case["dtype"])
        shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        stacks, dense = {}, {}
        for n, role in enumerate(("gate", "up", "down")):
            qtype = Q[case[role]]
            rows, cols = shapes[role]
            blocks = [torch.from_numpy(random_blocks(qtype, rows, cols, seed=10 * e + n)) for e in range(len(held))]
            bias = torch.randn(len(held), rows, generator=g).to(dtype) if case["bias"] else None
            stacks[role] = stored_experts.StoredStack(qtype, torch.stack(blocks).to(DEVICE), cols,
                                                      None if bias is None else bias.to(DEVICE))
            dense[role] = [quant.from_gguf(b, qtype, (rows, cols)).dequantize() for b in blocks]
            dense[role + "_bias"] = bias
        slot_of = torch.full((n_experts,), -1, dtype=torch.int32)
        slot_of[held] = torch.arange(len(held), dtype=torch.int32)
        for tokens in case["tokens"]:
            x = torch.randn(tokens, hidden, generator=g).to(dtype)
            ids = torch.randint(0, n_experts, (tokens, 2), generator=g)
            ids[:, 0] = held[-1]  # every token reaches the group at least once
            ids[0, 1] = -1  # "no expert": skipped
            weights = torch.rand(ids.shape, generator=g)
            got = stored_experts.forward(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), slot_of.to(DEVICE),
                                         stacks["gate"], stacks["up"], stacks["down"], case["act"]).cpu()
            # The reference: each held expert's dequantized matrices, rounded where expert_mlp rounds.
            want = torch.zeros(tokens, hidden)
            for t in range(tokens):
                for j, e in enumerate(ids[t].tolist()):
                    if e not in held:
                        continue
                    s = held.index(e)

                    def lin(v, role):
                        y = F.linear(v.float(), dense[role][s]).to(dtype)
                        b = dense[role + "_bias"]
                        return y if b is None else y + b[s]

                    gate, up = lin(x[t], "gate"), lin(x[t], "up")
                    if case["act"] == "clamped_swiglu":
                        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                        h = (up + 1) * (gate * torch.sigmoid(gate * 1.702))
                    else:
                        h = F.silu(gate) * up
                    want[t] += weights[t, j] * lin(h, "down").float()
            err = float((got - want).abs().max() / want.abs().max())
            out.append({**case, "tokens": tokens, "shape": list(got.shape), "out": str(got.dtype), "err": err,
                        "finite": bool(want.isfinite().all())})
    print(json.dumps(out))
""")


@needs_triton
def test_the_decode_kernels_compute_every_block_type_as_its_dequantized_experts(tmp_path):
    from gguf import GGML_QUANT_SIZES

    from hybridmoe.backend.engine.stored_linear import KERNEL_TYPES

    types = sorted(KERNEL_TYPES, key=int)
    cases = []
    for n, gate in enumerate(types):
        # Each type as gate, as up (the next one) and as down (seven on): gate and up may differ,
        # as a down of more bits does (Q4_K_M's Q6_K). Widths are whole blocks of both types that
        # read them, and odd against the kernels' rows and columns: 160 = 5 x 32 columns, 96 rows.
        up, down = types[(n + 1) % len(types)], types[(n + 7) % len(types)]
        wide = max(GGML_QUANT_SIZES[t][0] for t in (gate, up)) == 256
        cases.append({"gate": gate.name, "up": up.name, "down": down.name, "hidden": 768 if wide else 160,
                      "inter": 256 if GGML_QUANT_SIZES[down][0] == 256 else 96, "held": [1, 4, 6],
                      "act": "silu", "bias": False, "dtype": "float32", "tokens": [1, 3] if n % 4 == 0 else [2]})
    # GPT-OSS' experts: biases, the clamped SwiGLU; and the compute dtype bf16.
    cases.append({"gate": "MXFP4", "up": "MXFP4", "down": "MXFP4", "hidden": 96, "inter": 64, "held": [0, 5],
                  "act": "clamped_swiglu", "bias": True, "dtype": "float32", "tokens": [3]})
    cases.append({"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K", "hidden": 256, "inter": 256, "held": [2, 3],
                  "act": "silu", "bias": False, "dtype": "bfloat16", "tokens": [2]})
    results = run_kernel_check(KERNELS, cases, tmp_path, timeout=900)
    assert {r["gate"] for r in results} == {r["down"] for r in results} == {t.name for t in KERNEL_TYPES}
    for row in results:
        assert row["finite"] and row["out"] == "torch.float32" and row["shape"] == [row["tokens"], row["hidden"]], row
        # float32: the same products summed in another order; bf16: rounded where torch rounds,
        # by the interpreter's truncation (up to one bf16 step).
        assert row["err"] < (2e-5 if row["dtype"] == "float32" else 2e-2), row


HYBRID = textwrap.dedent("""
    import json, os, sys
    DEVICE = sys.argv[2]
    if DEVICE == "cpu":
        os.environ["HYBRIDMOE_NATIVE"] = "0"  # the CPU stands in for the card: its experts by PyTorch
    import torch
    from hybridmoe.backend.engine import decode_experts
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.engine.moe import MoE
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model
    from tests.engine.greedy_steps import max_relative, prompt_then_greedy

    # A decode step's calls take the kernels on the stand-in too; prompts take the loop, whose
    # stored matrices are dequantized in tiles into matmuls.
    decode_experts.applies = lambda x, act: x.shape[0] <= decode_experts.MAX_TOKENS

    def run(path, form):
        spec = inspect_model(path).spec
        placement = {layer: [1, 2, 5] for layer in spec.moe_layers}  # the rest on the host
        model = build_model(spec, open_weights(path), device=DEVICE, dtype=torch.float32, max_context=64,
                            placement=placement, resident_form=form)
        held = sorted({s.qtype.name for m in model.modules() if isinstance(m, MoE) for s in m.main.stacks.values()}
                      if form == "stored" else [])
        prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3)).to(DEVICE)
        return held, *prompt_then_greedy(model, prompt)

    out = []
    for case in json.loads(sys.argv[1]):
        held, tokens, logits = run(case["path"], "stored")
        _, want, want_logits = run(case["path"], "dense")  # the same experts dequantized at load
        err = max_relative(logits, want_logits)
        out.append({**case, "held": held, "tokens": tokens, "want": want, "err": err})
    print(json.dumps(out))
""")


def _q4_k_m(tmp_path, family: str):
    """A tiny checkpoint of `family` at sizes llama.cpp's Q4_K_M mix quantizes in K-quants, as a GGUF."""
    from hybridmoe.backend.convert import to_gguf
    from tests.convert.conftest import build_checkpoint
    from tests.engine.test_held_weights import K_QUANT_SIZES, MLA_K_QUANT

    sizes = MLA_K_QUANT if family.startswith("deepseek") else K_QUANT_SIZES["q4_k_m"]
    hf = build_checkpoint(tmp_path / family, family, overrides=sizes).path
    return to_gguf(hf, tmp_path / f"{family}-q4_k_m.gguf", "q4_k_m")


@needs_triton
@needs_llama_cpp
def test_a_hybrid_model_with_stored_gpu_experts_gives_the_dequantized_models_tokens(converted, tmp_path):  # noqa: F811
    """DeepSeek (Q4_K gate/up, Q6_K downs in some layers) and Qwen3 in Q4_K_M, GPT-OSS in Q4_0
    (biases, clamped SwiGLU): three experts a layer on the stand-in card as stored, the others on
    the host; the tokens of the same model with those experts dequantized at load."""
    cases = [{"path": str(_q4_k_m(tmp_path, family)), "family": family} for family in ("deepseek_v3", "qwen3_moe")]
    cases.append({"path": str(converted("gpt_oss", "q4_0")), "family": "gpt_oss"})
    results = run_kernel_check(HYBRID, cases, tmp_path, timeout=900)
    for row in results:
        assert row["tokens"] == row["want"], row
        assert row["err"] < 1e-4, row  # float32 throughout: the sums' order only
    held = {row["family"]: set(row["held"]) for row in results}
    assert held["deepseek_v3"] == held["qwen3_moe"] == {"Q4_K", "Q6_K"} and held["gpt_oss"] == {"Q4_0"}, held


@needs_llama_cpp
@pytest.mark.parametrize("family, fmt", [("deepseek_v3", "q4_k_m"), ("qwen3_moe", "q4_k_m"), ("gpt_oss", "q8_0"),
                                         ("gpt_oss", "q4_0"), ("mixtral", "q4_0")])
def test_the_plans_bytes_per_stored_expert_are_the_engines_buffers(family, fmt, converted, tmp_path):  # noqa: F811
    """Every MoE layer's stacks take what the plan counts per GPU expert held as stored (each
    layer its own: Q4_K_M's Q6_K downs), and what the plan puts on the card for them."""
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.engine.moe import MoE
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make
    from hybridmoe.backend.plan.budget import stored_expert_bytes
    from tests.plan.test_sizing import epyc_host, h200

    path = _q4_k_m(tmp_path, family) if fmt == "q4_k_m" else converted(family, fmt)
    model = inspect_model(path)
    spec = model.spec
    per_layer = stored_expert_bytes(spec, model.inventory)
    placement = {layer: [0, 3, 7] for layer in spec.moe_layers}
    engine = build_model(spec, open_weights(path), max_context=64, placement=placement, resident_form="stored")
    held = {m.layer: m.main.nbytes for m in engine.modules() if isinstance(m, MoE)}
    assert held == {layer: 3 * per_layer[layer] for layer in spec.moe_layers}, (held, per_layer)
    plan = make(spec, model.inventory, epyc_host(gpus=[h200()]), Workload(context=64, gpu_expert_form="stored"))
    assert plan.gpu_expert_format == "stored" and plan.resident_form == "stored"
    assert plan.gpu_bytes_per_expert == per_layer
    if fmt == "q4_k_m":
        assert len(set(per_layer.values())) == 2  # Q6_K downs in some layers, Q4_K in the others


def test_experts_the_gpu_kernels_cannot_read_are_not_held_as_stored(checkpoints):  # noqa: F811
    """A bf16 checkpoint's experts have no blocks to hold: said, with what to use instead."""
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model

    path = checkpoints("qwen3_moe").path
    spec = inspect_model(path).spec
    with pytest.raises(ValueError, match="int8 or dense"):
        build_model(spec, open_weights(path), max_context=16, placement={spec.moe_layers[0]: [1]},
                    resident_form="stored", dtype=torch.float32)
