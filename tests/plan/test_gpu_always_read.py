"""One 24-32 GB card beside the CPU (issue 46): the engine holds a GGUF's always-read matrices
in their stored blocks there (engine/stored_linear.py), so the giant MoE GGUFs people run on
such cards fit on the engine with room left for GPU experts, and the plan shows every class's
form, type by type, adding up to its always-read figure (MLA's kv_b among the stored matrices:
engine/stored_latent.py)."""

from __future__ import annotations

import pytest

from hybridmoe.backend.hardware.profile import CPU, GPU, HardwareProfile, Memory
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.inventory import TensorClass
from hybridmoe.backend.plan import Workload, make
from hybridmoe.backend.plan import budget as B
from tests.plan.test_sizing import CONFIGS

GIB = 1 << 30


def workstation(card_gib: int, ram_gib: int) -> HardwareProfile:
    card = GPU(index=0, name="card", total_bytes=card_gib * GIB, free_bytes=card_gib * GIB,
               memory_bandwidth_bytes_per_s=1.0e12, pcie_generation=4, pcie_width=16, source="described")
    return HardwareProfile(
        cpu=CPU(model_name="workstation", arch="x86_64", sockets=1, physical_cores=16, threads=32,
                features=("avx2", "fma", "avx512f")),
        memory=Memory(total_bytes=ram_gib * GIB, available_bytes=ram_gib * GIB,
                      bandwidth_theoretical_bytes_per_s=300e9),
        gpus=(card,), described=True, name="workstation")


# (config, GGUF format, host RAM in GiB: Kimi K2's 1T weights need more than 512 GiB at 4.5 bits).
MODELS = [("deepseek-ai__DeepSeek-V3.json", "q4_k_m", 512), ("moonshotai__Kimi-K2-Instruct.json", "q4_k_m", 768),
          ("moonshotai__Kimi-K2.5.json", "q4_0", 768), ("Qwen__Qwen3-235B-A22B.json", "q4_k_m", 512)]


@pytest.mark.parametrize("card_gib", [24, 32])
@pytest.mark.parametrize("config,fmt,ram_gib", MODELS, ids=[m[0].split("__")[1] for m in MODELS])
def test_the_giant_ggufs_fit_one_card_on_the_engine_with_gpu_experts(config, fmt, ram_gib, card_gib):
    model = inspect_model(CONFIGS / config, expert_format=fmt)
    spec, inv = model.spec, model.inventory
    # The room left for GPU experts, with the prefill reserve off: "auto" takes one wherever it fits
    # beside the always-read weights and the cache (docs/sizing.md), and one layer's experts
    # (Kimi K2.5 Q4_0: 8.9 GiB) fit beside its stored weights on a 24 GiB card, where the plan
    # then holds no GPU experts.
    plan = make(spec, inv, workstation(card_gib, ram_gib), Workload(context=32768, backend="engine",
                                                                    prefill_reserve="off"))
    card = plan.devices[0]
    assert plan.fits and plan.workload.backend == "engine", plan.reason
    assert plan.gpu_routed_expert_bytes > 0 and all(len(ids) > 0 for ids in plan.gpu_experts.values())
    assert card.used_bytes <= card.budget_bytes
    # The forms shown add up to the card's always-read figure, and what is stored in a block
    # type stays so: far less than the same weights in the compute dtype.
    forms = plan.gpu_always_read_forms
    assert sum(f["bytes"] for f in forms) == card.bytes_by_class["always_read"]
    widened = sum(f["bytes"] if f["class"] == "router" else _elements(inv, f) * B.compute_dtype_bytes(spec)
                  for f in forms)
    assert card.bytes_by_class["always_read"] < 0.45 * widened
    stored = {(f["class"], f["stored"]) for f in forms if f["held"] == "as stored"}
    assert ("attention", "q4_k" if fmt == "q4_k_m" else "q4_0") in stored and any(c == "embedding" for c, _ in stored)
    if spec.attention == "mla":  # kv_b as stored too (engine/stored_latent.py): of attention, only the norms widen
        assert [f["stored"] for f in forms if f["class"] == "attention" and f["held"] != "as stored"] == ["f32"], forms
        if fmt == "q4_k_m":  # attn_k_b's rows of 128 in Q5_0
            assert any(f["held"] == "as stored" and f["stored"] == "q5_0" and "k_b" in f["example"] for f in forms)


def _elements(inv, form) -> int:
    """The weights of a form's tensors (its class's GpuForm of that type and holding)."""
    return next(f.elements for f in inv.gpu_forms[TensorClass(form["class"])]
                if f.stored == form["stored"] and (form["held"] != "as stored") == f.widened)


def test_a_plan_for_llamacpp_or_without_a_gpu_shows_no_engine_forms():
    model = inspect_model(CONFIGS / "Qwen__Qwen3-30B-A3B.json", expert_format="q4_k_m")
    hw = workstation(24, 128)
    assert not make(model.spec, model.inventory, hw, Workload(context=4096, backend="llamacpp")).gpu_always_read_forms
    assert not make(model.spec, model.inventory, hw, Workload(context=4096, strategy="cpu-only")).gpu_always_read_forms


def test_the_printed_plan_names_each_form():
    from hybridmoe.app.render import plan_text

    model = inspect_model(CONFIGS / "deepseek-ai__DeepSeek-V3.json", expert_format="q4_k_m")
    text = plan_text(make(model.spec, model.inventory, workstation(24, 512), Workload(context=32768, backend="engine")))
    block = text[text.index("always-read weights on the GPUs"):].splitlines()
    lines = {line.split(":")[0].strip(): line for line in block[1:7]}
    assert {"attention", "dense ffn", "shared experts", "embedding", "lm head", "router"} <= set(lines), block[:8]
    # MLA's kv_b as stored beside the projections: attn_k_b's rows of 128 in Q5_0, attn_v_b with them in Q4_K
    assert "q4_k 5.7 GiB (305 tensors" in lines["attention"] and "q5_0 335.5 MiB (61 tensors" in lines["attention"]
    assert "→bf16" not in lines["attention"].replace("f32→bf16", ""), lines["attention"]
    assert lines["embedding"].split(": ", 1)[1].startswith("q4_k ")  # as stored
