"""The Unsloth-shaped mixes `bench generate --types` retypes a model to (backend/bench/retype.py):
which type each tensor of a DeepSeek-V3-shaped model gets."""

from __future__ import annotations

import pytest

from hybridmoe.app.cli import SWEEP_TYPES
from hybridmoe.backend.bench.retype import MIXES, mix_type

# first_moe 3 (three dense layers, as DeepSeek-V3's), last layer 60
EXPECTED = {
    "ud-q2_k_xl": {"blk.3.ffn_gate_exps.weight": "iq3_xxs", "blk.30.ffn_up_exps.weight": "iq2_xxs",
                   "blk.30.ffn_down_exps.weight": "iq3_xxs", "blk.60.ffn_gate_exps.weight": "iq3_xxs",
                   "output.weight": "q8_0"},
    "ud-iq1_s": {"blk.3.ffn_gate_exps.weight": "iq2_xxs", "blk.30.ffn_up_exps.weight": "iq1_s",
                 "blk.30.ffn_gate_exps.weight": "iq1_s", "blk.30.ffn_down_exps.weight": "iq2_xxs",
                 "blk.60.ffn_up_exps.weight": "iq2_xxs", "output.weight": "q6_k"},
}
SHARED = {"token_embd.weight": "q4_k", "blk.30.attn_q_a.weight": "q4_k", "blk.30.attn_kv_b.weight": "q6_k",
          "blk.30.ffn_gate_shexp.weight": "q6_k", "blk.1.ffn_down.weight": "q6_k", "blk.30.attn_norm.weight": None,
          "blk.30.ffn_gate_inp.weight": None}


@pytest.mark.parametrize("mix", MIXES)
def test_each_tensor_gets_the_mix_type(mix):
    for name, expected in {**SHARED, **EXPECTED[mix]}.items():
        assert mix_type(mix, name, first_moe=3, last_layer=60) == expected, name


def test_the_sweep_takes_every_mix():
    assert set(MIXES) <= set(SWEEP_TYPES)
