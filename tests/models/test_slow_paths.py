"""Which routed experts the engine would compute on a slow path on the CPU (PyTorch dequantizing
them on every call), and the plan that counts them: models.slow_paths.cpu_slow_path, from the
tensor inventory and whether the native kernels are in use, and the planner's figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.slow_paths import SLOW_PATH_SLOWDOWN, cpu_slow_path

CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"
DEEPSEEK_V3 = CONFIGS / "deepseek-ai__DeepSeek-V3.json"


def test_experts_in_a_format_the_kernels_do_not_read():
    """DeepSeek-V3 as published: fp8 experts with 128x128 block scales, which the kernels do not
    read; every byte of every MoE layer's experts is on the slow path."""
    inv = inspect_model(DEEPSEEK_V3).inventory
    assert inv.expert_format == "fp8_block"
    slow = cpu_slow_path(inv, kernels_missing=None)
    assert slow.formats == ("fp8_block",)
    assert slow.bytes_by_layer == inv.routed_bytes_by_layer
    assert slow.tensors == inv.routed_formats["fp8_block"].tensors > 0
    assert slow.reason.startswith("the native CPU kernels do not read FP8_BLOCK, so every call dequantizes")
    assert slow.describe().startswith(f"{slow.tensors} routed-expert tensors in FP8_BLOCK (e.g. model.layers.3.mlp.experts.")


def test_formats_the_kernels_read_take_no_slow_path_unless_the_kernels_are_off():
    inv = inspect_model(DEEPSEEK_V3, expert_format="q4_k_m").inventory
    assert cpu_slow_path(inv, kernels_missing=None) is None
    slow = cpu_slow_path(inv, kernels_missing="turned off by HYBRIDMOE_NATIVE=0")
    assert set(slow.formats) == {"q4_k", "q6_k"} and slow.formats[0] == "q4_k"  # the most bytes first
    assert slow.bytes_by_layer == inv.routed_bytes_by_layer
    assert "not in use (turned off by HYBRIDMOE_NATIVE=0)" in slow.reason


def test_a_plan_counts_the_slow_path_in_its_estimate():
    """The cpu-only machine (described: its kernels are assumed built) decoding fp8 experts: a
    token's expert bytes cost SLOW_PATH_SLOWDOWN times a byte read at the bandwidth."""
    from hybridmoe.backend.hardware import preset
    from hybridmoe.backend.plan import Workload, make

    model = inspect_model(DEEPSEEK_V3)
    hw = preset("cpu-only")
    plan = make(model.spec, model.inventory, hw, Workload(context=4096))
    k = model.spec.experts_per_token
    slow_bytes = sum(k * model.inventory.bytes_per_expert(layer) for layer in model.spec.moe_layers)
    bandwidth = plan.host_bandwidth_bytes_per_s
    assert plan.decode_tokens_per_s_upper_bound == pytest.approx(
        bandwidth / (plan.host_bytes_per_token + (SLOW_PATH_SLOWDOWN - 1) * slow_bytes))
    assert plan.decode_bound_by == "PyTorch dequantization of CPU experts on the slow path"
    assert "would be computed on a slow path on the CPU: the native CPU kernels do not read FP8_BLOCK" in plan.engine_slow_path
    assert any(w.startswith(plan.engine_slow_path) and "`--backend auto` runs this model on llama.cpp" in w
               for w in plan.warnings)
    # The same model for llama.cpp: no slow path, and the bandwidth bound alone.
    llama = make(model.spec, model.inventory, hw, Workload(context=4096, backend="llamacpp"))
    assert llama.engine_slow_path is None
    assert llama.decode_bound_by == "host memory bandwidth (CPU experts)"
    assert plan.decode_tokens_per_s_upper_bound < llama.decode_tokens_per_s_upper_bound / 10


def test_plan_on_this_machine_without_kernels_says_so(gguf_dir, monkeypatch, capsys):
    """`hybridmoe plan` for this machine with the kernels turned off: the plan's JSON and text
    name the slow tensors and the reason, and the estimate counts them."""
    from hybridmoe.app.cli import main

    import hybridmoe.backend.hardware as hardware

    # This machine, its bandwidth probe answered at once: the figures compare, the seconds go.
    monkeypatch.setattr(hardware, "measure_host_read_bandwidth", lambda *a, **k: 10e9)
    model = str(gguf_dir / "tiny-qwen3moe.gguf")
    args = ["plan", model, "--context", "256"]
    assert main([*args, "--json"]) == 0
    fast = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    assert main([*args, "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert fast["engine_slow_path"] is None
    assert slow["engine_slow_path"] == (
        "9 routed-expert tensors in Q8_0, Q4_0 (e.g. blk.0.ffn_gate_exps.weight) would be computed on a slow path "
        "on the CPU: the native CPU kernels are not in use (turned off by HYBRIDMOE_NATIVE=0), so the CPU experts run "
        f"on the PyTorch reference, which dequantizes them on every call (about {SLOW_PATH_SLOWDOWN:g}x slower)")
    assert slow["host_bytes_per_token"] == fast["host_bytes_per_token"]  # the bytes are the same, their time is not
    assert slow["decode_tokens_per_s_upper_bound"] < fast["decode_tokens_per_s_upper_bound"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert f"Warning: {slow['engine_slow_path']}. `--backend auto` runs this model on llama.cpp" in text
    assert "set by PyTorch dequantization of CPU experts on the slow path" in text


def test_every_gguf_type_the_engine_reads_the_kernels_read():
    """cpu_slow_path takes a GGUF type outside the kernels' set for one the engine refuses (it
    cannot import the engine's decoders: they load torch). A decoder added without a kernel
    fails here: teach models.slow_paths that its type is read, slowly."""
    from hybridmoe.backend.formats.quant import GGUF_SUPPORTED_TYPES
    from hybridmoe.backend.models.formats import CPU_KERNEL_DTYPES, ggml_type_name

    assert {ggml_type_name(t) for t in GGUF_SUPPORTED_TYPES} <= CPU_KERNEL_DTYPES


def test_a_type_the_engine_does_not_read_is_no_slow_path():
    """TQ2_0 experts are refused by the engine (a message naming them), not dequantized slowly."""
    from dataclasses import replace

    from hybridmoe.backend.models.inventory import TypeUse

    inv = inspect_model(DEEPSEEK_V3, expert_format="q4_0").inventory
    ternary = replace(inv, routed_formats={"tq2_0": TypeUse(174, inv.routed_expert_bytes, "blk.3.ffn_up_exps.weight")},
                      routed_format_bytes_by_layer={layer: {"tq2_0": b} for layer, b in inv.routed_bytes_by_layer.items()})
    assert cpu_slow_path(ternary, kernels_missing=None) is None
    assert cpu_slow_path(ternary, kernels_missing="not built") is None
