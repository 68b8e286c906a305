"""DeepSeek-V2's group-limited routing ("group_limited_greedy": only the topk_group groups
whose best expert scores highest are eligible), from a Hugging Face config and from a GGUF,
which stores the groups (expert_group_count / expert_group_used_count) but no topk_method."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.engine.routing import SoftmaxGroupedGreedy
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.families.deepseek import config_from_gguf
from tests.engine.conftest import FAMILIES, _randomise

PROMPT = [5, 77, 123, 9, 250, 31, 64, 199, 12, 88, 140, 3]
STEPS = 12
# Top 3 of 8 experts in 4 groups of 2, from the best 2 groups: with k > topk_group the
# group limit changes the choice often (with k <= topk_group it never could).
GROUPED = dict(num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy")


def _router(n_group: int, topk_group: int) -> SoftmaxGroupedGreedy:
    # The identity as the router's matrix: a token's logits are the token itself.
    return SoftmaxGroupedGreedy(torch.eye(8), 3, n_group=n_group, topk_group=topk_group, normalize=False,
                                scaling=1.0)


def test_group_limited_greedy_chooses_only_in_the_best_groups():
    # Groups (0, 1), (2, 3), (4, 5), (6, 7); best experts 0, 2 and 4 lie in three groups.
    logits = torch.tensor([[3.0, 0.5, 2.9, 0.0, 2.8, 0.0, 0.0, 0.0]])
    greedy_ids, _ = _router(1, 1)(logits)  # "greedy": one group
    grouped_ids, grouped_weights = _router(4, 2)(logits)
    assert sorted(greedy_ids[0].tolist()) == [0, 2, 4]
    assert sorted(grouped_ids[0].tolist()) == [0, 1, 2]  # group (4, 5) is third: not eligible
    probs = logits.softmax(-1)[0]
    assert torch.allclose(grouped_weights[0], probs[grouped_ids[0]])


def _gguf_metadata(groups: int, used: int) -> dict:
    """The keys a DeepSeek-V2 GGUF holds (a softmax router), with `groups` expert groups."""
    a = "deepseek2"
    meta = {"general.architecture": a, f"{a}.block_count": 3, f"{a}.context_length": 4096,
            f"{a}.embedding_length": 64, f"{a}.feed_forward_length": 96, f"{a}.attention.head_count": 4,
            f"{a}.attention.head_count_kv": 1, f"{a}.attention.key_length": 40, f"{a}.attention.value_length": 32,
            f"{a}.attention.key_length_mla": 24, f"{a}.attention.value_length_mla": 12,
            f"{a}.attention.kv_lora_rank": 32, f"{a}.rope.dimension_count": 8, f"{a}.vocab_size": 256,
            f"{a}.leading_dense_block_count": 1, f"{a}.expert_count": 8, f"{a}.expert_used_count": 3,
            f"{a}.expert_shared_count": 2, f"{a}.expert_feed_forward_length": 24,
            f"{a}.expert_weights_scale": 1.5, f"{a}.expert_gating_func": 1}
    if groups > 1:
        meta.update({f"{a}.expert_group_count": groups, f"{a}.expert_group_used_count": used})
    return meta


def test_a_gguf_with_expert_groups_routes_within_the_best_groups():
    grouped = config_from_gguf(_gguf_metadata(8, 3), source="v2.gguf")
    assert (grouped["topk_method"], grouped["n_group"], grouped["topk_group"]) == ("group_limited_greedy", 8, 3)
    lite = config_from_gguf(_gguf_metadata(1, 1), source="v2-lite.gguf")  # V2-Lite: one group
    assert (lite["topk_method"], lite["n_group"]) == ("greedy", 1)


def _greedy(model, steps: int) -> list[int]:
    ids = list(PROMPT)
    for _ in range(steps):
        ids.append(int(model(torch.tensor(ids), 0)[-1].argmax()))
    return ids[len(PROMPT):]


def _tiny_v2(tmp_path_factory, routing: dict):
    """A tiny DeepSeek-V2 with ``routing``, saved in bf16 with a tokenizer, converted to a bf16
    GGUF by the project's converter; and the transformers model on the same (rounded) weights
    in float32."""
    import transformers

    from hybridmoe.backend.convert import to_gguf
    from tests.convert.conftest import CHATML, train_byte_level_bpe, write_tokenizer

    directory = tmp_path_factory.mktemp("deepseek_v2_grouped")
    tok = train_byte_level_bpe()
    cls_name, kwargs = FAMILIES["deepseek_v2"]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**kwargs, **routing, "vocab_size": tok.get_vocab_size(with_added_tokens=True),
                                 "bos_token_id": None, "eos_token_id": tok.token_to_id("<|im_end|>")})
    torch.manual_seed(0)
    model = cls(config)
    _randomise(model, 0)
    model.to(torch.bfloat16).save_pretrained(directory)
    write_tokenizer(directory, tok, {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False})
    (directory / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    gguf = to_gguf(directory, tmp_path_factory.mktemp("gguf") / "v2.gguf", "bf16")
    return model.to(torch.float32).eval(), gguf


@pytest.fixture(scope="module")
def grouped_v2(tmp_path_factory):
    return _tiny_v2(tmp_path_factory, GROUPED)


def test_the_engine_on_a_grouped_v2_gguf_decodes_as_transformers(grouped_v2):
    reference, gguf = grouped_v2
    with torch.no_grad():
        expected = _greedy(lambda ids, _: reference(ids[None]).logits[0], STEPS)
    config = inspect_model(gguf).spec.config
    assert config["topk_method"] == "group_limited_greedy"
    engine = build_model(config, open_weights(gguf), max_context=64, dtype=torch.float32)
    assert _greedy(engine, STEPS) == expected
    # The group limit decides tokens on this model: routed over all experts, it decodes
    # something else (so the comparison above would catch the limit being lost).
    plain = build_model({**config, "topk_method": "greedy"}, open_weights(gguf), max_context=64, dtype=torch.float32)
    assert _greedy(plain, STEPS) != expected


def test_a_v2_that_routes_greedily_keeps_its_groups_out_of_the_gguf(tmp_path_factory):
    # transformers ignores n_group under topk_method "greedy"; a GGUF has no topk_method, so a
    # group count written there would make llama.cpp and the engine limit the groups.
    _, gguf = _tiny_v2(tmp_path_factory, {**GROUPED, "topk_method": "greedy"})
    from hybridmoe.backend.models.gguf_reader import read_metadata

    keys = read_metadata(gguf)
    assert "deepseek2.expert_group_count" not in keys
    assert inspect_model(gguf).spec.config["topk_method"] == "greedy"
