"""ModelSpec from every shared config.json, and from GGUF metadata as llama.cpp writes it."""

import copy
import json

import pytest

from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models.families import spec_from_config, spec_from_gguf
from hybridmoe.backend.models.gguf_files import GGUFArray

from .conftest import CONFIGS, shared_config

SUPPORTED = {
    "moonshotai__Kimi-K2.6": "deepseek",
    "moonshotai__Kimi-K2.5": "deepseek",
    "moonshotai__Kimi-K2-Instruct": "deepseek",
    "deepseek-ai__DeepSeek-V3": "deepseek",
    "deepseek-ai__DeepSeek-R1": "deepseek",
    "deepseek-ai__DeepSeek-V2-Lite": "deepseek",
    "Qwen__Qwen3-30B-A3B": "qwen3_moe",
    "Qwen__Qwen3-235B-A22B": "qwen3_moe",
    "Qwen__Qwen3-Coder-480B-A35B-Instruct": "qwen3_moe",
    "Qwen__Qwen1.5-MoE-A2.7B": "qwen2_moe",
    "mistralai__Mixtral-8x7B-v0.1": "mixtral",
    "mistralai__Mixtral-8x22B-v0.1": "mixtral",
    "allenai__OLMoE-1B-7B-0924": "olmoe",
    "openai__gpt-oss-20b": "gpt_oss",
    "openai__gpt-oss-120b": "gpt_oss",
    "zai-org__GLM-4.5": "glm4_moe",
    "zai-org__GLM-4.5-Air": "glm4_moe",
}


def spec(name):
    return spec_from_config(shared_config(name), name, source=f"{name}.json")


def test_every_shipped_config_is_covered():
    names = {p.stem for p in CONFIGS.glob("*.json")}
    assert names == set(SUPPORTED)


@pytest.mark.parametrize("name, family", sorted(SUPPORTED.items()))
def test_sane_spec(name, family):
    s = spec(name)
    assert s.family == family
    assert s.num_layers > 0 and s.hidden_size > 0 and s.vocab_size > 1000
    assert set(s.moe_layers) | set(s.dense_layers) == set(range(s.num_layers))
    assert not set(s.moe_layers) & set(s.dense_layers)
    assert 1 <= s.experts_per_token <= s.n_routed_experts
    assert s.params_per_expert == 3 * s.hidden_size * s.moe_intermediate_size
    assert s.kv_bytes_per_token() > 0
    assert s.max_context >= 4096
    assert s.attention == ("mla" if family == "deepseek" else "gqa")
    assert s.config["hidden_size"] == s.hidden_size  # the text config, in HF keys
    assert json.dumps(s.to_dict())  # serialisable for the plan


def test_kimi_k26():
    s = spec("moonshotai__Kimi-K2.6")
    assert s.architecture == "KimiK25ForConditionalGeneration"
    assert s.params_per_expert == 3 * 7168 * 2048 == 44_040_192
    assert s.n_moe_layers == 60 and s.moe_layers == tuple(range(1, 61)) and s.dense_layers == (0,)
    assert s.n_routed_experts == 384 and s.experts_per_token == 8
    assert s.n_shared_experts == 1 and s.shared_intermediate_size == 2048
    assert (s.expert_format, s.other_format) == ("int4_g32", "bf16")
    assert s.kv_bytes_per_token() == (512 + 64) * 61 * 2 == 70_272
    assert s.kv_bytes(32768) / 2**30 == pytest.approx(2.14, abs=0.01)
    assert s.kv_bytes_per_token(1) == 70_272 / 2  # an 8-bit cache halves it
    assert s.has_vision and s.vision_params > 0
    assert s.n_mtp_layers == 0
    assert s.config["model_type"] == "kimi_k2"  # the language model's config, not the wrapper's


def test_kimi_k25_older_ignore_list_gives_the_same_formats():
    s = spec("moonshotai__Kimi-K2.5")
    assert (s.expert_format, s.other_format) == ("int4_g32", "bf16")


def test_deepseek_v3_fp8():
    s = spec("deepseek-ai__DeepSeek-V3")
    assert (s.expert_format, s.other_format) == ("fp8_block", "fp8_block")
    assert s.num_layers == 61 and s.n_mtp_layers == 1
    assert s.dense_layers == (0, 1, 2) and s.n_moe_layers == 58
    assert s.n_routed_experts == 256 and s.q_lora_rank == 1536
    assert s.kv_bytes_per_token() == 70_272


def test_deepseek_v2_lite_has_no_q_lora():
    s = spec("deepseek-ai__DeepSeek-V2-Lite")
    assert s.q_lora_rank is None and s.n_shared_experts == 2
    assert s.shared_intermediate_size == 2 * 1408
    assert s.moe_layers == tuple(range(1, 27))


def test_qwen3_30b_a3b():
    s = spec("Qwen__Qwen3-30B-A3B")
    assert s.num_layers == 48 and s.n_moe_layers == 48
    assert s.n_routed_experts == 128 and s.experts_per_token == 8
    assert s.num_kv_heads == 4 and s.head_dim == 128 and s.num_attention_heads == 32
    assert s.kv_bytes_per_token() == 2 * 4 * 128 * 48 * 2
    assert s.n_shared_experts == 0 and not s.sliding_layers


def test_qwen3_coder_shared_expert_size_zero_means_none():
    assert spec("Qwen__Qwen3-Coder-480B-A35B-Instruct").n_shared_experts == 0


def test_qwen2_moe_shared_expert():
    s = spec("Qwen__Qwen1.5-MoE-A2.7B")
    assert s.n_shared_experts == 1 and s.shared_intermediate_size == 5632
    assert not s.sliding_layers  # use_sliding_window is false


def test_qwen_sparse_step_and_mlp_only_layers():
    c = shared_config("Qwen__Qwen3-30B-A3B")
    c.update(num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[3])
    s = spec_from_config(c, "x")
    assert s.moe_layers == (1, 5, 7)
    assert s.dense_layers == (0, 2, 3, 4, 6)


def test_qwen_sliding_window_from_max_window_layers():
    c = shared_config("Qwen__Qwen1.5-MoE-A2.7B")
    c.update(use_sliding_window=True, max_window_layers=20, sliding_window=4096)
    s = spec_from_config(c, "x")
    # transformers 5's Qwen2MoeConfig: every other layer (0, 2, ...) below max_window_layers.
    assert s.sliding_window == 4096 and s.sliding_layers == tuple(range(0, 20, 2))


def test_deepseek_moe_layer_freq():
    c = shared_config("deepseek-ai__DeepSeek-V2-Lite")
    c.update(num_hidden_layers=8, first_k_dense_replace=2, moe_layer_freq=3)
    assert spec_from_config(c, "x").moe_layers == (3, 6)


def test_gpt_oss_sliding_layers():
    s = spec("openai__gpt-oss-20b")
    assert (s.expert_format, s.other_format) == ("mxfp4", "bf16")
    assert s.sliding_window == 128 and s.sliding_layers == tuple(range(0, 24, 2))
    assert s.n_routed_experts == 32 and s.experts_per_token == 4 and s.moe_intermediate_size == 2880
    per_layer = 2 * 8 * 64 * 2
    # In whole blocks of 64 positions (docs/sizing.md §2): a full layer the context, a sliding
    # layer the window before a call (3 blocks) and its window plus the engine's rewind margin
    # after it (1,152 positions: 19 blocks).
    assert s.kv_bytes(100_000) == 12 * per_layer * 1563 * 64 + 12 * per_layer * (3 + 19) * 64
    assert spec("openai__gpt-oss-120b").n_routed_experts == 128


def test_glm45_nextn_layer_is_not_a_decoder_layer():
    s = spec("zai-org__GLM-4.5")
    assert s.num_layers == 92 and s.n_mtp_layers == 1
    assert s.dense_layers == (0, 1, 2) and s.n_moe_layers == 89
    assert s.num_kv_heads == 8 and s.head_dim == 128
    air = spec("zai-org__GLM-4.5-Air")
    assert air.dense_layers == (0,) and air.n_shared_experts == 1 and air.shared_intermediate_size == 1408


def test_mixtral_and_olmoe_all_layers_moe():
    m = spec("mistralai__Mixtral-8x7B-v0.1")
    assert m.moe_layers == tuple(range(32)) and m.n_routed_experts == 8 and m.experts_per_token == 2
    assert m.moe_intermediate_size == 14336 and m.head_dim == 128
    o = spec("allenai__OLMoE-1B-7B-0924")
    assert o.moe_layers == tuple(range(16)) and o.n_routed_experts == 64


def test_transformers5_config_names_are_accepted():
    # transformers 5 saves Qwen3-MoE configs with num_local_experts and dtype.
    c = shared_config("Qwen__Qwen3-30B-A3B")
    c["num_local_experts"] = c.pop("num_experts")
    c["dtype"] = c.pop("torch_dtype")
    assert spec_from_config(c, "x").n_routed_experts == 128


def _as_transformers5_saves_it(config: dict) -> dict:
    """A hub config as transformers 5 writes it back: num_local_experts for num_experts,
    dtype for torch_dtype, and rope_theta/rope_scaling folded into rope_parameters."""
    c = copy.deepcopy(config)
    c["num_local_experts"] = c.pop("num_experts")
    c["dtype"] = c.pop("torch_dtype")
    rope = {"rope_type": "default", "rope_theta": c.pop("rope_theta")}
    rope.update(c.pop("rope_scaling", None) or {})
    c["rope_parameters"] = rope
    return c


@pytest.mark.parametrize("name", ["Qwen__Qwen3-30B-A3B", "Qwen__Qwen1.5-MoE-A2.7B", "allenai__OLMoE-1B-7B-0924"])
def test_transformers5_saved_config_gives_the_same_spec(name):
    hub = shared_config(name)
    t5 = _as_transformers5_saves_it(hub)
    assert "num_experts" not in t5 and "rope_theta" not in t5 and "torch_dtype" not in t5
    assert spec_from_config(t5, name).to_dict() == spec(name).to_dict()


def test_minimax_m2_is_unsupported_with_a_clear_message():
    with pytest.raises(UnsupportedModelError) as err:
        spec_from_config(shared_config("MiniMaxAI__MiniMax-M2"), "m", source="MiniMax-M2/config.json")
    text = str(err.value)
    assert "MiniMaxM2ForCausalLM" in text and "MiniMax-M2/config.json" in text
    assert "Qwen3MoeForCausalLM" in text  # names what is supported


def test_unknown_architecture():
    with pytest.raises(UnsupportedModelError, match="FooForCausalLM"):
        spec_from_config({"architectures": ["FooForCausalLM"], "model_type": "foo"}, "x", source="c.json")


def test_missing_field_names_field_and_file():
    c = shared_config("Qwen__Qwen3-30B-A3B")
    del c["num_experts_per_tok"]
    with pytest.raises(ModelError) as err:
        spec_from_config(c, "x", source="/models/qwen/config.json")
    assert "num_experts_per_tok" in str(err.value) and "/models/qwen/config.json" in str(err.value)
    assert err.value.hint


def test_wrong_type_and_impossible_routing():
    c = shared_config("Qwen__Qwen3-30B-A3B")
    c["hidden_size"] = "2048"
    with pytest.raises(ModelError, match="'hidden_size'.*whole number"):
        spec_from_config(c, "x")
    c = shared_config("Qwen__Qwen3-30B-A3B")
    c["num_experts_per_tok"] = 200
    with pytest.raises(ModelError, match="200 of 128"):
        spec_from_config(c, "x")


def test_unsupported_quantization():
    c = shared_config("Qwen__Qwen3-30B-A3B")
    c["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(UnsupportedModelError, match="awq"):
        spec_from_config(c, "x")
    c = shared_config("deepseek-ai__DeepSeek-V3")
    c["quantization_config"]["weight_block_size"] = [64, 64]
    with pytest.raises(UnsupportedModelError, match="128x128"):
        spec_from_config(c, "x")


# --- GGUF metadata, as llama.cpp's converter writes it ------------------------------------

def _gguf(arch, vocab, **keys):
    meta = {"general.architecture": arch, "tokenizer.ggml.tokens": GGUFArray("string", vocab)}
    meta.update({f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()})
    return meta


KIMI_K2 = _gguf("deepseek2", 163840, block_count=61, context_length=131072, embedding_length=7168,
                feed_forward_length=18432, attention__head_count=64, attention__head_count_kv=1,
                attention__key_length=576, attention__value_length=512, attention__key_length_mla=192,
                attention__value_length_mla=128, rope__dimension_count=64, rope__freq_base=50000.0,
                attention__q_lora_rank=1536, attention__kv_lora_rank=512, leading_dense_block_count=1,
                expert_count=384, expert_used_count=8, expert_shared_count=1,
                expert_feed_forward_length=2048, expert_weights_scale=2.827, expert_weights_norm=True,
                expert_gating_func=2, rope__scaling__type="yarn", rope__scaling__factor=32.0,
                rope__scaling__original_context_length=4096, rope__scaling__yarn_log_multiplier=0.1)

GGUF_CASES = {
    "moonshotai__Kimi-K2-Instruct": KIMI_K2,
    "Qwen__Qwen3-30B-A3B": _gguf("qwen3moe", 151936, block_count=48, context_length=40960,
                                 embedding_length=2048, feed_forward_length=6144, attention__head_count=32,
                                 attention__head_count_kv=4, attention__key_length=128,
                                 attention__value_length=128, expert_count=128, expert_used_count=8,
                                 expert_feed_forward_length=768, rope__freq_base=1e6),
    "Qwen__Qwen1.5-MoE-A2.7B": _gguf("qwen2moe", 151936, block_count=24, context_length=8192,
                                     embedding_length=2048, feed_forward_length=5632,
                                     attention__head_count=16, attention__head_count_kv=16, expert_count=60,
                                     expert_used_count=4, expert_feed_forward_length=1408,
                                     expert_shared_feed_forward_length=5632),
    "mistralai__Mixtral-8x7B-v0.1": _gguf("llama", 32000, block_count=32, context_length=32768,
                                          embedding_length=4096, feed_forward_length=14336,
                                          attention__head_count=32, attention__head_count_kv=8,
                                          rope__dimension_count=128, expert_count=8, expert_used_count=2),
    "allenai__OLMoE-1B-7B-0924": _gguf("olmoe", 50304, block_count=16, context_length=4096,
                                       embedding_length=2048, feed_forward_length=1024,
                                       attention__head_count=16, attention__head_count_kv=16,
                                       expert_count=64, expert_used_count=8),
    "openai__gpt-oss-20b": _gguf("gpt-oss", 201088, block_count=24, context_length=131072,
                                 embedding_length=2880, feed_forward_length=2880,
                                 expert_feed_forward_length=2880, attention__head_count=64,
                                 attention__head_count_kv=8, attention__key_length=64,
                                 attention__value_length=64, attention__sliding_window=128,
                                 expert_count=32, expert_used_count=4),
    "zai-org__GLM-4.5-Air": _gguf("glm4moe", 151552, block_count=47, nextn_predict_layers=1,
                                  context_length=131072, embedding_length=4096, feed_forward_length=10944,
                                  attention__head_count=96, attention__head_count_kv=8,
                                  attention__key_length=128, attention__value_length=128,
                                  rope__dimension_count=64, expert_count=128, expert_shared_count=1,
                                  expert_used_count=8, expert_feed_forward_length=1408,
                                  leading_dense_block_count=1),
}

COMPARED = ("hidden_size", "num_layers", "vocab_size", "num_attention_heads", "num_kv_heads", "head_dim",
            "attention", "max_context", "moe_layers", "dense_layers", "n_routed_experts",
            "experts_per_token", "moe_intermediate_size", "n_shared_experts", "shared_intermediate_size",
            "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
            "sliding_window", "sliding_layers", "n_mtp_layers", "family")


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_gguf_metadata_gives_the_same_spec_as_config(name):
    from_config = spec(name)
    from_gguf = spec_from_gguf(GGUF_CASES[name], name, source=f"{name}.gguf")
    for field in COMPARED:
        assert getattr(from_gguf, field) == getattr(from_config, field), field
    assert from_gguf.kv_bytes_per_token() == from_config.kv_bytes_per_token()
    assert from_gguf.architecture == GGUF_CASES[name]["general.architecture"]
    # The translated config is a Hugging Face config the same family reads back identically.
    again = spec_from_config(from_gguf.config, name)
    for field in COMPARED:
        assert getattr(again, field) == getattr(from_gguf, field), field


def test_gguf_deepseek2_yarn_and_routing_translated():
    cfg = spec_from_gguf(KIMI_K2, "k", source="k.gguf").config
    assert cfg["model_type"] == "deepseek_v3" and cfg["scoring_func"] == "sigmoid"
    assert cfg["rope_scaling"]["factor"] == 32.0 and cfg["rope_scaling"]["mscale_all_dim"] == pytest.approx(1.0)
    assert cfg["routed_scaling_factor"] == pytest.approx(2.827)


def test_gguf_older_mla_layout():
    meta = copy.deepcopy(KIMI_K2)
    for k in ("attention.key_length_mla", "attention.value_length_mla"):
        del meta[f"deepseek2.{k}"]
    meta.update({"deepseek2.attention.head_count_kv": 64, "deepseek2.attention.key_length": 192,
                 "deepseek2.attention.value_length": 128})
    s = spec_from_gguf(meta, "k", source="k.gguf")
    assert (s.qk_nope_head_dim, s.v_head_dim, s.num_kv_heads) == (128, 128, 64)


def test_gguf_missing_key_and_unknown_arch():
    meta = copy.deepcopy(GGUF_CASES["Qwen__Qwen3-30B-A3B"])
    del meta["qwen3moe.expert_used_count"]
    with pytest.raises(ModelError, match=r"'qwen3moe\.expert_used_count'.*q\.gguf"):
        spec_from_gguf(meta, "q", source="q.gguf")
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        spec_from_gguf({"general.architecture": "mamba"}, "m", source="m.gguf")
    dense = {k: v for k, v in GGUF_CASES["mistralai__Mixtral-8x7B-v0.1"].items() if "expert" not in k}
    with pytest.raises(UnsupportedModelError, match="dense 'llama'"):
        spec_from_gguf(dense, "l", source="l.gguf")
