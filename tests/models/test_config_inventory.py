"""Config-only inventories of the real configs against the sizes their publishers give (the
Hugging Face repositories' file sizes)."""

import pytest

from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.models.inventory import TensorClass as C
from hybridmoe.backend.models.tensors import inventory_from_config

from .conftest import CONFIGS
from .test_families import SUPPORTED, spec

GiB = 2**30
GB = 1e9


def inv(name, **formats):
    return inventory_from_config(spec(name), **formats)


def test_kimi_k26_published_figures():
    s = spec("moonshotai__Kimi-K2.6")
    i = inventory_from_config(s)
    assert i.source == "config" and i.expert_format == "int4_g32"
    assert i.expert_bits_per_weight == pytest.approx(4.5)
    assert i.bytes_per_expert(1) == 24_772_608
    assert set(i.routed_bytes_by_layer) == set(range(1, 61))
    assert i.routed_expert_bytes == 60 * 384 * 24_772_608
    assert i.routed_expert_bytes / GB == pytest.approx(570.8, abs=0.05)
    assert i.routed_expert_bytes / GiB == pytest.approx(531.6, abs=0.05)
    rest = i.total_bytes - i.routed_expert_bytes
    assert rest / GiB == pytest.approx(22.4, rel=0.03)  # attention, shared, dense, embeddings, head, vision
    assert i.total_bytes / GiB == pytest.approx(554.30, rel=0.01)  # 64 files, 554.30 GiB
    assert i.bytes_by_class[C.OTHER] > 0  # the vision tower
    # Decode reads k experts per MoE layer from host memory: about 11.9 GB per token.
    assert 8 * 60 * i.bytes_per_expert(1) / GB == pytest.approx(11.9, abs=0.05)


def test_deepseek_v3_fp8_published_figures():
    i = inv("deepseek-ai__DeepSeek-V3")
    assert i.expert_format == "fp8_block"
    assert i.bytes_per_expert(3) == 3 * (2048 * 7168 + 16 * 56 * 4) == 44_050_944
    assert i.total_bytes / GiB == pytest.approx(641.30, rel=0.01)  # incl. the MTP layer
    assert i.bytes_by_class[C.OTHER] / GiB == pytest.approx(14.4, abs=0.2)  # the MTP layer
    # Published: 3 x 206.50 GiB of fp8 expert weights, counting the MTP layer's 256 experts too.
    assert i.routed_expert_bytes / GiB == pytest.approx(3 * 206.50 * 58 / 59, rel=0.001)


@pytest.mark.parametrize("name, formats, expected, unit, tolerance", [
    ("openai__gpt-oss-20b", {}, 12.82, GiB, 0.02),
    ("Qwen__Qwen1.5-MoE-A2.7B", {}, 28.64, GB, 0.01),
    ("deepseek-ai__DeepSeek-V2-Lite", {}, 31.41, GB, 0.01),
    ("Qwen__Qwen3-30B-A3B", {}, 61.10, GB, 0.01),  # the BF16 GGUF, a proxy
    ("mistralai__Mixtral-8x7B-v0.1", {}, 93.4, GB, 0.01),
    ("zai-org__GLM-4.5-Air", {}, 205.811, GiB, 0.01),  # the BF16 GGUF, a proxy
    ("zai-org__GLM-4.5-Air", {"expert_format": "q8_0"}, 109.381, GiB, 0.01),
    ("zai-org__GLM-4.5", {"expert_format": "fp8_block", "other_format": "fp8_block"}, 336.48, GiB, 0.01),
    ("deepseek-ai__DeepSeek-V3", {"expert_format": "q4_k_m"}, 404.43, GB, 0.01),
    ("mistralai__Mixtral-8x22B-v0.1", {"expert_format": "q4_k_m"}, 85.58, GB, 0.015),
    ("openai__gpt-oss-120b", {"expert_format": "mxfp4", "other_format": "f16"}, 60.88, GB, 0.10),
])
def test_published_sizes(name, formats, expected, unit, tolerance):
    assert inv(name, **formats).total_bytes / unit == pytest.approx(expected, rel=tolerance)


def test_qwen3_30b_a3b_q4_k_m_estimate():
    i = inv("Qwen__Qwen3-30B-A3B", expert_format="q4_k_m")
    assert 17.3 * GB <= i.total_bytes <= 18.65 * GB
    assert i.total_bytes / GiB == pytest.approx(17.28, abs=0.05)  # the published "17.28 GB" is GiB
    assert i.expert_bits_per_weight == pytest.approx(4.84375)
    # ffn_down in Q6_K in the use_more_bits layers makes those layers' experts larger.
    assert i.bytes_per_expert(0) > i.bytes_per_expert(10)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_config_inventory_is_sane(name):
    s = spec(name)
    i = inventory_from_config(s)
    assert set(i.routed_bytes_by_layer) == set(s.moe_layers)
    assert len(set(i.routed_bytes_by_layer.values())) == 1  # one storage format, the same every layer
    assert i.routed_expert_bytes == sum(i.routed_bytes_by_layer.values())
    assert 0 < i.always_read_bytes < i.total_bytes
    assert i.bytes_by_class[C.EMBEDDING] > 0 and i.bytes_by_class[C.ATTENTION] > 0
    assert i.bytes_by_class[C.ROUTER] > 0
    assert (i.bytes_by_class[C.SHARED_EXPERTS] > 0) == (s.n_shared_experts > 0)
    assert (i.bytes_by_class[C.DENSE_FFN] > 0) == bool(s.dense_layers)
    assert (i.bytes_by_class[C.OTHER] > 0) == bool(s.n_mtp_layers or s.has_vision)
    bits = i.expert_bits_per_weight
    assert bits == pytest.approx({"bf16": 16, "int4_g32": 4.5, "fp8_block": 8.002, "mxfp4": 4.26}[s.expert_format],
                                 rel=0.01)
    q = inventory_from_config(s, expert_format="q4_k_m")
    assert q.total_bytes < i.total_bytes or s.expert_format in ("int4_g32", "mxfp4")


def test_inspect_bare_config_file():
    m = inspect_model(CONFIGS / "moonshotai__Kimi-K2.6.json")
    assert m.kind == "config" and m.spec.name == "moonshotai/Kimi-K2.6"
    assert m.inventory.total_bytes == inventory_from_config(m.spec).total_bytes
    planned = inspect_model(CONFIGS / "moonshotai__Kimi-K2.6.json", expert_format="q4_k_m")
    assert planned.inventory.expert_format == "q4_k_m"
    assert planned.inventory.expert_bits_per_weight == pytest.approx(4.84, abs=0.02)
