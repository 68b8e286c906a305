"""How the Plan holds routed experts on GPUs (dense, int8 or as stored, counted exactly), sizes the
prefill reserve, derives the streamed-prefill threshold, and hands the engine its stages."""

from dataclasses import replace
from pathlib import Path

import pytest

from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Plan, Workload, make
from hybridmoe.backend.plan.budget import (
    STREAM_SLOT_OVERHEAD,
    prefill_reserve_bytes,
    resident_expert_bytes,
    resident_form_name,
)
from hybridmoe.backend.plan.estimate import (
    cpu_flops,
    prefill_crossover_tokens,
    prefill_stream_min_tokens,
)
from tests.plan.test_sizing import GIB, epyc_host, h200

CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"


@pytest.fixture(scope="module")
def qwen30b():
    return inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="q4_k_m")


@pytest.fixture(scope="module")
def kimi():
    return inspect_model(CONFIGS / "moonshotai__Kimi-K2.6.json")


def test_resident_bytes_are_the_engines_tensors(qwen30b):
    spec = qwen30b.spec
    h, i = 2048, 768
    assert (spec.hidden_size, spec.moe_intermediate_size) == (h, i)
    # bf16: gate+up [2I, H] and down [H, I]; int8: one byte a weight plus a bf16 scale per row.
    assert resident_expert_bytes(spec, "dense") == 3 * h * i * 2 == 9_437_184
    assert resident_expert_bytes(spec, "int8") == 3 * h * i + (2 * i + h) * 2 == 4_725_760
    gpt_oss = replace(spec, family="gpt_oss")
    assert resident_expert_bytes(gpt_oss, "dense") == 3 * h * i * 2 + (2 * i + h) * 2  # biases
    fp32 = replace(spec, other_format="fp32")
    assert resident_expert_bytes(fp32, "dense") == 3 * h * i * 4
    assert resident_form_name(fp32, "dense") == "f32" and resident_form_name(spec, "dense") == "bf16"
    with pytest.raises(ValueError):
        resident_expert_bytes(spec, "int4")


def test_everything_fits_dense_on_a_big_card(qwen30b):
    """Qwen3-30B's 6,144 experts take 58 GB in bf16: an H200 holds them all, no reserve needed."""
    plan = make(qwen30b.spec, qwen30b.inventory, epyc_host(gpus=[h200()]), Workload(context=8192))
    assert plan.fits, plan.reason
    assert plan.gpu_expert_format == "bf16"
    assert plan.gpu_expert_count == 48 * 128
    assert set(plan.gpu_bytes_per_expert.values()) == {9_437_184}
    assert plan.gpu_routed_expert_bytes == 48 * 128 * 9_437_184
    assert plan.devices[0].bytes_by_class["routed_experts"] == plan.gpu_routed_expert_bytes
    assert plan.devices[0].bytes_by_class["prefill_reserve"] == 0
    assert plan.prefill_stream_min_tokens is None  # nothing left on the CPU to stream
    assert plan.host_routed_expert_bytes == 0


def test_a_smaller_card_holds_a_gguf_s_experts_as_stored_and_a_reserve(qwen30b):
    spec, inv = qwen30b.spec, qwen30b.inventory
    card = h200(reported=16 * GIB)  # (a 24 GiB card holds all 6,144 as stored)
    plan = make(spec, inv, epyc_host(gpus=[card]), Workload(context=8192))
    assert plan.fits, plan.reason
    # Q4_K_M's experts, all in types the GPU kernels read: held as the file stores them, each
    # layer's at its own size (Q6_K downs in half the layers).
    assert plan.gpu_expert_format == "stored"
    assert plan.gpu_bytes_per_expert == {layer: inv.bytes_per_expert(layer) for layer in spec.moe_layers}
    assert len(set(plan.gpu_bytes_per_expert.values())) == 2
    dev = plan.devices[0]
    # One layer of experts as stored: the largest layer (Q4_K_M gives some layers more bits).
    bpe = max(inv.bytes_per_expert(layer) for layer in spec.moe_layers)
    assert dev.bytes_by_class["prefill_reserve"] == prefill_reserve_bytes(128, bpe) == 128 * (round(bpe) + STREAM_SLOT_OVERHEAD)
    stored_on_gpu = sum(len(ids) * inv.bytes_per_expert(layer) for layer, ids in plan.gpu_experts.items())
    assert dev.bytes_by_class["routed_experts"] == int(stored_on_gpu)
    assert dev.used_bytes <= dev.budget_bytes
    # Uniform: the most experts per layer the card's room allows (one more in each layer: their sizes summed).
    room = dev.budget_bytes - dev.used_bytes
    assert 0 <= room < sum(inv.bytes_per_expert(layer) for layer in spec.moe_layers)
    # Forced forms are obeyed and counted in their own bytes: int8 holds fewer, dense fewer still.
    int8 = make(spec, inv, epyc_host(gpus=[card]), Workload(context=8192, gpu_expert_form="int8"))
    assert int8.gpu_expert_format == "int8"
    assert int8.devices[0].bytes_by_class["routed_experts"] == int8.gpu_expert_count * 4_725_760
    assert int8.gpu_expert_count < plan.gpu_expert_count
    dense = make(spec, inv, epyc_host(gpus=[card]), Workload(context=8192, gpu_expert_form="dense"))
    assert dense.gpu_expert_format == "bf16"
    assert dense.gpu_expert_count < int8.gpu_expert_count
    assert dense.devices[0].bytes_by_class["routed_experts"] == dense.gpu_expert_count * 9_437_184
    # The host keeps the rest as the CPU kernels copy them (Q4_K 148 bytes for the file's 144).
    rest = sum((128 - len(ids)) * inv.host_bytes_per_expert(layer) for layer, ids in plan.gpu_experts.items())
    assert plan.host_routed_expert_bytes == pytest.approx(rest, abs=1)
    assert rest > inv.routed_expert_bytes - stored_on_gpu
    assert plan.host_bytes_per_token < int8.host_bytes_per_token < dense.host_bytes_per_token


def test_only_block_types_the_gpu_kernels_read_are_held_as_stored(qwen30b, kimi):
    """A bf16 checkpoint or compressed-tensors int4 has no stored GPU form: asking for it is
    refused; a Q4_K_M GGUF's is its bytes per layer, GPT-OSS' expert biases in the compute dtype."""
    from hybridmoe.backend.errors import PlanError
    from hybridmoe.backend.plan.budget import stored_expert_bytes

    bf16 = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json")
    for model in (bf16, kimi):
        assert stored_expert_bytes(model.spec, model.inventory) is None
        with pytest.raises(PlanError, match="--gpu-experts stored"):
            make(model.spec, model.inventory, epyc_host(gpus=[h200()]), Workload(gpu_expert_form="stored"))
    per_layer = stored_expert_bytes(qwen30b.spec, qwen30b.inventory)
    assert per_layer == {layer: qwen30b.inventory.bytes_per_expert(layer) for layer in qwen30b.spec.moe_layers}


def test_stream_threshold_from_the_crossover():
    # 40 tokens per expert, 64 experts, top-8: 8 tokens per expert at T tokens means T = 320.
    assert prefill_stream_min_tokens(40.0, 64, 8) == 320
    assert prefill_stream_min_tokens(40.1, 64, 8) == 321  # rounded up: at least the crossover
    assert prefill_stream_min_tokens(0.01, 64, 8) == 1
    assert prefill_stream_min_tokens(None, 64, 8) is None


def test_the_plan_records_the_threshold_the_engine_uses(kimi):
    """Kimi K2.6 on four H200 with the prefill reserve: crossover (bits/8)·F_cpu/(2·B_pcie)
    tokens per expert, times E/k tokens per call."""
    host = epyc_host(gpus=[h200(i) for i in range(4)])
    plan = make(kimi.spec, kimi.inventory, host, Workload(context=32768))
    f_cpu = cpu_flops(64, host.cpu.features)
    b_pcie = 16 * 3.938e9
    crossover = prefill_crossover_tokens(4.5, f_cpu, b_pcie)
    assert plan.prefill_crossover_tokens == pytest.approx(crossover)
    # F_cpu: 64 cores x 2.5 GHz x AVX-512's fp32 FMA peak (64 flops a cycle) x the kernels'
    # share of it (1/2); the host's AVX-512 BF16 does not count (the kernels do not use it).
    assert crossover == pytest.approx(0.5625 * 64 * 2.5e9 * 64 * 0.5 / (2 * b_pcie))
    assert plan.prefill_stream_min_tokens == prefill_stream_min_tokens(crossover, 384, 8)
    assert 1000 < plan.prefill_stream_min_tokens < 1200  # not a fixed 32
    assert not any("prefill chunk" in w for w in plan.warnings)
    # The engine decides per forward call: chunks shorter than the threshold would never stream; say so.
    small_chunks = make(kimi.spec, kimi.inventory, host, Workload(context=32768, prefill_chunk=512))
    assert any("prefill chunk" in w for w in small_chunks.warnings)
    off = make(kimi.spec, kimi.inventory, host, Workload(context=32768, prefill_reserve="off"))
    assert off.prefill_stream_min_tokens is None
    assert make(kimi.spec, kimi.inventory, epyc_host(), Workload(context=4096)).prefill_stream_min_tokens is None


def test_pipeline_stages_for_the_engine(kimi):
    plan = make(kimi.spec, kimi.inventory, epyc_host(gpus=[h200(i) for i in range(3)]),
                Workload(context=16384, parallel="pp"))
    stages = plan.pipeline()
    assert [d for d, _ in stages] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [layer for _, layers in stages for layer in layers] == list(range(kimi.spec.num_layers))
    assert plan.devices[-1].torch_device == "cpu"
    assert plan.resident_form == "int4"


def test_new_fields_round_trip_and_old_plans_still_load(kimi, tmp_path):
    plan = make(kimi.spec, kimi.inventory, epyc_host(gpus=[h200(i) for i in range(2)]),
                Workload(context=16384, parallel="pp"))
    for name in ("plan.toml", "plan.json"):
        back = Plan.load(plan.save(tmp_path / name))
        assert back == plan
        assert back.gpu_bytes_per_expert == plan.gpu_bytes_per_expert
    old = plan.to_dict()
    for key in ("gpu_expert_format", "gpu_bytes_per_expert", "prefill_stream_min_tokens"):
        old.pop(key)
    for dev in old["devices"]:
        dev.pop("torch_device")
    loaded = Plan.from_dict(old)
    assert loaded.gpu_expert_format == "bf16" and loaded.prefill_stream_min_tokens is None
    assert [d for d, _ in loaded.pipeline()] == ["cuda:0", "cuda:1"]  # from the device names
