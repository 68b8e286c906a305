"""Inventories from safetensors headers: tiny checkpoints written by transformers, a
miniature Kimi K2.6 layout, and damaged files."""

import json
import shutil
import struct

import pytest
from safetensors import safe_open

from tests.models.conftest import CONFIGS
from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.inventory import TensorClass as C
from hybridmoe.backend.models.safetensors_files import read_header
from hybridmoe.backend.models.tensors import classify_hf, inventory_from_config

# What transformers 5 save_pretrained writes for the experts (the engine's loader depends on it).
EXPERT_NAMES = {
    "qwen3_moe": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "qwen2_moe": "model.layers.1.mlp.experts.3.down_proj.weight",
    "olmoe": "model.layers.1.mlp.experts.2.up_proj.weight",
    "deepseek_v3": "model.layers.1.mlp.experts.0.gate_proj.weight",
    "glm4_moe": "model.layers.2.mlp.experts.1.down_proj.weight",
    "mixtral": "model.layers.0.block_sparse_moe.experts.3.w2.weight",
    "gpt_oss": "model.layers.1.mlp.experts.gate_up_proj",  # fused [E, hidden, 2 x inter]
}


def real_tensors(files):
    """name -> bytes, from loading every tensor with the safetensors library."""
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                t = fh.get_tensor(name)
                out[name] = t.numel() * t.element_size()
    return out


@pytest.mark.parametrize("family", sorted(EXPERT_NAMES))
def test_inventory_from_headers_matches_the_tensors(tiny_checkpoints, family):
    m = inspect_model(tiny_checkpoints[family])
    assert m.kind == "safetensors" and m.spec.family == {"deepseek_v3": "deepseek"}.get(family, family)
    assert len(m.files) > 1  # sharded, with an index
    tensors = real_tensors(m.files)
    assert EXPERT_NAMES[family] in tensors
    assert m.inventory.total_bytes == sum(tensors.values())
    assert m.inventory.notes == ()  # every tensor recognised
    s = m.spec
    # Independent figures for the routed experts, embedding and head (bf16).
    per_expert = 2 * s.params_per_expert + (2 * (2 * s.moe_intermediate_size + s.hidden_size)
                                            if family == "gpt_oss" else 0)  # GPT-OSS expert biases
    assert m.inventory.bytes_per_expert(s.moe_layers[0]) == per_expert
    assert m.inventory.routed_expert_bytes == s.n_moe_layers * s.n_routed_experts * per_expert
    assert m.inventory.bytes_by_class[C.EMBEDDING] == 2 * s.vocab_size * s.hidden_size
    assert m.inventory.bytes_by_class[C.LM_HEAD] == 2 * s.vocab_size * s.hidden_size
    assert m.inventory.expert_bits_per_weight == pytest.approx(16, rel=0.1)
    assert (s.expert_format, s.other_format) == ("bf16", "bf16")


@pytest.mark.parametrize("family", sorted(EXPERT_NAMES))
def test_config_inventory_predicts_the_checkpoint(tiny_checkpoints, family):
    m = inspect_model(tiny_checkpoints[family])
    files = m.inventory.bytes_by_class
    predicted = inventory_from_config(m.spec).bytes_by_class
    router = predicted[C.ROUTER]
    if family in ("deepseek_v3", "glm4_moe"):
        # transformers keeps gate.weight in float32 (_keep_in_fp32_modules_strict); the
        # published checkpoints store it in bf16, as the config estimate assumes.
        router += m.spec.n_moe_layers * m.spec.n_routed_experts * m.spec.hidden_size * 2
    assert files[C.ROUTER] == router
    for cls in C:
        if cls is not C.ROUTER:
            assert files[cls] == predicted[cls], cls


def test_classes_of_real_names(tiny_checkpoints):
    expect = [
        (".self_attn.", C.ATTENTION), ("layernorm", C.ATTENTION), ("model.norm.", C.ATTENTION),
        (".experts.", C.ROUTED_EXPERTS), (".shared_expert", C.SHARED_EXPERTS),
        (".mlp.gate.", C.ROUTER), (".block_sparse_moe.gate.", C.ROUTER), (".mlp.router.", C.ROUTER),
        ("embed_tokens", C.EMBEDDING), ("lm_head", C.LM_HEAD),
    ]
    seen = set()
    for path in tiny_checkpoints.values():
        m = inspect_model(path)
        for f in m.files:
            for r in read_header(f):
                cls = classify_hf(r.name, m.spec.num_layers).cls
                want = next((c for key, c in expect if key in r.name), None)
                if want is None:  # plain MLP of a dense layer
                    assert cls is C.DENSE_FFN and ".mlp." in r.name, r.name
                    assert int(r.name.split(".")[2]) in m.spec.dense_layers
                else:
                    assert cls is want, r.name
                seen.add(cls)
    assert seen == set(C) - {C.OTHER}


def test_kimi_like_checkpoint(kimi_like_checkpoint):
    m = inspect_model(kimi_like_checkpoint)
    s, inv = m.spec, m.inventory
    assert s.family == "deepseek" and s.num_layers == 2 and s.n_mtp_layers == 1
    assert (s.expert_format, s.other_format) == ("int4_g32", "bf16")
    assert inv.notes == ()
    # int4 g32 experts: packed int32 + bf16 scales, plus the 8-byte weight_shape per matrix.
    per_expert = 3 * (32 * 64 // 2 + 32 * 2 * 2) + 3 * 8
    assert per_expert == s.params_per_expert * 4.5 / 8 + 24
    assert inv.routed_bytes_by_layer == {1: 4 * per_expert}
    assert inv.expert_bits_per_weight == pytest.approx(4.5, abs=0.1)
    # MTP layer 2, the vision tower and the projector are "other".
    mtp_and_vision = 2 * (96 * 32 + 32 * 3 * 14 * 14 + 128 * 128)
    assert inv.bytes_by_class[C.OTHER] > mtp_and_vision
    assert inv.total_bytes == sum(real_tensors(m.files).values())
    # Against the config-only estimate: identical except weight_shape and the vision estimate.
    est = inventory_from_config(s)
    assert est.routed_expert_bytes + 4 * 24 == inv.routed_expert_bytes
    for cls in (C.EMBEDDING, C.ATTENTION, C.DENSE_FFN, C.SHARED_EXPERTS, C.LM_HEAD):
        assert est.bytes_by_class[cls] == inv.bytes_by_class[cls], cls


def test_requested_formats_resize_from_the_config(tiny_checkpoints):
    m = inspect_model(tiny_checkpoints["qwen3_moe"], expert_format="q8_0")
    assert m.kind == "safetensors" and m.inventory.source == "config"
    assert m.inventory.expert_bits_per_weight == pytest.approx(8.5)
    assert m.inventory.files  # still says which files were inspected


def test_directory_with_only_config_plans_from_config(tmp_path):
    shutil.copy(CONFIGS / "Qwen__Qwen3-30B-A3B.json", tmp_path / "config.json")
    m = inspect_model(tmp_path)
    assert m.kind == "config" and m.inventory.source == "config"


# --- damaged input --------------------------------------------------------------------------

@pytest.fixture
def qwen_copy(tiny_checkpoints, tmp_path):
    return shutil.copytree(tiny_checkpoints["qwen3_moe"], tmp_path / "qwen")


def first_shard(path):
    return min(path.glob("*.safetensors"))


def test_truncated_shard(qwen_copy):
    shard = first_shard(qwen_copy)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelError, match="truncated") as err:
        inspect_model(qwen_copy)
    assert shard.name in str(err.value) and err.value.hint


def test_header_length_past_end_of_file(qwen_copy):
    shard = first_shard(qwen_copy)
    shard.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ModelError, match=r"header claims 1,000,000,000 bytes") as err:
        inspect_model(qwen_copy)
    assert shard.name in str(err.value)


def test_tiny_file(qwen_copy):
    shard = first_shard(qwen_copy)
    shard.write_bytes(b"\x01\x02")
    with pytest.raises(ModelError, match="too short"):
        inspect_model(qwen_copy)


def test_garbage_header(qwen_copy):
    shard = first_shard(qwen_copy)
    shard.write_bytes(struct.pack("<Q", 12) + b"not json!!!!" + b"\0" * 64)
    with pytest.raises(ModelError, match="not valid JSON") as err:
        inspect_model(qwen_copy)
    assert shard.name in str(err.value)


def test_offsets_beyond_file(qwen_copy):
    shard = first_shard(qwen_copy)
    header = json.dumps({"x": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 32]}}).encode()
    shard.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ModelError, match="tensor 'x' ends at byte 32"):
        read_header(shard)


def test_size_disagrees_with_shape(tmp_path):
    f = tmp_path / "bad.safetensors"
    header = json.dumps({"x": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 16]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(ModelError, match="needs 32"):
        read_header(f)


def test_missing_shard(qwen_copy):
    first_shard(qwen_copy).unlink()
    with pytest.raises(ModelError, match="missing .*index.json") as err:
        inspect_model(qwen_copy)
    assert "download" in err.value.hint


def test_config_that_does_not_match_the_weights(qwen_copy):
    config = json.loads((qwen_copy / "config.json").read_text())
    config["mlp_only_layers"] = [0, 1]
    (qwen_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="layer 1, which the config describes as dense"):
        inspect_model(qwen_copy)


def test_missing_config_field(qwen_copy):
    config = json.loads((qwen_copy / "config.json").read_text())
    del config["num_experts_per_tok"]
    (qwen_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as err:
        inspect_model(qwen_copy)
    assert "num_experts_per_tok" in str(err.value) and str(qwen_copy / "config.json") in str(err.value)


def test_unknown_architecture_and_broken_config(qwen_copy):
    (qwen_copy / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="BertModel"):
        inspect_model(qwen_copy)
    (qwen_copy / "config.json").write_text("{ not json")
    with pytest.raises(ModelError, match="not valid JSON"):
        inspect_model(qwen_copy)


def test_paths_that_are_not_models(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        inspect_model(tmp_path / "nowhere")
    with pytest.raises(ModelError, match="neither config.json nor a .gguf"):
        inspect_model(tmp_path)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelError, match="neither a model folder"):
        inspect_model(tmp_path / "notes.txt")
