"""The planner's always-read figure for a GPU is what the engine holds there, for every family,
from a Q8_0 GGUF and from a Hugging Face checkpoint; and a CPU-only plan's bytes per token are
what the decode step reads (docs/sizing.md §1, §6).

A GPU takes a GGUF's matrices in their stored blocks (``stored_linear``: projections, the head,
the embedding; ``stored_latent``: MLA's kv_b, whole or split), the other always-read weights
(norms, float matrices, a checkpoint's projections) in the compute dtype and the routers as the
family routes; the figure is measured here on the CPU with the native kernels off and the CPU
standing in for the card (``stored_linear.serves``), where the loader takes the same path as for
a GPU (``Loader.projection``, ``stored_latent``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridmoe.backend.engine import step_profile, stored_linear
from hybridmoe.backend.engine.mla import MLAttention
from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.engine.session import EngineBackend
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from tests.convert.conftest import FAMILIES, build_checkpoint, needs_llama_cpp
from tests.engine.test_hybrid_resident import _workstation


# Rows and columns K-quants take (multiples of 256) in every matrix of the Q4_K_M variant; with
# the narrow heads, the output projection's 128 columns are not, and the converter writes it
# in Q5_1, a format the CPU kernels do not read (the engine widens it to bf16 there).
K_QUANT_SIZES = {"q4_k_m": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64),
                 "q4_k_m narrow heads": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256)}
# A DeepSeek of such sizes: its attn_k_b (rows of nope = 128) is written in Q5_0, attn_v_b in Q4_K.
MLA_K_QUANT = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, q_lora_rank=256,
                   kv_lora_rank=256, qk_nope_head_dim=128, v_head_dim=128)


# A source's suffix for a DeepSeek GGUF that stores MLA's kv_b whole (attn_kv_b, as conversions
# before spring 2025 did) instead of split into attn_k_b and attn_v_b.
WHOLE_KV_B = " whole kv_b"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, "hf" | "q8_0" | a K_QUANT_SIZES key, either GGUF one + WHOLE_KV_B) -> path of a
    tiny bf16 checkpoint or its GGUF (for the Q4_K_M ones, of a checkpoint of those sizes)."""
    from hybridmoe.backend.convert import to_gguf
    from hybridmoe.backend.models.families import deepseek

    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, source: str) -> Path:
        if source.endswith(WHOLE_KV_B):
            if (family, source) not in cache:
                fmt = source.removesuffix(WHOLE_KV_B)
                get(family, fmt)  # the split GGUF's checkpoint, converted again
                out = tmp_path_factory.mktemp(f"gguf_{family}_whole") / f"{family}-{fmt}.gguf"
                with pytest.MonkeyPatch.context() as m:
                    m.setattr(deepseek, "GGUF_SPLITS_KV_B", False)
                    quant = "q4_k_m" if fmt in K_QUANT_SIZES else fmt
                    cache[family, source] = to_gguf(cache[family, f"{fmt} checkpoint"], out, quant)
            return cache[family, source]
        if source in K_QUANT_SIZES:
            if (family, source) not in cache:
                sizes = MLA_K_QUANT if family.startswith("deepseek") else K_QUANT_SIZES[source]
                hf = build_checkpoint(tmp_path_factory.mktemp(f"{family}_k"), family, overrides=sizes).path
                out = tmp_path_factory.mktemp(f"gguf_{family}") / f"{family}-q4_k_m.gguf"
                cache[family, source], cache[family, f"{source} checkpoint"] = to_gguf(hf, out, "q4_k_m"), hf
            return cache[family, source]
        if (family, "hf") not in cache:
            cache[family, "hf"] = build_checkpoint(tmp_path_factory.mktemp(family), family).path
        if source != "hf" and (family, source) not in cache:
            out = tmp_path_factory.mktemp(f"gguf_{family}") / f"{family}-{source}.gguf"
            cache[family, source] = to_gguf(cache[family, "hf"], out, source)
            cache[family, f"{source} checkpoint"] = cache[family, "hf"]
        return cache[family, source]

    return get


def _held_bytes(model) -> int:
    """Bytes of every weight the model holds but the routed experts (not buffers of the
    model: they stay in host RAM or are placed by the plan), the KV cache and the rotary
    tables (computed, not weights)."""
    total = 0
    for name, module in model.named_modules():
        if ".cache" in name or name.endswith(".rotary"):
            continue
        for key, buffer in module.named_buffers(recurse=False):
            # A router on the CPU computes with its matrix and bias widened to float32; a GPU
            # holds them in the dtype the loader gave (routing._cpu_float, _keep_weight).
            dtype = getattr(module, "held_dtype", buffer.dtype) if key in ("weight", "bias") else buffer.dtype
            total += buffer.numel() * dtype.itemsize
    return total


@pytest.mark.parametrize("family,source", [(f, s) for s in ("hf", "q8_0") for f in FAMILIES]
                         + [pytest.param(f, "q4_k_m", marks=needs_llama_cpp) for f in ("qwen3_moe", "deepseek_v3")]
                         + [("deepseek_v3", "q8_0" + WHOLE_KV_B),
                            pytest.param("deepseek_v3", "q4_k_m" + WHOLE_KV_B, marks=needs_llama_cpp)])
def test_the_plans_gpu_always_read_bytes_are_what_the_engine_holds(models, family, source, monkeypatch):
    """Every family, from a checkpoint and from GGUFs; a DeepSeek's kv_b split (attn_k_b and
    attn_v_b, each in its own type) and whole (attn_kv_b), both held as stored."""
    path = models(family, source)
    inspected = inspect_model(path)
    plan = make(inspected.spec, inspected.inventory, _workstation(), Workload(context=64, prefill_reserve="off"))
    planned = plan.devices[0].bytes_by_class["always_read"]
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")
    monkeypatch.setattr(stored_linear, "serves", lambda device: True)
    # (The CPU standing in for the plan's GPU: in the GPU's compute dtype, not a CPU's float32.)
    model = build_model(inspected.spec, open_weights(path), max_context=64, dtype=torch.bfloat16)
    assert planned == _held_bytes(model)
    held = [m for m in model.modules() if isinstance(m, stored_linear.StoredLinear)]
    if source != "hf":  # a GGUF's projections as stored (a K-quant mix: each in its own type)
        assert held and planned < _widened_bytes(inspected.spec, inspected.inventory)
        assert sum(m.data.numel() for m in held) == sum(
            f.bytes for forms in inspected.inventory.gpu_forms.values() for f in forms if not f.widened)
        if family.startswith("deepseek"):  # kv_b among them, in every layer
            assert all(m.kv_b_weight is None and m.stored_kv_b is not None
                       for m in model.modules() if isinstance(m, MLAttention))
    else:
        assert not held


def _widened_bytes(spec, inventory) -> int:
    """The always-read weights all in the compute dtype (the routers as routed), as the engine
    held them on a GPU before it kept a GGUF's blocks there."""
    from hybridmoe.backend.plan import budget

    elements = sum(f.elements for forms in inventory.gpu_forms.values() for f in forms)
    return elements * budget.compute_dtype_bytes(spec) + inventory.router_bytes_held(budget.router_element_bytes(spec))


# OLMoE's and GPT-OSS' attention runs in PyTorch in the decode step (per-projection q/k norm;
# sinks), whose reads the step's profile does not count.
STEPPED = [f for f in FAMILIES if f not in ("olmoe", "gpt_oss")]


@pytest.mark.parametrize("family,source", [(f, s) for f in STEPPED for s in ("hf", "q8_0")]
                         + [pytest.param("qwen3_moe", s, marks=needs_llama_cpp) for s in K_QUANT_SIZES]
                         + [pytest.param("deepseek_v3", "q4_k_m", marks=needs_llama_cpp)])
def test_a_cpu_only_plans_bytes_per_token_are_what_the_decode_step_reads(models, family, source):
    """One token at the plan's full context: its experts, projections, routers, cache and head,
    as the step counts them, against the plan's figure (which also counts the norms' vectors,
    up to 3 % of these tiny models' bytes; MLA's kv_b is read in the compute dtype from a
    checkpoint and as stored from a GGUF (a Q4_K_M DeepSeek's Q5_0 attn_k_b too), Q4_K
    matrices in the kernels' layout, 148 bytes for the file's 144, and a Q5_1 projection in
    bf16, and the plan says so). Host RAM holds the experts' copies the plan counts."""
    path = models(family, source)
    inspected = inspect_model(path)
    context = 64
    plan = make(inspected.spec, inspected.inventory, _workstation(), Workload(context=context, strategy="cpu-only"))
    model = EngineBackend().load(str(path), plan).model
    model.forward_batch([(model.sequence, list(range(3, 2 + context)), 0)], prompt=True)
    with step_profile.recording() as profile:
        model.forward_batch([(model.sequence, [5], context - 1)])
    read = sum(profile.bytes.values())
    assert 0.97 * plan.host_bytes_per_token <= read <= plan.host_bytes_per_token
    if source in K_QUANT_SIZES:  # the experts' copies: the Q4_K ones 4 bytes in 148 more than the file's
        copied = sum(step.ffn.layer.interleaved_bytes for step in model._decode_step.layers
                     if hasattr(step.ffn, "layer"))  # (not DeepSeek's leading dense layer)
        assert copied == plan.devices[-1].bytes_by_class["routed_experts"] > inspected.inventory.routed_expert_bytes


def test_a_card_too_small_for_the_widened_weights_is_planned_for_llamacpp(models):
    """A quantized file's always-read weights that fit on the card as llama.cpp holds them but
    not as the engine does (a tiny Q8_0 DeepSeek's: all of its matrices as stored on both, MLA's
    kv_b too, but the engine's card holds the token embedding, which llama.cpp's leaves in host
    RAM, and that outweighs the norms the engine holds in bf16 where the file has f32): the
    engine's plan does not fit and says that llama.cpp would hold them as
    stored; llama.cpp's plan counts them so, and fits; and an automatic choice of backend plans
    for llama.cpp, saying why (the session then runs it there, and nowhere else:
    tests/llamacpp/test_loading.py)."""
    from tests.engine.test_hybrid_resident import replace_gpu_total

    inspected = inspect_model(models("deepseek_v3", "q8_0"))
    spec, inv = inspected.spec, inspected.inventory

    def plan(hw, backend="auto"):
        return make(spec, inv, hw, Workload(context=64, prefill_reserve="off", backend=backend))

    widened = plan(_workstation()).devices[0].bytes_by_class
    stored = plan(_workstation(), "llamacpp").devices[0].bytes_by_class
    assert stored["always_read"] < widened["always_read"]
    # A card whose budget (0.9 x its memory less 3 GiB) holds the stored weights and the cache, not the widened.
    budget = (stored["always_read"] + widened["always_read"]) // 2 + stored["kv_cache"]
    small = replace_gpu_total(_workstation(), int((budget + 3 * 2**30) / 0.9) + 1)
    engine_plan, llama_plan, auto = plan(small, "engine"), plan(small, "llamacpp"), plan(small)
    assert not engine_plan.fits and llama_plan.fits
    assert any("--backend llamacpp" in s for s in engine_plan.suggestions)
    assert auto.fits and auto.workload.backend == "llamacpp" and auto.gpu_experts == llama_plan.gpu_experts
    assert any("this plan is for llama.cpp" in w for w in auto.warnings)
    assert auto.engine_misfit == engine_plan.reason and llama_plan.engine_misfit is None  # (a session then keeps it off the engine)
    # Where the engine fits, the automatic choice stays the engine's.
    assert plan(_workstation()).workload.backend == "auto"
