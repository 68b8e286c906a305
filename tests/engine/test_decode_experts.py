"""The decode kernels (``decode_experts``) compute what the reference loop over the experts
computes, for every form a group holds (dense, int8, each 4-bit table, a 4-bit gate/up with
an int8 down) and both activations, with pairs the group does not hold and ids -1 among them.

On CUDA the engine takes them for calls of up to 8 tokens, and there this test runs them
compiled; elsewhere Triton's interpreter runs them on CPU tensors, in a process of its own (the
interpreter is chosen when Triton is imported).
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.convert.conftest import checkpoints, converted  # noqa: F401 - fixtures: tiny checkpoints and GGUFs
from tests.engine.conftest import run_kernel_check

CHECK = textwrap.dedent("""
    import json, sys
    DEVICE = sys.argv[2]
    import torch
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as Q
    from hybridmoe.backend.engine import decode_experts
    from hybridmoe.backend.engine.experts import experts_forward
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.engine.moe import MoE
    from hybridmoe.backend.formats import int4_weights, quant
    from hybridmoe.backend.formats.int8_weights import quantize_int8
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model
    from tests.quant.test_int4_resident import random_blocks

    out = []
    g = torch.Generator().manual_seed(0)

    def routing(tokens, n_experts, k, held):
        ids = torch.randint(0, n_experts, (tokens, k), generator=g)
        ids[:, 0] = held  # every token reaches the group at least once
        ids[0, -1] = -1  # "no expert": skipped, as by the reference
        return ids, torch.rand(ids.shape, generator=g)

    def loop(x, ids, weights, experts):  # the reference: the loop over the experts, kernels off
        kernels, decode_experts.applies = decode_experts.applies, lambda x, act: False
        try:
            return experts_forward(x, ids, weights, experts)
        finally:
            decode_experts.applies = kernels

    def row(label, got, want):
        got, want = got.cpu(), want.cpu()
        err = float((got - want).abs().max() / want.abs().max())
        out.append({**label, "dtype_out": str(got.dtype), "shape": list(got.shape), "want_shape": list(want.shape),
                    "err": err})

    # 1. Groups of real models against the reference loop over their experts.
    for case in json.loads(sys.argv[1]):
        spec = inspect_model(case["path"]).spec
        placement = {layer: [0, 2, 3, 5] for layer in spec.moe_layers}
        model = build_model(spec, open_weights(case["path"]), device=DEVICE, dtype=getattr(torch, case["dtype"]),
                            max_context=16, placement=placement, resident_form=case["form"])
        main = next(m for m in model.modules() if isinstance(m, MoE)).main
        act = main.act
        for tokens in (1, 3, 8):
            x = (torch.randn(tokens, spec.hidden_size, generator=g) * 2).to(DEVICE, model.dtype)
            ids, weights = routing(tokens, spec.n_routed_experts, spec.experts_per_token, held=2)
            ids, weights = ids.to(DEVICE), weights.to(DEVICE)
            got = decode_experts.forward(x, ids, weights, main.slot_of, main.stacks["gate_up"], main.stacks["down"],
                                         act.kind, interleaved=act.interleaved, alpha=act.alpha, limit=act.limit)
            forms = [main.stacks[r].form + (f"/{main.stacks[r].table_name}" if main.stacks[r].table_name else "")
                     for r in ("gate_up", "down")]
            row({**case, "tokens": tokens, "forms": forms}, got, loop(x, ids, weights, main))

    # 2. 4-bit formats a tiny converted model does not have (Q4_K's mins, looked-up tables)
    # and a 4-bit gate/up beside an int8 down, against their dequantized matrices.
    def int4(qtype, rows, cols, seed):
        return int4_weights.from_quant(quant.from_gguf(random_blocks(qtype, rows, cols, seed), qtype, (rows, cols)))

    def stack(parts):
        def on(tensors):
            return torch.stack(tensors).to(DEVICE)

        if isinstance(parts[0], int4_weights.Int4Weight):
            w = parts[0]
            return decode_experts.Stack(
                "int4", on([p.codes for p in parts]), on([p.scale for p in parts]),
                None if w.min is None else on([p.min for p in parts]), w.table_tensor().to(DEVICE), w.table, w.group)
        return decode_experts.Stack("int8", on([p.q for p in parts]), on([p.scale for p in parts]))

    hidden, inter, n_experts, held = 256, 64, 6, (1, 4)
    slot_of = torch.full((n_experts,), -1, dtype=torch.int32)
    slot_of[list(held)] = torch.arange(len(held), dtype=torch.int32)
    for name, gate_up_type, down_type in (("q4_k + int8", Q.Q4_K, None), ("iq4_nl + mxfp4", Q.IQ4_NL, Q.MXFP4)):
        gate_up = [int4(gate_up_type, 2 * inter, hidden, seed=e) for e in range(len(held))]
        down = [int4(down_type, hidden, inter, seed=10 + e) if down_type else
                quantize_int8(torch.randn(hidden, inter, generator=g) * 0.05, torch.float32) for e in range(len(held))]
        gate_up_stack, down_stack = stack(gate_up), stack(down)
        forms = [gate_up_stack.form + "/" + gate_up[0].table,
                 down_stack.form + (f"/{down[0].table}" if down_type else "")]
        for tokens in (1, 5):
            x = torch.randn(tokens, hidden, generator=g)
            ids, weights = routing(tokens, n_experts, 4, held=held[1])
            want = torch.zeros(tokens, hidden)
            for t in range(tokens):
                for j, e in enumerate(ids[t].tolist()):
                    if e in held:
                        gu = F.linear(x[t], gate_up[held.index(e)].dequantize())
                        h = F.silu(gu[:inter]) * gu[inter:]
                        want[t] += weights[t, j] * F.linear(h, down[held.index(e)].dequantize())
            got = decode_experts.forward(x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), slot_of.to(DEVICE),
                                         gate_up_stack, down_stack, "silu")
            row({"path": name, "dtype": "float32", "tokens": tokens, "forms": forms}, got, want)
    print(json.dumps(out))
""")



@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_decode_kernels_compute_what_the_expert_loop_computes(checkpoints, converted, tmp_path):  # noqa: F811
    cases = [
        {"path": str(checkpoints("qwen3_moe").path), "form": "dense", "dtype": "float32"},
        {"path": str(checkpoints("qwen3_moe").path), "form": "dense", "dtype": "bfloat16"},
        {"path": str(checkpoints("qwen3_moe").path), "form": "int8", "dtype": "float32"},
        {"path": str(checkpoints("gpt_oss").path), "form": "dense", "dtype": "float32"},
        {"path": str(converted("qwen3_moe", "q4_0")), "form": "int4", "dtype": "float32"},
        {"path": str(converted("gpt_oss", "q4_0")), "form": "int4", "dtype": "float32"},
    ]
    results = run_kernel_check(CHECK, cases, tmp_path, timeout=600)
    seen = {tuple(row["forms"]) for row in results}
    # Every form the kernels read: dense, int8, 4-bit with a computed table (Q4_0), with mins
    # (Q4_K) beside an int8 down (as Q4_K_M's Q6_K downs are held), with looked-up tables.
    assert {("dense", "dense"), ("int8", "int8"), ("int4/int", "int4/int"), ("int4/uint", "int8"),
            ("int4/iq4", "int4/e2m1x2")} <= seen, seen
    for row in results:
        assert row["dtype_out"] == "torch.float32" and row["shape"] == row["want_shape"]
        # float32: the same products summed in another order; bfloat16: the kernels round where
        # torch rounds, but Triton's interpreter rounds by truncation (up to one bf16 step).
        tolerance = 2e-5 if row["dtype"] == "float32" else 2e-2
        assert row["err"] < tolerance, row


def test_a_device_the_kernels_fail_on_takes_the_loop(checkpoints, monkeypatch, caplog):  # noqa: F811
    """Where the kernels cannot run (a card Triton cannot build for; standing in here: CPU
    tensors, which compiled Triton kernels cannot read), the call computes what the loop
    computes, the device is remembered (no second try) and the reason is logged once."""
    import torch

    from hybridmoe.backend.engine import decode_experts
    from hybridmoe.backend.engine.experts import experts_forward
    from hybridmoe.backend.engine.moe import MoE
    from tests.engine.conftest import engine

    model = engine(checkpoints("qwen3_moe").path, placement={1: [0, 2, 3, 5]}, device="cpu")
    main = next(m for m in model.modules() if isinstance(m, MoE) and m.layer == 1).main
    x = torch.randn(2, main.stacks["gate_up"].w.shape[2], generator=torch.Generator().manual_seed(0)).to(model.dtype)
    ids, weights = torch.tensor([[0, 2], [3, 7]]), torch.rand(2, 2)
    want = experts_forward(x, ids, weights, main)  # the loop: applies() is false on the CPU

    monkeypatch.setattr(decode_experts, "_failed", {})
    monkeypatch.setattr(decode_experts, "applies", lambda x, act: x.device not in decode_experts._failed)
    tries, launch = [], decode_experts.forward
    monkeypatch.setattr(decode_experts, "forward", lambda *args, **kw: tries.append(1) or launch(*args, **kw))
    with caplog.at_level("WARNING", logger=decode_experts.__name__):
        assert torch.equal(experts_forward(x, ids, weights, main), want)
        assert torch.equal(experts_forward(x, ids, weights, main), want)
    assert list(decode_experts._failed) == [torch.device("cpu")] and len(tries) == 1
    assert len([r for r in caplog.records if "GPU decode kernels unavailable" in r.getMessage()]) == 1
