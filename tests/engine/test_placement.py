"""Splitting routed experts between the main device and the CPU changes nothing but where
they run; the activation counts are recorded and saved in the planner's format."""

from __future__ import annotations

import json
import random

import pytest
import torch

from hybridmoe.backend.engine.experts import HostExperts, ResidentExperts, cpu_experts_forward
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.plan.stats import ExpertStats
from tests.engine.conftest import FAMILY_NAMES, engine, load_config, relative_error, tokens


def _placements(model_layers: list[int], n_experts: int) -> dict[str, dict[int, list[int]]]:
    rng = random.Random(0)
    return {
        "none": {},
        "all": {layer: list(range(n_experts)) for layer in model_layers},
        "random_half": {layer: sorted(rng.sample(range(n_experts), n_experts // 2)) for layer in model_layers},
        # Each MoE layer different; the first gets none (a missing layer: all on the CPU).
        "per_layer": {layer: list(range(i * 3 % n_experts, n_experts, 2)) for i, layer in enumerate(model_layers[1:])},
    }


def _moe_layers(model) -> list[int]:
    return [m.layer for m in model.modules() if isinstance(m, MoE)]


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_outputs_do_not_depend_on_the_placement(family, checkpoints):
    path = checkpoints(family)
    base = engine(path)
    layers, n_experts = _moe_layers(base), base.stats.n_experts
    ids = tokens(16, seed=11)
    expected = base(ids)
    expected_decode = base(tokens(1, seed=12), 16)
    for name, placement in _placements(layers, n_experts).items():
        model = engine(path, placement=placement)
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            assert set(moe.main.ids) == set(placement.get(moe.layer, ())), name
            assert set(moe.main.ids) | set(moe.host.ids) == set(range(n_experts))
        assert relative_error(model(ids), expected) <= 1e-5, name
        assert relative_error(model(tokens(1, seed=12), 16), expected_decode) <= 1e-5, name


def test_cpu_experts_forward_is_the_partial_sum_over_cpu_experts(checkpoints):
    """The reference CPU path on its own: the main half plus the CPU half is the whole."""
    # On the CPU whatever the machine has: the inputs below are CPU tensors.
    model = engine(checkpoints("qwen3_moe"), placement={1: [0, 2, 4, 6]}, device="cpu")
    moe = next(m for m in model.modules() if isinstance(m, MoE) and m.layer == 1)
    assert isinstance(moe.main, ResidentExperts) and isinstance(moe.host, HostExperts)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    ids, weights = moe.router(x)
    cpu = cpu_experts_forward(x, ids, weights, moe.host)
    assert cpu.dtype == torch.float32 and cpu.shape == x.shape
    # Tokens routed only to main-device experts get nothing from the CPU half.
    on_cpu = torch.isin(ids, torch.tensor(moe.host.ids)).any(dim=1)
    assert torch.all(cpu[~on_cpu] == 0)
    all_cpu = engine(checkpoints("qwen3_moe"), device="cpu")
    moe_all = next(m for m in all_cpu.modules() if isinstance(m, MoE) and m.layer == 1)
    whole = cpu_experts_forward(x, ids, weights, moe_all.host)
    from hybridmoe.backend.engine.experts import experts_forward

    assert relative_error(cpu + experts_forward(x, ids, weights, moe.main), whole) < 1e-6
    # Ids the group does not hold (and -1, "no expert") are skipped.
    masked = torch.where(torch.isin(ids, torch.tensor(moe.host.ids)), ids, torch.full_like(ids, -1))
    assert torch.equal(cpu_experts_forward(x, masked, weights, moe.host), cpu)


def test_activation_counts_and_main_share(checkpoints, tmp_path):
    path = checkpoints("deepseek_v3")
    config = load_config(path)
    k, n_experts = config["num_experts_per_tok"], config["n_routed_experts"]
    placement = {1: [0, 1, 2, 3], 2: [5]}
    model = engine(path, placement=placement, name="tiny-deepseek")
    model(tokens(10), 0)
    model(tokens(3, seed=2), 10)
    stats = model.stats
    assert stats.tokens == 13
    assert sorted(stats.counts) == [1, 2]  # layer 0 is dense
    for counts in stats.counts.values():
        assert int(counts.sum()) == 13 * k
    share = stats.main_share()
    on_main = sum(int(stats.counts[layer][ids].sum()) for layer, ids in placement.items())
    assert share == pytest.approx(on_main / (2 * 13 * k))

    out = tmp_path / "stats.json"
    stats.save(out)
    saved = json.loads(out.read_text())
    assert saved["model"] == "tiny-deepseek" and saved["tokens"] == 13 and saved["n_experts"] == n_experts
    assert saved["layers"] == {"1": stats.counts[1].tolist(), "2": stats.counts[2].tolist()}
    loaded = ExpertStats.load(out)  # what the planner's `frequency` placement reads
    assert loaded.layers[1] == stats.counts[1].tolist()
    assert stats.to_dict()["main_share"] == share

    assert engine(path).stats.main_share() is None  # nothing recorded yet
    everything = engine(path, placement={1: range(n_experts), 2: range(n_experts)})
    everything(tokens(4), 0)
    assert everything.stats.main_share() == 1.0
    nothing = engine(path)
    nothing(tokens(4), 0)
    assert nothing.stats.main_share() == 0.0


def test_a_placement_naming_a_missing_expert_is_refused(checkpoints):
    with pytest.raises(ValueError, match="layer 1"):
        engine(checkpoints("qwen3_moe"), placement={1: [0, 8]})


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_native_cpu_experts_in_the_model(family, checkpoints, monkeypatch):
    """With the native kernels on (float32 checkpoints: their exact fp32 path), the model
    gives the reference's logits, prefill and decode, whatever the split."""
    from hybridmoe.backend.engine import native_experts, native_kernels

    if not native_kernels.available():
        pytest.skip("native extension not built")
    path = checkpoints(family)
    ids = tokens(16, seed=11)
    reference = engine(path)
    expected = torch.cat([reference(ids[:, :12], 0)] + [reference(ids[:, t : t + 1], t) for t in range(12, 16)], dim=1)
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "1")
    for placement in ({}, {_moe_layers(reference)[-1]: [1, 2, 3]}):
        model = engine(path, placement=placement)
        got = torch.cat([model(ids[:, :12], 0)] + [model(ids[:, t : t + 1], t) for t in range(12, 16)], dim=1)
        assert relative_error(got, expected) < 1e-4
        host = next(m.host for m in model.modules() if isinstance(m, MoE))
        assert native_experts.unsupported_reason(host) is None or family == "gpt_oss"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_cuda_main_device_with_cpu_experts(family, checkpoints):
    """Attention, routers, shared and main-device experts on the GPU, the rest on the CPU."""
    path = checkpoints(family)
    ids = tokens(16, seed=11)
    expected = engine(path, device="cpu")(ids)
    layers = _moe_layers(engine(path, device="cpu"))
    for placement in ({}, {layer: [0, 1, 2, 3] for layer in layers}):
        model = engine(path, placement=placement, device="cuda")
        prefill = model(ids[:, :12], 0)
        decode = [model(ids[:, t : t + 1], t) for t in range(12, 16)]
        got = torch.cat([prefill] + decode, dim=1).cpu()
        assert relative_error(got, expected) < 1e-4
