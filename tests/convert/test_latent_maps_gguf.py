"""A DeepSeek GGUF on a CPU main device keeps MLA's split kv_b as the file stores it
(backend/engine/latent_maps.py): the attention reads the file's bytes, and computes what
kv_b held whole computes: the same in a BF16 file; in a quantized one but for the 8-bit
rounding of the maps' inputs, which these tiny random models (every expert routed: no
routing flips) amplify to a few percent of the logits, as they do llama.cpp's rounding
(tests/convert/test_engine_vs_llama_cpp.py). The kernels themselves are held to the
rounding's exact emulation in tests/native/test_latent_maps.py."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.backend.engine.cpu_decode import _MLAStep
from hybridmoe.backend.engine.mla import MLAttention
from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.engine.native_kernels import native_format
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.engine import build_layers
from tests.engine.conftest import relative_error, tokens


def _decode(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    model(ids[:, :prefill], 0)
    return torch.cat([model(ids[:, t : t + 1], t) for t in range(prefill, ids.shape[1])], dim=1)


# (Q4_K_M: llama.cpp's quantizer writes attn_k_b, rows of nope, in Q5_0, and so attn_v_b here.)
@pytest.mark.parametrize("quant,tolerance", [("bf16", 1e-4), ("q8_0", 0.1), ("q4_0", 0.1), ("q4_k_m", 0.1)])
def test_a_gguf_deepseek_reads_its_split_kv_b_as_stored(converted, quant, tolerance, monkeypatch):
    path = converted("deepseek_v3", quant, all_experts=True)
    config = inspect_model(path).spec.config
    weights = open_weights(path)
    model = build_model(config, weights, max_context=64, dtype=torch.float32)
    attentions = [m for m in model.modules() if isinstance(m, MLAttention)]
    assert attentions and all(a.kv_b_weight is None and a.stored_maps is not None for a in attentions)
    for i, a in enumerate(attentions):  # the file's bytes, in its format
        k_b, v_b = weights.get_gguf(f"blk.{i}.attn_k_b.weight"), weights.get_gguf(f"blk.{i}.attn_v_b.weight")
        assert a.stored_maps.bytes == k_b.nbytes + v_b.nbytes
        assert {native_format(k_b), native_format(v_b)} == {"q5_0" if quant == "q4_k_m" else quant}
        assert a.stored_maps.native.format in (native_format(k_b), f"{native_format(k_b)}x8")
    ids = tokens(24, seed=3)
    stored = _decode(model, ids, 8)
    assert all(isinstance(s.attn, _MLAStep) for s in model._decode_step.layers)

    monkeypatch.setattr(build_layers, "stored_maps", lambda *args: None)
    whole = build_model(config, open_weights(path), max_context=64, dtype=torch.float32)
    assert all(m.kv_b_weight is not None for m in whole.modules() if isinstance(m, MLAttention))
    assert relative_error(stored, _decode(whole, ids, 8)) < tolerance


def test_both_forms_of_a_prompt_agree_on_stored_maps(converted):
    """The absorbed form reads the stored maps natively; the expanded one rebuilds kv_b for its call.
    (The absorbed form's queries and softmax weights meet the float16 cache in float16, as
    llama.cpp's; the expanded form's in float32: 2^-11 apart at most.)"""
    path = converted("deepseek_v3", "bf16", all_experts=True)
    model = build_model(inspect_model(path).spec.config, open_weights(path), max_context=64, dtype=torch.float32)
    ids = tokens(20, seed=4)
    model.set_mla_absorb(True)
    absorbed = model(ids, 0)
    model.set_mla_absorb(False)
    assert relative_error(absorbed, model(ids, 0)) < 2e-3


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_k_m"])
def test_a_plan_before_conversion_counts_kv_b_as_the_file_will_hold_it(converted, quant):
    """From the config alone (a plan before converting or downloading), kv_b is the two split
    tensors the GGUF will hold, in their formats (a K-quant's 32-weight fallback for rows too
    short), read as stored: the attention's bytes, and what the engine holds of it, are the
    converted file's."""
    from hybridmoe.backend.models.inventory import TensorClass
    from hybridmoe.backend.models.tensors import inventory_from_config

    inspected = inspect_model(converted("deepseek_v3", quant))
    file, config = inspected.inventory, inventory_from_config(inspected.spec, expert_format=quant)
    attention = TensorClass.ATTENTION
    assert config.bytes_by_class[attention] == file.bytes_by_class[attention]
    assert config.held_bytes(attention, 2, 4) == file.held_bytes(attention, 2, 4)
