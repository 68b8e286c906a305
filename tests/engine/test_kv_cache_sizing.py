"""The planner's KV cache figures are what the engine allocates, for every family, from a
Hugging Face checkpoint and from its GGUF conversion (docs/sizing.md §2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.hardware.cpu import detect_cpu
from hybridmoe.backend.hardware.profile import HardwareProfile, Memory
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.formats import TORCH_DTYPES
from hybridmoe.backend.plan import Workload, make
from hybridmoe.backend.models.spec import KV_BLOCK_TOKENS, SLIDING_REWIND_TOKENS
from tests.convert.conftest import FAMILIES, build_checkpoint

# Longer than what GPT-OSS' sliding layers (window 4 in the tiny model) may hold at once (the
# window before a call and the window plus the rewind margin after it, in whole blocks): they
# hold fewer tokens than the context, the others all of them.
LONG = 2048 + SLIDING_REWIND_TOKENS
SHORT = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, "hf" | "gguf") -> path of a tiny bf16 checkpoint or its bf16 GGUF."""
    from hybridmoe.backend.convert import to_gguf

    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, source: str) -> Path:
        if (family, "hf") not in cache:
            cache[family, "hf"] = build_checkpoint(tmp_path_factory.mktemp(family), family).path
        if source == "gguf" and (family, "gguf") not in cache:
            out = tmp_path_factory.mktemp(f"gguf_{family}") / f"{family}.gguf"
            cache[family, "gguf"] = to_gguf(cache[family, "hf"], out, "bf16")
        return cache[family, source]

    return get


def _allocated_kv_bytes(model) -> int:
    """Bytes of the keys and values (or latents) every layer's cache blocks hold."""
    total = 0
    for m in model.modules():
        for name in ("k", "v", "kv"):
            buffer = m._buffers.get(name) if type(m).__name__ in ("PagedKV", "PagedLatent") else None
            if buffer is not None:
                total += buffer.numel() * buffer.element_size()
    assert total == model.cache.nbytes()
    return total


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_planner_kv_bytes_are_what_the_engine_allocates(models, family, source):
    path = models(family, source)
    spec = inspect_model(path).spec
    for context, sequences in ((SHORT, 1), (LONG, 1), (SHORT, 3)):
        model = build_model(spec, open_weights(path), max_context=context, sequences=sequences, dtype=torch.bfloat16)
        allocated = _allocated_kv_bytes(model)
        assert allocated > 0
        assert allocated == sequences * spec.kv_bytes(context, bytes_per_element=2)
        if context == SHORT:  # no window bites: every layer holds every token
            assert allocated / context == sequences * spec.kv_bytes_per_token(bytes_per_element=2)


def test_gpt_oss_sliding_layers_hold_their_window_and_the_rewind_margin(models):
    spec = inspect_model(models("gpt_oss", "hf")).spec
    window, block = spec.sliding_window, KV_BLOCK_TOKENS
    # The window before a call's first token, and the last window + rewind positions, each
    # starting anywhere inside a block.
    reads = -(-(window - 1) // block) + 1
    keeps = -(-(window + SLIDING_REWIND_TOKENS) // block) + 1
    ring = (reads + keeps) * block
    assert spec.sliding_layers == (0, 2) and ring < LONG
    assert [spec.kv_tokens(i, LONG) for i in range(spec.num_layers)] == [ring, LONG, ring]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_the_plan_names_and_counts_the_cache_the_engine_keeps_on_this_cpu(models, source):
    """The plan's cache type (budget.engine_numerics, from the hardware's features) and the
    engine's (model._cache_dtype, from its devices and the kernel set the extension runs) are
    worked out apart: on the CPU alone of whatever machine runs this (AMX or not), the same
    type and bytes. A bf16 checkpoint keeps bf16; its GGUF float16."""
    path = models("qwen3_moe", source)
    inspected = inspect_model(path)
    cpu, _ = detect_cpu()
    gib = 1 << 30
    machine = HardwareProfile(cpu=cpu, memory=Memory(total_bytes=64 * gib, available_bytes=64 * gib),
                              gpus=(), name="this machine")
    plan = make(inspected.spec, inspected.inventory, machine,
                Workload(context=SHORT, strategy="cpu-only", backend="engine"))
    model = build_model(inspected.spec, open_weights(path), max_context=SHORT)
    cache_dtype = next(m.k.dtype for m in model.modules() if type(m).__name__ == "PagedKV")
    assert plan.kv_cache_dtype == TORCH_DTYPES[str(cache_dtype).removeprefix("torch.")]
    assert plan.kv_cache_bytes == _allocated_kv_bytes(model)
