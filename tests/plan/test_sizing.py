"""The planner's arithmetic against the worked figures of docs/sizing.md, on the real configs."""

from dataclasses import replace
from pathlib import Path

import pytest

from hybridmoe.backend.hardware.profile import CPU, GPU, HardwareProfile, Memory
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from hybridmoe.backend.plan.budget import (
    described_gpu_budget,
    prefill_reserve_bytes,
    resident_expert_bytes,
)
from hybridmoe.backend.plan.estimate import experts_touched, prefill_crossover_tokens

CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"
GIB = 1 << 30


@pytest.fixture(scope="module")
def kimi():
    return inspect_model(CONFIGS / "moonshotai__Kimi-K2.6.json")


# Zen 5, as /proc/cpuinfo names its flags: every flag of the AVX-512 kernel set.
EPYC_9355_FEATURES = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                      "avx512_bf16", "avx512vbmi", "avx512_bitalg", "gfni")


def epyc_host(ram=1536 * GIB, gpus=()):
    """Two EPYC 9355 sockets, 24 channels of DDR5-6400: 1,228.8 GB/s (docs/sizing.md §6)."""
    return HardwareProfile(
        cpu=CPU(model_name="AMD EPYC 9355", arch="x86_64", sockets=2, physical_cores=64, threads=128,
                features=EPYC_9355_FEATURES),
        memory=Memory(total_bytes=ram, available_bytes=ram, bandwidth_theoretical_bytes_per_s=24 * 6400e6 * 8),
        gpus=tuple(gpus),
        described=True,
        name="test box",
    )


def h200(i=0, reported=int(140.4 * GIB)):
    return GPU(index=i, name="H200 NVL", total_bytes=reported, free_bytes=reported,
               memory_bandwidth_bytes_per_s=4.8e12, pcie_generation=5, pcie_width=16, source="described")


def test_kimi_expert_and_kv_figures(kimi):
    spec, inv = kimi.spec, kimi.inventory
    assert spec.params_per_expert == 3 * 7168 * 2048 == 44_040_192
    # int4 g32 with bf16 scales: 4.5 bits per weight -> 24.77 MB per expert.
    assert inv.bytes_per_expert(spec.moe_layers[0]) == pytest.approx(44_040_192 * 4.5 / 8)
    assert round(inv.bytes_per_expert(spec.moe_layers[0]) / 1e6, 2) == 24.77
    assert inv.routed_expert_bytes / 1e9 == pytest.approx(570.8, abs=0.05)
    assert inv.routed_expert_bytes / GIB == pytest.approx(531.6, abs=0.05)
    assert spec.kv_bytes_per_token() == (512 + 64) * 61 * 2 == 70_272
    # 2.14 GiB per 32K-token conversation.
    assert spec.kv_bytes(32768) / GIB == pytest.approx(2.14, abs=0.005)


def test_kimi_all_experts_in_host_memory_is_100_tokens_per_s(kimi):
    """Every routed expert in host RAM: ~11.9 GB per token, ~100 tokens/s at 1,229 GB/s."""
    spec, inv = kimi.spec, kimi.inventory
    wl = Workload(context=32768, prefill_reserve="off")
    # A card just big enough for the always-read weights and one conversation's cache.
    probe = make(spec, inv, epyc_host(gpus=[h200()]), wl)
    card = probe.devices[0]
    needed = card.bytes_by_class["always_read"] + card.bytes_by_class["kv_cache"]
    reported = int((needed + 3 * GIB + 0.5 * GIB) / 0.9)
    plan = make(spec, inv, epyc_host(gpus=[h200(reported=reported)]), wl)
    assert plan.fits
    assert plan.gpu_routed_expert_bytes == 0
    assert plan.host_bytes_per_token == pytest.approx(60 * 8 * 44_040_192 * 4.5 / 8)
    assert plan.host_bytes_per_token / 1e9 == pytest.approx(11.9, abs=0.05)
    assert plan.host_bandwidth_bytes_per_s == pytest.approx(1228.8e9)
    assert plan.decode_tokens_per_s_upper_bound == pytest.approx(1228.8e9 / plan.host_bytes_per_token)
    assert 100 <= plan.decode_tokens_per_s_upper_bound <= 105
    assert plan.decode_bound_by.startswith("host memory bandwidth")


def test_described_gpu_budgets_match_the_sizing_rule():
    assert described_gpu_budget(97_887 * (1 << 20)) / GIB == pytest.approx(83.0, abs=0.05)
    assert described_gpu_budget(int(140.4 * GIB)) / GIB == pytest.approx(123.4, abs=0.05)


def test_gpu_placement_order_and_uniform_counts(kimi):
    spec, inv = kimi.spec, kimi.inventory
    plan = make(spec, inv, epyc_host(gpus=[h200(i) for i in range(4)]), Workload(context=32768, parallel="pp"))
    assert plan.fits, plan.reason
    counts = {len(ids) for ids in plan.gpu_experts.values()}
    assert len(counts) == 1 and 0 < counts.pop() < 384
    for dev in plan.devices[:-1]:
        assert dev.used_bytes <= dev.budget_bytes
        # One layer of experts as stored (~9.5 GB for Kimi K2), plus slot alignment.
        assert dev.bytes_by_class["prefill_reserve"] == prefill_reserve_bytes(384, 44_040_192 * 4.5 / 8)
        assert dev.bytes_by_class["prefill_reserve"] == pytest.approx(384 * 44_040_192 * 4.5 / 8, rel=1e-3)
    # Not all of Kimi's experts fit in bf16 on four cards: GPU experts keep their stored int4
    # codes and bf16 group scales there, exactly the bytes they take on disk.
    assert plan.gpu_expert_format == "int4"
    assert plan.gpu_bytes_per_expert[1] == 44_040_192 // 2 + 44_040_192 // 32 * 2 == plan.bytes_per_expert[1]
    assert plan.gpu_routed_expert_bytes == plan.gpu_expert_count * plan.gpu_bytes_per_expert[1]
    # Host holds exactly the routed experts not on a GPU, as stored.
    stored_on_gpu = sum(len(ids) * plan.bytes_per_expert[layer] for layer, ids in plan.gpu_experts.items())
    assert plan.host_routed_expert_bytes + stored_on_gpu == pytest.approx(plan.routed_expert_bytes_total)
    host = plan.devices[-1]
    assert host.bytes_by_class["routed_experts"] == plan.host_routed_expert_bytes
    # Pipeline: every layer is on exactly one card.
    layers = [layer for dev in plan.devices[:-1] for layer in dev.layers]
    assert layers == list(range(spec.num_layers))


def test_union_formula_for_several_users(kimi):
    assert experts_touched(384, 8, 1) == pytest.approx(8)
    assert experts_touched(384, 8, 4) == pytest.approx(384 * (1 - (376 / 384) ** 4))
    plan = make(kimi.spec, kimi.inventory, epyc_host(), Workload(context=8192, users=4))
    assert plan.experts_touched_per_layer == pytest.approx(384 * (1 - (376 / 384) ** 4))
    assert plan.decode_tokens_per_s_per_user < plan.decode_tokens_per_s_upper_bound
    assert plan.decode_tokens_per_s_aggregate == pytest.approx(4 * plan.decode_tokens_per_s_per_user)


def test_prefill_crossover_formula():
    # (bits/8) * F_cpu / (2 * B_pcie): 4.5-bit experts, 100 TFLOP/s CPU, 64 GB/s PCIe.
    assert prefill_crossover_tokens(4.5, 100e12, 64e9) == pytest.approx(0.5625 * 100e12 / 128e9)
    assert prefill_crossover_tokens(4.5, None, 64e9) is None


def test_cpu_only_reads_everything_from_host(kimi):
    plan = make(kimi.spec, kimi.inventory, epyc_host(), Workload(context=4096))
    assert plan.main_device == "cpu"
    assert plan.gpu_routed_expert_bytes == 0
    assert plan.host_bytes_per_token > 60 * 8 * 44_040_192 * 4.5 / 8  # plus attention, shared, head
    assert plan.fits
    assert any("No GPU" in w for w in plan.warnings)


def test_host_shortfall_says_by_how_much_and_what_would_fit(kimi):
    plan = make(kimi.spec, kimi.inventory, epyc_host(ram=256 * GIB), Workload(context=4096))
    assert not plan.fits
    assert "host RAM is short by" in plan.reason
    assert any("machine with at least" in s for s in plan.suggestions)


def test_bf16_checkpoint_suggests_smaller_quantization():
    model = inspect_model(CONFIGS / "Qwen__Qwen3-235B-A22B.json", expert_format="bf16")
    plan = make(model.spec, model.inventory, epyc_host(ram=256 * GIB), Workload(context=4096))
    assert not plan.fits
    assert any("Q4_K_M" in s for s in plan.suggestions)


def test_kv_that_does_not_fit_on_the_gpu_suggests_context_and_users():
    model = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="q4_k_m")
    small = h200(reported=24 * GIB)
    plan = make(model.spec, model.inventory, epyc_host(gpus=[small]), Workload(context=32768, users=8))
    assert not plan.fits
    assert "GPU 0 is short" in plan.reason
    text = " ".join(plan.suggestions)
    assert "--context" in text and "--users" in text and "fp8" in text


def test_the_engines_plan_counts_its_own_kv_cache_whatever_kv_dtype_says():
    """The engine holds its cache in its compute dtype (bf16 here): a plan for it with an 8-bit
    --kv-dtype counts two bytes an element, as it allocates (tests/engine/test_kv_cache_sizing.py),
    and says that fp8 is llama.cpp's; a plan for llama.cpp counts the one byte it holds."""
    model = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="q4_k_m")
    host = epyc_host(gpus=[h200()])

    def planned(**workload):
        return make(model.spec, model.inventory, host, Workload(context=32768, **workload))

    bf16 = planned(backend="engine")
    for kv in ("fp8", "q8_0"):
        engine = planned(backend="engine", kv_dtype=kv)
        assert engine.kv_bytes_per_conversation == bf16.kv_bytes_per_conversation
        assert any(f"not {kv}" in w and "--backend llamacpp" in w for w in engine.warnings)
    assert not any("KV cache in" in w for w in bf16.warnings)
    llama, llama_bf16 = planned(backend="llamacpp", kv_dtype="fp8"), planned(backend="llamacpp")
    assert llama.kv_bytes_per_conversation == llama_bf16.kv_bytes_per_conversation / 2


def test_many_users_outgrow_the_workstation_and_get_a_deployment(kimi):
    plan = make(kimi.spec, kimi.inventory, epyc_host(gpus=[h200(i) for i in range(4)]),
                Workload(context=131072, users=64))
    assert plan.outgrown
    assert plan.serving and plan.serving["cards"] >= 8
    assert "--tensor-parallel-size" in plan.serving["vllm"]
    assert "--tp" in plan.serving["sglang"]


def test_frequency_strategy_places_the_most_used_pairs(tmp_path):
    from hybridmoe.backend.plan.stats import ExpertStats

    model = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="q4_k_m")
    spec = model.spec
    stats = ExpertStats(model=spec.name, n_experts=128, tokens=1000)
    for layer in spec.moe_layers:
        # Layer 0 uses experts 0..9 heavily, the others spread thin.
        hot = range(10) if layer == 0 else range(128)
        stats.record(layer, [e for e in hot for _ in range(100 if layer == 0 else 1)])
    path = tmp_path / "stats.json"
    stats.save(path)
    # Counted in int8 (one size in every layer; a Q4_K_M's layers held as stored differ).
    bpe = resident_expert_bytes(spec, "int8")
    probe = make(spec, model.inventory, epyc_host(gpus=[h200()]), Workload(context=4096, prefill_reserve="off"))
    fixed = probe.devices[0].bytes_by_class
    # Room for exactly 20 experts beyond the always-read weights and cache.
    reported = int((fixed["always_read"] + fixed["kv_cache"] + 20.5 * bpe + 3 * GIB) / 0.9)
    wl = Workload(context=4096, prefill_reserve="off", strategy="frequency", stats_file=str(path),
                  gpu_expert_form="int8")
    plan = make(spec, model.inventory, epyc_host(gpus=[h200(reported=reported)]), wl)
    assert plan.gpu_experts[0] == tuple(range(10))
    assert plan.gpu_expert_count == 20
    assert plan.gpu_expert_format == "int8"
    # The hot layer's CPU share is 0 by the statistics, so host reads fall accordingly.
    uniform = make(spec, model.inventory, epyc_host(gpus=[h200(reported=reported)]),
                   replace(wl, strategy="uniform", stats_file=None))
    assert plan.host_bytes_per_token < uniform.host_bytes_per_token


def test_llama_cpp_translation_counts_dense_blocks():
    model = inspect_model(CONFIGS / "deepseek-ai__DeepSeek-V3.json")
    plan = make(model.spec, model.inventory, epyc_host(gpus=[h200(i) for i in range(2)]), Workload(context=8192))
    lc = plan.llama_cpp
    assert lc["n_gpu_layers"] == 62
    cpu_layers = lc["cpu_moe_layers"]
    assert cpu_layers and cpu_layers[0] == 3  # the first three blocks are dense
    assert lc["n_cpu_moe"] == cpu_layers[-1] + 1
    assert cpu_layers == list(range(3, lc["n_cpu_moe"]))
    assert lc["override_tensor"][0].startswith(r"blk\.(3|4|")
    assert f"--n-cpu-moe {lc['n_cpu_moe']}" in lc["command"]


def test_plan_round_trips_through_toml_and_json(kimi, tmp_path):
    from hybridmoe.backend.plan import Plan

    plan = make(kimi.spec, kimi.inventory, epyc_host(gpus=[h200(i) for i in range(2)]), Workload(context=16384))
    for name in ("plan.toml", "plan.json"):
        path = plan.save(tmp_path / name)
        assert Plan.load(path) == plan


def test_context_beyond_the_model_is_refused(kimi):
    from hybridmoe.backend.errors import PlanError

    with pytest.raises(PlanError, match="longer than"):
        make(kimi.spec, kimi.inventory, epyc_host(), Workload(context=10_000_000))


def test_the_decode_bound_says_how_the_bandwidth_was_obtained(kimi):
    """A measured figure is named with how it was measured, in the plan and on the Layout screen."""
    from hybridmoe.app.tui.widgets.plan_view import speed_text

    measured = Memory(total_bytes=1536 * GIB, available_bytes=1536 * GIB, bandwidth_measured_bytes_per_s=400e9,
                      bandwidth_measured_note="best of 3 probes 0.1 s apart")
    host = replace(epyc_host(), memory=measured, described=False, name="this machine")
    plan = make(kimi.spec, kimi.inventory, host, Workload(context=32768, prefill_reserve="off"))
    assert plan.host_bandwidth_source == "measured on this machine, best of 3 probes 0.1 s apart"
    shown = speed_text(plan).plain
    assert "at most" in shown
    assert "Host memory bandwidth: 400.0 GB/s, measured on this machine, best of 3 probes 0.1 s apart" in shown

    theoretical = make(kimi.spec, kimi.inventory, epyc_host(), Workload(context=32768, prefill_reserve="off"))
    assert "Host memory bandwidth: 1,228.8 GB/s, theoretical" in speed_text(theoretical).plain
