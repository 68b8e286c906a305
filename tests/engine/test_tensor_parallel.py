"""Tensor parallelism: every layer split across cards (here: CPU devices in one process), each
card with its heads, its MLP columns, its rows of the head and its dealt GPU experts; the
same greedy tokens as the model on one device.

Numerics: the cards' partial outputs are summed in float32 in another order than one device
sums them, so the models compute in float32 here (a difference of ~1e-6 relative, asserted)
and tokens are compared exactly. Against the one-device model the layer-by-layer path is used
(``native_decode`` off), which is the path a split model takes. In bf16 the cards' partial
sums are rounded before they are added (as a multi-process all-reduce of bf16 activations
also does): ~0.5 % relative, enough to flip near-tied tokens of these random tiny models.
"""

from __future__ import annotations

import pytest
import torch

from hybridmoe.backend.engine.hybrid import HybridOptions
from hybridmoe.backend.engine.mla import MLAttention
from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.engine.plan_layout import build_kwargs
from hybridmoe.backend.engine.tensor_parallel import HeadShards, Shards, part
from hybridmoe.backend.errors import UnsupportedModelError
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.hardware.presets import preset
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from tests.convert.conftest import checkpoints, converted  # noqa: F401 - fixtures: tiny checkpoints and GGUFs
from tests.engine.conftest import greedy, relative_error, tokens

FAMILIES = ["qwen3_moe", "deepseek_v3", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss"]
PLACED = (1, 4, 6)  # "GPU" experts of every MoE layer, dealt to the cards by id


def _one(spec, path, placed):
    model = build_model(spec, open_weights(path), max_context=64, dtype=torch.float32,
                        placement={layer: placed for layer in spec.moe_layers})
    model.native_decode = False
    return model


def _split(spec, path, cards, placed, **kwargs):
    dealt = [("cpu", {layer: [e for e in placed if e % cards == c] for layer in spec.moe_layers})
             for c in range(cards)]
    return build_model(spec, open_weights(path), max_context=64, dtype=torch.float32, tensor_parallel=dealt, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_split_model_gives_the_tokens_of_one_device(family, checkpoints):  # noqa: F811 - the fixture
    path = checkpoints(family).path
    spec = inspect_model(path).spec
    prompt = tokens(9, seed=3)
    for placed in ((), PLACED):
        one = _one(spec, path, placed)
        want, want_logits = greedy(one, prompt, 8), one(prompt)
        for cards in (2, 4):
            split = _split(spec, path, cards, placed)
            assert relative_error(split(prompt), want_logits) < 1e-5, (family, placed, cards)
            assert greedy(split, prompt, 8) == want, (family, placed, cards)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_quantized_files_split_in_their_stored_form(family, converted):  # noqa: F811 - the fixture
    """A Q8_0 GGUF over two cards: row slices and 32-column slices keep their blocks, so each
    card's projections run the same native kernels on the same bytes."""
    path = converted(family, "q8_0")
    spec = inspect_model(path).spec
    prompt = tokens(9, seed=3)
    one = _one(spec, path, PLACED)
    split = _split(spec, path, 2, PLACED)
    assert relative_error(split(prompt), one(prompt)) < 1e-5
    assert greedy(split, prompt, 8) == greedy(one, prompt, 8)


def test_what_each_card_holds(checkpoints):  # noqa: F811 - the fixture
    path = checkpoints("deepseek_v3").path
    spec = inspect_model(path).spec
    split = _split(spec, path, 2, PLACED)
    assert isinstance(split.lm_head, HeadShards) and split.cards == [torch.device("cpu")] * 2
    vocab_rows = [p.weight.shape[0] if hasattr(p, "weight") else p.out_features for p in split.lm_head.parts]
    assert sum(vocab_rows) == spec.vocab_size
    for i, layer in enumerate(split.layers):
        assert isinstance(layer.attn, Shards) and isinstance(layer.ffn, Shards)
        # MLA: each card its half of the heads, and the whole latent cache.
        for attn in layer.attn.parts:
            assert isinstance(attn, MLAttention) and attn.n_heads == spec.num_attention_heads // 2
        if i in spec.moe_layers:
            first, second = layer.ffn.parts
            assert isinstance(first, MoE) and first.main.ids == (4, 6) and second.main.ids == (1,)
            # The CPU experts run once, with the first card's share; each token is counted once.
            assert len(first.host) == spec.n_routed_experts - 3 and not len(second.host)
            assert first.recorder is split.stats and second.recorder is None
    assert part(96, 0, 2, 32) == (0, 32) and part(96, 1, 2, 32) == (32, 96)  # whole 32-column blocks
    assert part(10, 3, 4) == (7, 10)


def test_the_scheduler_runs_a_split_model(checkpoints):  # noqa: F811 - the fixture
    """With the hybrid scheduler (what a GPU main device gets): the first card's CPU experts on
    its worker thread while the cards compute theirs; the same tokens."""
    path = checkpoints("qwen3_moe").path
    spec = inspect_model(path).spec
    prompt = tokens(9, seed=4)
    split = _split(spec, path, 2, PLACED, hybrid=HybridOptions(stream_min_tokens=None))
    assert greedy(split, prompt, 6) == greedy(_one(spec, path, PLACED), prompt, 6)


def test_a_whole_projection_qk_norm_is_refused(checkpoints):  # noqa: F811 - the fixture
    path = checkpoints("olmoe").path
    with pytest.raises(UnsupportedModelError, match="over all heads"):
        _split(inspect_model(path).spec, path, 2, ())


def test_a_tensor_parallel_plan_gives_each_card_its_experts():
    kimi = inspect_model(__import__("pathlib").Path(__file__).resolve().parents[2]
                         / "assets" / "configs" / "moonshotai__Kimi-K2.6.json")
    plan = make(kimi.spec, kimi.inventory, preset("4x RTX PRO 6000"), Workload(context=32768, users=4, parallel="tp"))
    cards = [d for d in plan.devices if d.kind == "gpu"]
    for layer, ids in plan.gpu_experts.items():
        dealt = [e for d in cards for e in d.experts[layer]]
        assert tuple(dealt) == ids  # each id on exactly one card, in order
    assert all(d.used_bytes <= d.budget_bytes for d in cards)
    assert sum(len(ids) for ids in cards[0].experts.values()) * plan.gpu_bytes_per_expert[1] == \
        cards[0].bytes_by_class["routed_experts"]
    assert build_kwargs(plan, "cpu") == {"resident_form": "int4", "placement": plan.placement()}
    if torch.cuda.device_count() >= 4:
        kwargs = build_kwargs(plan)
        assert [d for d, _ in kwargs["tensor_parallel"]] == [d.torch_device for d in cards]
