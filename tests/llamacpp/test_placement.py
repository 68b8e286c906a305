"""The Plan's expert layout reaches llama.cpp: proven by llama.cpp's own load log.

llama.cpp logs, for every tensor a buffer-type override placed, "tensor NAME (SIZE TYPE)
buffer type overridden to BUFT". On a CPU-only build every tensor ends up in host memory
anyway, but the overrides are still matched and applied, so the log shows exactly which
tensors the plan moved; on a GPU build the same lines hold, and the other layers' experts are
"assigned to device CUDA0".
"""

from __future__ import annotations

import re

import pytest

from hybridmoe.backend.llamacpp import LlamaCppBackend, log
from tests.llamacpp.conftest import FAMILIES, make_plan

OVERRIDDEN = re.compile(r"^tensor (blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight) \(.*\) buffer type overridden to CPU$")


def llama_cpp_has_gpu() -> bool:
    from hybridmoe.backend.llamacpp import system_info

    return system_info()["gpu_offload"]


def overridden_by_llama_cpp(captured: log.Capture) -> set[str]:
    return {m.group(1) for line in captured.lines if (m := OVERRIDDEN.match(line.text))}


def expert_tensors(layers) -> set[str]:
    return {f"blk.{i}.ffn_{p}_exps.weight" for i in layers for p in ("gate", "up", "down")}


@pytest.mark.parametrize("family", FAMILIES)
def test_planned_cpu_layers_experts_are_overridden_to_the_cpu(family, ggufs):
    path = ggufs(family)
    plan = make_plan(path, gpu_moe_layers=1)  # the last MoE layer's experts on the GPU
    cpu_layers = plan.llama_cpp["cpu_moe_layers"]
    assert cpu_layers and plan.llama_cpp["override_tensor"]
    with log.capture() as captured:
        session = LlamaCppBackend().load(path, plan)
    try:
        assert overridden_by_llama_cpp(captured) == expert_tensors(cpu_layers)
        if not llama_cpp_has_gpu():
            # n_gpu_layers asks for every block; a CPU-only build has nowhere else to put them.
            assert set(captured.layer_devices().values()) == {"CPU"}
            assert session.placement.cpu_expert_layers() == tuple(plan.moe_layers)
    finally:
        session.close()


def test_n_cpu_moe_alone_moves_the_first_blocks_experts(ggufs):
    """`--n-cpu-moe N` semantics: blocks 0..N-1, the dense leading block counting in N."""
    path = ggufs("deepseek_v3")  # block 0 is dense, blocks 1 and 2 are MoE
    plan = make_plan(path, gpu_moe_layers=2, override_tensor=[], n_cpu_moe=2)
    with log.capture() as captured:
        session = LlamaCppBackend().load(path, plan)
    try:
        assert overridden_by_llama_cpp(captured) == expert_tensors([1])
    finally:
        session.close()


def test_a_cpu_only_plan_overrides_nothing(ggufs):
    path = ggufs("qwen3_moe")
    plan = make_plan(path)
    assert plan.llama_cpp["n_gpu_layers"] == 0 and not plan.llama_cpp["override_tensor"]
    with log.capture() as captured:
        session = LlamaCppBackend().load(path, plan)
    try:
        assert overridden_by_llama_cpp(captured) == set()
        assert session.placement.main_device_share() == 0.0
    finally:
        session.close()


def test_the_rest_of_the_plan_reaches_the_context(ggufs):
    path = ggufs("qwen3_moe")
    plan = make_plan(path, gpu_moe_layers=1, context=256, n_batch=64, n_ubatch=32, flash_attn=True,
                     cache_type_k="q8_0", cache_type_v="f16")
    with log.capture() as captured:
        session = LlamaCppBackend().load(path, plan)
    try:
        text = "\n".join(line.text for line in captured.lines)
        for expected in (r"n_ctx\s+= 256", r"n_batch\s+= 64", r"n_ubatch\s+= 32", r"flash_attn\s+= enabled",
                         r"K \(q8_0\)", r"V \(f16\)"):
            assert re.search(expected, text), expected
        assert session.context == 256 and session.chunk == 64
        assert session.params.context.n_threads == session.params.context.n_threads_batch == 1
    finally:
        session.close()


def test_placement_report_reads_a_gpu_build_log(ggufs):
    """What a CUDA build logs for a plan with block 0's experts on the CPU (the lines as
    llama.cpp writes them): block 1's experts are on the GPU, so half the expert work is."""
    from hybridmoe.backend.llamacpp.header import read_header
    from hybridmoe.backend.llamacpp.placement import PlacementReport

    captured = log.Capture([log.LogLine(log.DEBUG, text) for text in (
        "load_tensors: layer   0 assigned to device CUDA0, is_swa = 0",
        "load_tensors: layer   1 assigned to device CUDA0, is_swa = 0",
        "load_tensors: layer   2 assigned to device CUDA0, is_swa = 0",
        "tensor blk.0.ffn_gate_exps.weight (0 MiB bf16) buffer type overridden to CUDA_Host",
        "tensor blk.0.ffn_down_exps.weight (0 MiB bf16) buffer type overridden to CUDA_Host",
        "tensor blk.0.ffn_up_exps.weight (0 MiB bf16) buffer type overridden to CUDA_Host",
    )])
    report = PlacementReport.from_log(captured, read_header(ggufs("qwen3_moe")))
    assert report.moe_layers == (0, 1)
    assert report.cpu_expert_layers() == (0,)
    assert report.expert_device(1) == "CUDA0"
    assert report.main_device_share() == 0.5
