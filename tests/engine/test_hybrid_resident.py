"""Main-device experts as the Plan chose to hold them (dense or weight-only int8), counted to
the byte as the Plan counts them; and the Plan's other hand-offs to the engine (threshold,
reserves, stages, statistics for frequency placement)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.backend.engine.experts import experts_forward
from hybridmoe.backend.engine.hybrid import HybridOptions, options_from_plan
from hybridmoe.backend.formats.int8_weights import Int8Weight, quantize_int8
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.engine.plan_layout import build_kwargs
from hybridmoe.backend.hardware.profile import CPU, GPU, HardwareProfile, Memory
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from hybridmoe.backend.plan.budget import resident_expert_bytes
from tests.engine.conftest import Dequantized, engine, relative_error, tokens

GIB = 1 << 30


def _moes(model) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


# Row lengths on each side of the CPU kernel's steps (8 on AVX2 and aarch64, 16 on AVX-512;
# see int8pack_cpu_reads_correctly): a multiple of 16, of 8 only (24, 40), of neither (20).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [64, 48, 40, 24, 20])
def test_int8_product_is_the_dequantized_matrix_product(dtype, k):
    """The op (or the widened fallback for the shapes torch's kernel misreads on this CPU)
    computes x W^T for W = q · scale exactly as dequantized."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, k, generator=g)
    w[5] = 0  # an all-zero row gets scale 1, q 0
    q = quantize_int8(w, dtype)
    assert q.q.dtype == torch.int8 and q.scale.dtype == dtype and int(q.q.abs().max()) <= 127
    assert torch.all(q.q[5] == 0) and q.scale[5] == 1
    # Rounding against the rounded scale: at most half a step (plus the clamp at +-127).
    step = q.scale.float()[:, None]
    assert torch.all((q.dequantize() - w).abs() <= step * 0.5 + step * (1 / 127) + 1e-7)
    for rows in (1, 3, 17):
        x = torch.randn(rows, k, generator=g).to(dtype)
        ref = F.linear(x.float(), q.dequantize())
        got = q.linear(x)
        assert got.dtype == dtype and got.shape == (rows, 48)
        assert relative_error(got, ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert q.nbytes == 48 * k + 48 * q.scale.element_size()
    with pytest.raises(ValueError):
        Int8Weight(q.q.float(), q.scale)


@pytest.mark.parametrize("family,dtype", [("qwen3_moe", torch.float32), ("gpt_oss", torch.bfloat16),
                                          ("deepseek_v3", torch.bfloat16)])
def test_resident_bytes_are_what_the_plan_counts(family, dtype, checkpoints):
    path = checkpoints(family, dtype)
    spec = inspect_model(path).spec
    for form in ("dense", "int8"):
        model = engine(path, placement={layer: [1, 4, 6] for layer in spec.moe_layers}, resident_form=form)
        for moe in _moes(model):
            assert moe.main.form == form
            assert moe.main.nbytes == 3 * resident_expert_bytes(spec, form), (family, form)


def test_int8_experts_compute_what_their_dequantized_weights_do(checkpoints):
    """The group's forward with int8 matrices equals the same forward over the dequantized
    matrices, and the model stays close to the dense one (int8 rounding only)."""
    path = checkpoints("qwen3_moe")
    placement = {1: [0, 2, 3, 7], 2: list(range(8))}
    int8 = engine(path, placement=placement, resident_form="int8", device="cpu")  # x below is on the CPU
    dense = engine(path, placement=placement, device="cpu")
    moe = _moes(int8)[0]
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(2))
    ids, weights = moe.router(x)

    got = experts_forward(x, ids, weights, moe.main)
    assert isinstance(moe.main.weights_of(0).gate_up, Int8Weight)
    assert relative_error(got, experts_forward(x, ids, weights, Dequantized(moe.main))) < 1e-6
    ids_in = tokens(12, seed=8)
    assert relative_error(int8(ids_in), dense(ids_in)) < 2e-2
    # And through the scheduler, streamed and overlapped, the int8 model computes the same.
    hybrid = engine(path, placement=placement, resident_form="int8", hybrid=HybridOptions(stream_min_tokens=8))
    assert relative_error(hybrid(ids_in), engine(path, placement=placement, resident_form="int8")(ids_in)) < 1e-6


def _workstation(gpus=1):
    return HardwareProfile(
        cpu=CPU(arch="x86_64", physical_cores=16, threads=32, features=("avx2", "fma", "avx512f")),
        memory=Memory(total_bytes=64 * GIB, available_bytes=64 * GIB, bandwidth_theoretical_bytes_per_s=200e9),
        gpus=tuple(GPU(index=i, name="H200", total_bytes=int(140 * GIB), free_bytes=int(140 * GIB),
                       memory_bandwidth_bytes_per_s=4.8e12, pcie_generation=5, pcie_width=16, source="described")
                   for i in range(gpus)),
        described=True,
    )


def test_the_engine_takes_the_plans_threshold_reserves_and_stages(checkpoints):
    model = inspect_model(checkpoints("qwen3_moe"))
    spec, inv = model.spec, model.inventory
    plan = make(spec, inv, _workstation(gpus=2), Workload(context=256, prefill_reserve="on", gpu_expert_form="int8"))
    assert plan.prefill_stream_min_tokens is not None
    options = options_from_plan(plan)
    assert options.stream_min_tokens == plan.prefill_stream_min_tokens
    assert options.stream_reserve_bytes == {d.torch_device: d.bytes_by_class["prefill_reserve"]
                                            for d in plan.devices if d.kind == "gpu"}
    off = make(spec, inv, _workstation(), Workload(context=256, prefill_reserve="off"))
    assert options_from_plan(off).stream_min_tokens is None
    # A caller that insists on the CPU gets one stage there and no scheduler options.
    assert build_kwargs(plan, "cpu") == {"resident_form": "int8", "placement": plan.placement()}
    if not torch.cuda.is_available():
        assert "pipeline" not in build_kwargs(plan)
    # The Plan's reserve holds the engine's slots for a whole layer of CPU experts.
    built = engine(checkpoints("qwen3_moe"), hybrid=HybridOptions(stream_min_tokens=8,
                   stream_reserve_bytes={"cpu": plan.devices[0].bytes_by_class["prefill_reserve"]}))
    (streamer,) = built.scheduler.streamers.values()
    assert streamer.n_slots >= spec.n_routed_experts and not streamer.skipped


def test_statistics_recorded_by_the_engine_drive_frequency_placement(checkpoints, tmp_path):
    """What `hybridmoe plan --strategy frequency --stats FILE` reads is what the engine writes."""
    path = checkpoints("qwen3_moe")
    model = engine(path, name="tiny")
    for seed in range(4):
        model(tokens(16, seed=seed), 0)
    stats_file = tmp_path / "stats.json"
    model.stats.save(stats_file)
    inspected = inspect_model(path)
    spec, inv = inspected.spec, inspected.inventory
    hw = _workstation()
    probe = make(spec, inv, hw, Workload(context=64, prefill_reserve="off", gpu_expert_form="dense"))
    fixed = probe.devices[0]
    per_expert = resident_expert_bytes(spec, "dense")
    room = 5 * per_expert + per_expert // 2  # five experts in all, across the MoE layers
    reported = int((fixed.bytes_by_class["always_read"] + fixed.bytes_by_class["kv_cache"] + room + 3 * GIB) / 0.9)
    small = replace_gpu_total(hw, reported)
    wl = Workload(context=64, prefill_reserve="off", gpu_expert_form="dense", strategy="frequency",
                  stats_file=str(stats_file))
    plan = make(spec, inv, small, wl)
    counts = {layer: model.stats.counts[layer].tolist() for layer in spec.moe_layers}
    ranked = sorted(((c, layer, e) for layer, cs in counts.items() for e, c in enumerate(cs)),
                    key=lambda t: (-t[0], t[1], t[2]))[:5]
    want = {}
    for _, layer, e in ranked:
        want.setdefault(layer, []).append(e)
    assert plan.gpu_expert_count == 5
    assert {layer: list(ids) for layer, ids in plan.gpu_experts.items() if ids} == \
        {layer: sorted(ids) for layer, ids in want.items()}


def replace_gpu_total(hw: HardwareProfile, total: int) -> HardwareProfile:
    from dataclasses import replace

    return replace(hw, gpus=tuple(replace(g, total_bytes=total, free_bytes=total) for g in hw.gpus))

