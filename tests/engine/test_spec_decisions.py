"""The model spec decides, once, which layers are dense, which slide and by what window, and
how the router chooses; the engine builds exactly that, and both match transformers for
configs that leave the choice to transformers' defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridmoe.backend.engine.attention import Attention
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.engine.routing import SigmoidGroupedTopK
from hybridmoe.backend.models.families import spec_from_config
from tests.engine.conftest import engine, load_config, make_checkpoint


def _checkpoint_without(tmp_path: Path, family: str, drop: tuple[str, ...], **overrides) -> tuple[Path, dict]:
    """A tiny checkpoint whose config.json lacks `drop` (transformers' defaults then apply)."""
    path = make_checkpoint(family, tmp_path / family, **overrides)
    config = {k: v for k, v in load_config(path).items() if k not in drop}
    (path / "config.json").write_text(json.dumps(config))
    return path, config


def _transformers_moe_layers(path: Path) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def _engine_moe_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]


def _engine_windows(model) -> list[int | None]:
    return [layer.attn.cache.window for layer in model.layers if isinstance(layer.attn, Attention)]


def test_deepseek_v3_without_first_k_dense_replace_has_three_dense_layers(tmp_path):
    # DeepseekV3Config defaults to 3 dense leading layers (and one shared expert).
    path, config = _checkpoint_without(tmp_path, "deepseek_v3", ("first_k_dense_replace", "n_shared_experts"),
                                       first_k_dense_replace=3, n_shared_experts=1, num_hidden_layers=4)
    assert "first_k_dense_replace" not in json.loads((path / "config.json").read_text())
    spec = spec_from_config(config, "tiny")
    expected = _transformers_moe_layers(path)
    assert expected == [3]
    assert list(spec.moe_layers) == expected
    assert _engine_moe_layers(engine(path, config)) == expected
    assert spec.n_shared_experts == 1


def test_deepseek_v2_without_first_k_dense_replace_has_no_dense_layer(tmp_path):
    path, config = _checkpoint_without(tmp_path, "deepseek_v2", ("first_k_dense_replace",), first_k_dense_replace=0)
    spec = spec_from_config(config, "tiny")
    expected = _transformers_moe_layers(path)
    assert expected == [0, 1, 2]
    assert list(spec.moe_layers) == expected
    assert _engine_moe_layers(engine(path, config)) == expected


def test_glm4_moe_without_first_k_dense_replace_has_one_dense_layer(tmp_path):
    # Glm4MoeConfig defaults: one dense leading layer, one shared expert.
    path, config = _checkpoint_without(tmp_path, "glm4_moe", ("first_k_dense_replace", "n_shared_experts"),
                                       first_k_dense_replace=1, n_shared_experts=1)
    spec = spec_from_config(config, "tiny")
    expected = _transformers_moe_layers(path)
    assert expected == [1, 2]
    assert list(spec.moe_layers) == expected
    model = engine(path, config)
    assert _engine_moe_layers(model) == expected
    assert spec.n_shared_experts == 1 and model.layers[1].ffn.shared is not None


def test_deepseek_v3_routing_defaults_are_transformers(tmp_path):
    import transformers

    path, config = _checkpoint_without(
        tmp_path, "deepseek_v3", ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor"),
        n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    reference = transformers.DeepseekV3Config(**config)
    routing = spec_from_config(config, "tiny").routing
    assert (routing.scoring, routing.method) == ("sigmoid", "noaux_tc")
    assert (routing.n_group, routing.topk_group) == (reference.n_group, reference.topk_group) == (8, 4)
    assert routing.normalize is reference.norm_topk_prob is True
    assert routing.scaling == reference.routed_scaling_factor == 2.5
    router = engine(path, config).layers[1].ffn.router
    assert isinstance(router, SigmoidGroupedTopK)
    assert (router.n_group, router.topk_group, router.normalize, router.scaling) == (8, 4, True, 2.5)


# (use_sliding_window, max_window_layers) with sliding_window 4 in a 3-layer model.
SLIDING_CASES = [(False, 28), (True, 28), (True, 2), (True, 1), (True, 0)]


def _expected_windows(family: str, config: dict) -> list[int | None]:
    """transformers' rule, from its own configuration class."""
    import transformers

    if family == "qwen2_moe":
        c = transformers.Qwen2MoeConfig(**config)
        return [c.sliding_window if t == "sliding_attention" and c.sliding_window else None for t in c.layer_types]
    c = transformers.Qwen3MoeConfig(**config)
    return [c.sliding_window] * c.num_hidden_layers


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize(("use_sliding_window", "max_window_layers"), SLIDING_CASES)
def test_qwen_sliding_layers_follow_transformers(tmp_path, family, use_sliding_window, max_window_layers):
    # No layer_types in config.json (the published configs): the rule derives them.
    path, config = _checkpoint_without(tmp_path, family, ("layer_types",), use_sliding_window=use_sliding_window,
                                       sliding_window=4, max_window_layers=max_window_layers)
    config.update(use_sliding_window=use_sliding_window, sliding_window=4, max_window_layers=max_window_layers)
    expected = _expected_windows(family, config)
    spec = spec_from_config(config, "tiny")
    assert [spec.window_of(i) for i in range(spec.num_layers)] == expected
    assert _engine_windows(engine(path, config, max_context=64)) == expected


def test_qwen2_sliding_layers_from_layer_types(tmp_path):
    config = {**load_config(make_checkpoint("qwen2_moe", tmp_path / "q")), "use_sliding_window": True,
              "sliding_window": 4, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    spec = spec_from_config(config, "tiny")
    assert spec.sliding_layers == (1,) and spec.sliding_window == 4
    assert _engine_windows(engine(tmp_path / "q", config)) == [None, 4, None]
