"""Inspecting GGUF files: a tiny qwen3moe (single and split), a tiny deepseek2, damaged files."""

import shutil

import gguf
import pytest

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.gguf_files import read_gguf
from hybridmoe.backend.models.inventory import TensorClass as C
from hybridmoe.backend.models.tensors import classify_gguf

from .conftest import CONFIGS
from .conftest import GGUF_DIMS as D


def q8(n):
    return n // 32 * 34


def q4(n):
    return n // 32 * 18


def test_qwen3moe_gguf(gguf_dir):
    m = inspect_model(gguf_dir / "tiny-qwen3moe.gguf")
    s, inv = m.spec, m.inventory
    assert m.kind == "gguf" and s.family == "qwen3_moe" and s.architecture == "qwen3moe"
    assert s.name == "tiny-qwen3moe"
    assert (s.num_layers, s.n_routed_experts, s.experts_per_token) == (3, 4, 2)
    assert s.moe_layers == (0, 1, 2) and s.head_dim == 16 and s.num_kv_heads == 2
    assert s.vocab_size == D["vocab"]  # from the tokenizer's token list
    assert s.config["model_type"] == "qwen3_moe" and s.config["num_experts"] == 4
    assert s.config["rms_norm_eps"] == 1e-6
    # Experts: gate and up in Q8_0, down in Q4_0 -> the file's declared type names them.
    h, i, e = D["hidden"], D["inter"], D["experts"]
    per_layer = e * (2 * q8(i * h) + q4(h * i))
    assert inv.routed_bytes_by_layer == {0: per_layer, 1: per_layer, 2: per_layer}
    assert inv.bytes_per_expert(1) == per_layer / e
    assert inv.expert_bits_per_weight == pytest.approx((8.5 * 2 + 4.5) / 3)
    assert s.expert_format == "q8_0" and s.other_format == "f16"
    assert inv.bytes_by_class[C.EMBEDDING] == D["vocab"] * h * 2
    assert inv.bytes_by_class[C.LM_HEAD] == D["vocab"] * h * 2
    assert inv.bytes_by_class[C.ROUTER] == 3 * e * h * 4
    assert inv.total_bytes == sum(t.nbytes for t in read_gguf(m.files[0]).tensors)
    assert inv.notes == ()


def test_split_gguf_reads_every_part(gguf_dir):
    parts = sorted((gguf_dir / "split").glob("*.gguf"))
    assert [p.name for p in parts] == ["tiny-qwen3moe-00001-of-00002.gguf", "tiny-qwen3moe-00002-of-00002.gguf"]
    whole = inspect_model(gguf_dir / "tiny-qwen3moe.gguf")
    for given in (parts[0], parts[1], gguf_dir / "split"):  # any part, or the folder
        m = inspect_model(given)
        assert m.files == tuple(parts)
        assert m.inventory.bytes_by_class == whole.inventory.bytes_by_class
        assert m.inventory.routed_bytes_by_layer == whole.inventory.routed_bytes_by_layer
        assert m.spec.moe_layers == whole.spec.moe_layers


def test_split_gguf_with_a_missing_part(gguf_dir, tmp_path):
    part = min((gguf_dir / "split").glob("*.gguf"))
    shutil.copy(part, tmp_path / part.name)
    with pytest.raises(ModelError, match="00002-of-00002.gguf is missing") as err:
        inspect_model(tmp_path / part.name)
    assert "every part" in err.value.hint


def test_deepseek2_gguf(gguf_dir):
    m = inspect_model(gguf_dir / "tiny-deepseek2.gguf")
    s, inv = m.spec, m.inventory
    assert s.family == "deepseek" and s.attention == "mla"
    assert s.num_layers == 3 and s.n_mtp_layers == 1  # block_count 4 = 3 + 1 NextN
    assert s.moe_layers == (1, 2) and s.dense_layers == (0,)
    assert s.kv_bytes_per_token() == (32 + 8) * 3 * 2
    assert s.config["scoring_func"] == "sigmoid" and s.config["q_lora_rank"] == 48
    assert inv.routed_bytes_by_layer == {1: 4 * 3 * q8(32 * 64), 2: 4 * 3 * q8(32 * 64)}
    assert inv.bytes_by_class[C.SHARED_EXPERTS] == 2 * 3 * 32 * 64 * 2
    assert inv.bytes_by_class[C.DENSE_FFN] == 3 * 96 * 64 * 2
    assert inv.bytes_by_class[C.ROUTER] == 2 * (4 * 64 * 4 + 4 * 4)  # ffn_gate_inp + exp_probs_b
    assert inv.bytes_by_class[C.OTHER] > 2 * 64 * 128 * 2  # the whole NextN block
    assert s.expert_format == "q8_0"


@pytest.mark.parametrize("name, cls", [
    ("token_embd.weight", C.EMBEDDING), ("output.weight", C.LM_HEAD), ("output_norm.weight", C.ATTENTION),
    ("blk.0.attn_kv_a_mqa.weight", C.ATTENTION), ("blk.0.attn_k_b.weight", C.ATTENTION),
    ("blk.0.attn_sinks.weight", C.ATTENTION), ("blk.0.ffn_norm.weight", C.ATTENTION),
    ("blk.1.ffn_gate_exps.weight", C.ROUTED_EXPERTS), ("blk.1.ffn_down_exps.bias", C.ROUTED_EXPERTS),
    ("blk.1.ffn_up.3.weight", C.ROUTED_EXPERTS),  # pre-2024 Mixtral: one tensor per expert
    ("blk.1.ffn_up_shexp.weight", C.SHARED_EXPERTS), ("blk.1.ffn_gate_inp_shexp.weight", C.SHARED_EXPERTS),
    ("blk.1.ffn_gate_inp.weight", C.ROUTER), ("blk.1.exp_probs_b.bias", C.ROUTER),
    ("blk.0.ffn_down.weight", C.DENSE_FFN), ("blk.5.attn_q.weight", C.OTHER),
    ("blk.1.nextn.eh_proj.weight", C.OTHER),
])
def test_gguf_names(name, cls):
    assert classify_gguf(name, num_layers=5).cls is cls


def test_unrecognised_tensor_is_counted_as_other_with_a_note(tmp_path):
    from hybridmoe.backend.models.safetensors_files import TensorRecord
    from hybridmoe.backend.models.tensors import inventory_from_records

    from .test_families import spec
    s = spec("Qwen__Qwen3-30B-A3B")
    records = [TensorRecord(f"blk.{i}.ffn_gate_exps.weight", "q4_k", (128, 768, 2048), 1000, "f") for i in range(48)]
    records.append(TensorRecord("blk.0.strange_thing.weight", "f32", (4,), 16, "f"))
    inv = inventory_from_records(records, s, source="gguf", files=["f"])
    assert inv.bytes_by_class[C.OTHER] == 16
    assert "blk.0.strange_thing.weight" in inv.notes[0]


# --- damaged input --------------------------------------------------------------------------

def test_truncated_gguf(gguf_dir, tmp_path):
    data = (gguf_dir / "tiny-qwen3moe.gguf").read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * 0.6)])
    with pytest.raises(ModelError, match="truncated or damaged") as err:
        inspect_model(bad)
    assert "cut.gguf" in str(err.value) and err.value.hint


def test_gguf_cut_inside_the_header(gguf_dir, tmp_path):
    bad = tmp_path / "head.gguf"
    bad.write_bytes((gguf_dir / "tiny-qwen3moe.gguf").read_bytes()[:100])
    with pytest.raises(ModelError, match="head.gguf"):
        inspect_model(bad)


@pytest.mark.parametrize("content", [b"", b"hello, this is not a model\n" * 4])
def test_not_a_gguf(tmp_path, content):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelError, match="model.gguf"):
        inspect_model(bad)


def test_gguf_of_an_unsupported_architecture(tmp_path):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(path, "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", __import__("numpy").zeros((8, 32), dtype="float32"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from hybridmoe.backend.errors import UnsupportedModelError
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        inspect_model(path)


def test_folder_with_several_ggufs(gguf_dir):
    with pytest.raises(ModelError, match="several GGUF models"):
        inspect_model(gguf_dir)


def test_folder_with_config_and_a_gguf_reads_the_gguf(gguf_dir, tmp_path):
    shutil.copy(gguf_dir / "tiny-deepseek2.gguf", tmp_path / "model.gguf")
    shutil.copy(CONFIGS / "moonshotai__Kimi-K2-Instruct.json", tmp_path / "config.json")
    m = inspect_model(tmp_path)
    assert m.kind == "gguf" and m.spec.hidden_size == 64
