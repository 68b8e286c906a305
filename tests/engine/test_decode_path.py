"""On the tiny models of every family: the path the model names is the one its decode step
runs, and the family's descriptions from its config (what ``plan`` names the path from) are
the ones the built modules give, so that the plan's path is the engine's. The choice itself,
without a model: tests/plan/test_decode_path.py."""

from __future__ import annotations

import pytest

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.hardware.profile import CPU, HardwareProfile, Memory
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.families import family_by_name
from hybridmoe.backend.models.layer_description import Loading
from hybridmoe.backend.plan import Workload, make
from hybridmoe.backend.plan.planned_decode import planned_decode
from tests.engine.conftest import FAMILY_NAMES, engine

# What each family's tiny fp32 checkpoint decodes with (tests/engine/conftest.py): OLMoE clips
# q/k/v, DeepSeek-V2 routes with a router the native kernels do not have, GPT-OSS has sliding
# windows and sinks and its float experts in transformers' layout are not read natively.
EXPECTED = {
    "qwen3_moe": "decode: native chain, all 3 layers",
    "qwen2_moe": "decode: native chain, all 3 layers",
    "mixtral": "decode: native chain, all 3 layers",
    "glm4_moe": "decode: native chain, all 3 layers",
    "deepseek_v3": "decode: native chain, all 3 layers",
    "deepseek_v2": ("decode: per-call path for layer 0; per-call path, feed-forward in PyTorch for layers 1-2: "
                    "feed-forward: the softmax_group_greedy router; not the native chain: layer 1: the "
                    "softmax_group_greedy router"),
    "olmoe": ("decode: per-call path, attention in PyTorch, all 3 layers: attention: q/k/v clipping; not the native "
              "chain: layer 0: q/k/v clipping"),
    "gpt_oss": ("decode: PyTorch modules, all 3 layers: attention: sliding window, attention sinks; feed-forward: "
                "float GPT-OSS experts"),
}


@pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_family_names_the_path_its_decode_step_runs(family, checkpoints):
    model = engine(checkpoints(family), sliding_rewind=2)
    plan = model.decode_plan()
    assert plan.summary().startswith(EXPECTED[family])
    step = model._native_decode()
    if not plan.native:
        assert step is None
        return
    assert (step.chain is not None) == plan.chain
    for s, path in zip(step.layers, plan.layers):
        assert (s.attn is None) == (path.attention is not None) and (s.ffn is None) == (path.ffn is not None)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_the_family_describes_from_its_config_what_the_engine_loads(family, checkpoints):
    model = engine(checkpoints(family), sliding_rewind=2)
    loading = Loading(main_device="cpu", context=model.max_context, checkpoint="safetensors",
                      cache_dtype=str(model.dtype).removeprefix("torch."), projections_native=native_kernels.enabled())
    assert family_by_name(model.spec.family).describe_layers(model.spec, loading) == tuple(model.describe())


# A CPU-only machine with room for any tiny model.
HOST = HardwareProfile(cpu=CPU(model_name="test CPU", arch="x86_64", sockets=1, physical_cores=8, threads=16,
                               features=("avx2", "fma")),
                       memory=Memory(total_bytes=64 << 30, available_bytes=64 << 30,
                                     bandwidth_theoretical_bytes_per_s=100e9),
                       described=True, name="test box")


@pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_plan_names_the_path_before_the_load_that_the_engine_takes(family, checkpoints):
    path = checkpoints(family)
    model = inspect_model(path)
    plan = make(model.spec, model.inventory, HOST, Workload(context=64))
    planned = planned_decode(model.spec, model.inventory, plan, model.kind)
    assert planned.summary() == engine(path, sliding_rewind=2).decode_plan().summary()
