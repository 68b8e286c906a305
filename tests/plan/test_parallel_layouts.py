"""The two ways several GPUs share a model (a pipeline of whole layers, or tensor parallelism:
a share of every layer on each card), planned side by side; and GPU experts kept in their
stored 4-bit form, counted to the byte (the flagship layout: Kimi K2.6 on four RTX PRO 6000)."""

from dataclasses import replace
from pathlib import Path

import pytest

from hybridmoe.app.render import plan_text
from hybridmoe.backend.backends import load_session
from hybridmoe.backend.errors import PlanError, UsageError
from hybridmoe.backend.hardware.presets import preset
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Plan, Workload, make
from hybridmoe.backend.plan.budget import resident_expert_bytes
from hybridmoe.backend.plan.estimate import ALL_REDUCE_SECONDS, tp_all_reduces
from hybridmoe.backend.plan.placement import deal

CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"
KIMI_EXPERT = 44_040_192 // 2 + 44_040_192 // 32 * 2  # int4 codes + a bf16 scale per 32: 24.77 MB


@pytest.fixture(scope="module")
def kimi():
    return inspect_model(CONFIGS / "moonshotai__Kimi-K2.6.json")


@pytest.fixture(scope="module")
def flagship(kimi):
    """`plan kimi --hardware "4x RTX PRO 6000" --context 32768 --users 4`, both layouts."""
    hw = preset("4x RTX PRO 6000")
    return {kind: make(kimi.spec, kimi.inventory, hw, Workload(context=32768, users=4, parallel=kind))
            for kind in ("auto", "pp", "tp")}


def test_4bit_experts_take_on_a_gpu_the_bytes_they_take_on_disk(kimi):
    spec = kimi.spec
    h, i = spec.hidden_size, spec.moe_intermediate_size
    assert resident_expert_bytes(spec, "int4") == KIMI_EXPERT == kimi.inventory.bytes_per_expert(1)
    assert round(KIMI_EXPERT / 1e6, 2) == 24.77
    assert resident_expert_bytes(spec, "int8") == 3 * h * i + (2 * i + h) * 2  # 44.06 MB: what it was
    q4_0 = replace(spec, expert_format="q4_0")
    assert resident_expert_bytes(q4_0, "int4") == 3 * h * i // 32 * 18  # Q4_0's 18 bytes a block
    # Q4_K and Q4_1 carry a min per group: two more bytes a group than their scale.
    assert resident_expert_bytes(replace(spec, expert_format="q4_k"), "int4") == 3 * h * i // 32 * 20
    mxfp4 = replace(spec, expert_format="mxfp4", family="gpt_oss")
    assert resident_expert_bytes(mxfp4, "int4") == 3 * h * i // 32 * 18 + (2 * i + h) * 2  # + biases
    for wider in ("q8_0", "q4_k_m", "bf16", "fp8_block"):
        with pytest.raises(ValueError):
            resident_expert_bytes(replace(spec, expert_format=wider), "int4")


def test_the_pipeline_holds_4bit_experts_as_stored(flagship):
    pp = flagship["pp"]
    assert pp.parallel == "pp" and pp.gpu_expert_format == "int4"
    assert set(pp.gpu_bytes_per_expert.values()) == {KIMI_EXPERT}
    # The tightest card sets the count: its room after weights, cache and reserve / 24.77 MB.
    n = len(pp.gpu_experts[1])
    tightest = min(
        (d.budget_bytes - sum(v for k, v in d.bytes_by_class.items() if k != "routed_experts")) / (
            sum(1 for layer in d.layers if layer in pp.moe_layers) * KIMI_EXPERT)
        for d in pp.devices if d.kind == "gpu"
    )
    assert n == int(tightest) and n >= 175  # 102 when they were widened to int8
    assert pp.host_bytes_per_token == pytest.approx(60 * 8 * (1 - n / 384) * KIMI_EXPERT)


def test_tensor_parallel_holds_what_4bit_storage_allows_and_reads_a_quarter_per_card(flagship):
    tp = flagship["tp"]
    gpus = [d for d in tp.devices if d.kind == "gpu"]
    assert tp.parallel == "tp" and len(gpus) == 4 and tp.pipeline() == []
    assert all(d.layers == tuple(range(61)) for d in gpus)
    # Every card: a quarter of the always-read weights, the MLA latent cache whole (every head reads it).
    always = sum(d.bytes_by_class["always_read"] for d in gpus)
    assert all(d.bytes_by_class["always_read"] == pytest.approx(always / 4, rel=1e-6) for d in gpus)
    assert all(d.bytes_by_class["kv_cache"] == pytest.approx(4 * tp.kv_bytes_per_conversation, rel=1e-6)
               for d in gpus)
    # GPU experts per layer: what 4-bit storage allows in the room left on the four cards.
    room = sum(d.budget_bytes - sum(v for k, v in d.bytes_by_class.items() if k != "routed_experts") for d in gpus)
    allowed = room / (60 * KIMI_EXPERT)
    n = len(tp.gpu_experts[1])
    assert {len(ids) for ids in tp.gpu_experts.values()} == {n}
    # The estimate, ~175, put a prefill reserve on every card; only the first card,
    # which runs the CPU experts, streams them, so only it keeps one.
    assert allowed * 0.96 <= n <= allowed and n >= 175
    assert [d.bytes_by_class["prefill_reserve"] > 0 for d in gpus] == [True, False, False, False]
    assert all(d.used_bytes <= d.budget_bytes for d in gpus)
    assert sum(d.bytes_by_class["routed_experts"] for d in gpus) == 60 * n * KIMI_EXPERT
    # One conversation: the host reads the CPU experts' share; each card a quarter of the dense
    # part plus the whole latent cache, at once, and 123 all-reduces of latency.
    assert tp.host_bytes_per_token == pytest.approx(60 * 8 * (1 - n / 384) * KIMI_EXPERT)
    card_bw = gpus[0].bandwidth_bytes_per_s
    t_gpu = tp.gpu_bytes_per_token / card_bw + tp_all_reduces(61) * ALL_REDUCE_SECONDS
    t_host = tp.host_bytes_per_token / tp.host_bandwidth_bytes_per_s
    assert tp.decode_tokens_per_s_upper_bound == pytest.approx(1 / max(t_gpu, t_host))
    pp = flagship["pp"]
    assert tp.gpu_bytes_per_token < pp.gpu_bytes_per_token / 3
    assert tp.decode_tokens_per_s_upper_bound > 2.5 * pp.decode_tokens_per_s_upper_bound


def test_auto_compares_both_and_chooses_the_faster_its_backend_runs(kimi, flagship):
    auto, pp, tp = flagship["auto"], flagship["pp"], flagship["tp"]
    assert set(auto.layouts) == {"pp", "tp"}
    assert auto.layouts["tp"]["decode_tokens_per_s_upper_bound"] == tp.decode_tokens_per_s_upper_bound
    assert auto.layouts["pp"]["gpu_experts_per_layer"] == len(pp.gpu_experts[1])
    # Four conversations together: tensor parallelism is faster, and the engine runs it.
    assert tp.decode_tokens_per_s_aggregate > pp.decode_tokens_per_s_aggregate
    assert auto.parallel == "tp" and auto.gpu_experts == tp.gpu_experts
    text = plan_text(auto)
    assert "held as int4 (24.77 MB each)" in text
    assert "tensor parallel (tp) *" in text and "per card" in text
    assert f"{pp.decode_tokens_per_s_upper_bound:,.1f} tok/s" in text
    # llama.cpp runs pipelines only: a plan for it stays one, and it refuses a tensor-parallel plan.
    for_llama = make(kimi.spec, kimi.inventory, preset("4x RTX PRO 6000"),
                     Workload(context=32768, users=4, backend="llamacpp"))
    assert for_llama.parallel == "pp" and not for_llama.layouts["tp"]["runnable"]
    assert "(not on llama.cpp)" in plan_text(for_llama)
    with pytest.raises(UsageError, match="tensor parallelism"):
        load_session("llamacpp", "unused", tp)
    # So does `auto` following a plan made for llama.cpp with --parallel tp.
    forced = make(kimi.spec, kimi.inventory, preset("4x RTX PRO 6000"),
                  Workload(context=32768, users=4, backend="llamacpp", parallel="tp"))
    with pytest.raises(UsageError, match="tensor parallelism"):
        load_session("auto", "unused", forced)


def test_a_tensor_parallel_plan_round_trips(flagship, tmp_path):
    tp = flagship["tp"]
    for name in ("plan.toml", "plan.json"):
        back = Plan.load(tp.save(tmp_path / name))
        assert back == tp and back.parallel == "tp" and back.layouts == tp.layouts
        assert [d.experts for d in back.devices] == [d.experts for d in tp.devices]


def test_tensor_parallel_splits_grouped_kv_heads_and_needs_two_cards():
    qwen = inspect_model(CONFIGS / "Qwen__Qwen3-235B-A22B.json", expert_format="q4_k_m")  # 4 KV heads
    for cards, share in ((4, 1 / 4), (8, 1 / 4)):  # 8 cards: a KV head each for two cards' query heads
        hw = preset(f"{cards}x RTX PRO 6000")
        pp = make(qwen.spec, qwen.inventory, hw, Workload(context=32768, parallel="pp"))
        tp = make(qwen.spec, qwen.inventory, hw, Workload(context=32768, parallel="tp"))
        kv_total = sum(d.bytes_by_class["kv_cache"] for d in pp.devices)
        assert [d.bytes_by_class["kv_cache"] for d in tp.devices if d.kind == "gpu"] == [
            pytest.approx(kv_total * share)] * cards
    one_card = replace(preset("4x RTX PRO 6000"), gpus=preset("4x RTX PRO 6000").gpus[:1])
    one = make(qwen.spec, qwen.inventory, one_card, Workload(context=8192, parallel="tp"))
    assert one.parallel == "pp" and not one.layouts.get("tp")
    assert any("two or more GPUs" in w for w in one.warnings)


def test_int4_is_refused_for_experts_that_are_not_4bit():
    deepseek = inspect_model(CONFIGS / "deepseek-ai__DeepSeek-V3.json")  # fp8 experts
    with pytest.raises(PlanError, match="4-bit"):
        make(deepseek.spec, deepseek.inventory, preset("4x RTX PRO 6000"), Workload(gpu_expert_form="int4"))
    with pytest.raises(UsageError):
        Workload(parallel="ring")


@pytest.mark.parametrize("n,room,want", [
    (10, [4, 4, 4, 4], [3, 3, 2, 2]),
    (7, [10, 5], [5, 2]),
    (0, [1, 1], [0, 0]),
    (6, [2.5, 4.5], [2, 4]),  # in proportion (2.1, 3.9), never beyond a card's room
])
def test_dealing_a_layers_experts_to_the_cards(n, room, want):
    got = deal({7: tuple(range(n))}, room, {7: 1.0})
    assert [len(card[7]) for card in got] == want
    assert tuple(e for card in got for e in card[7]) == tuple(range(n))  # each id once, in order
