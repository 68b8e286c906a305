"""Kimi K2.x int4 experts (compressed-tensors pack-quantized, group 32) become Q4_0 bit for bit.

A tiny DeepSeek-V3 checkpoint has its routed experts packed by compressed-tensors itself;
after conversion every expert tensor of the GGUF must hold exactly the library's codes and
scales: each Q4_0 nibble minus 8 is the code compressed-tensors unpacks, each block scale its
group scale, so the dequantized Q4_0 weights equal code × scale exactly (compressed-tensors'
decompress rounds that product to bf16).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.convert.conftest import build_checkpoint, needs_llama_cpp, open_llama

pytest.importorskip("compressed_tensors", reason="pip install compressed-tensors for the int4 reference")

from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

SCHEME = QuantizationScheme(
    targets=["Linear"],
    weights=QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
)
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


@pytest.fixture(scope="module")
def kimi_checkpoint(tmp_path_factory):
    """A DeepSeek-V3-shaped checkpoint with int4 routed experts, as Kimi K2 Thinking ships."""
    directory = tmp_path_factory.mktemp("kimi_int4")
    build_checkpoint(directory, "deepseek_v3", seed=3)
    path = directory / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    reference = {}
    for name in [n for n in state if EXPERT.fullmatch(n)]:
        w = state.pop(name)
        rows, cols = w.shape
        # Scales in bf16 as Kimi's are, and weights that use the whole -8..7 range.
        scale = (w.float().reshape(rows, cols // 32, 32).abs().amax(-1) / 7).to(torch.bfloat16)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, SCHEME)
        base = name.removesuffix(".weight")
        for key, value in packed.items():
            state[f"{base}.{key}"] = value
        codes = unpack_from_int32(packed["weight_packed"], 4, w.shape)  # compressed-tensors' own unpack
        exact = codes.float() * packed["weight_scale"].float().repeat_interleave(32, dim=1)
        decompressed = PackedQuantizationCompressor.decompress(dict(packed), SCHEME)["weight"]
        assert torch.equal(exact.to(torch.bfloat16), decompressed)  # the library's bf16 rounding of it
        reference[name] = exact
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory, reference


# q4_k_m: llama.cpp's quantizer is told to keep the copies, where its mix would re-quantize
# them to Q4_K.
@pytest.mark.parametrize("quant", ["q8_0", "bf16", pytest.param("q4_k_m", marks=needs_llama_cpp)])
def test_int4_experts_become_q4_0_bit_exactly(kimi_checkpoint, tmp_path, quant):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from hybridmoe.backend.convert import to_gguf

    directory, reference = kimi_checkpoint
    out = to_gguf(directory, tmp_path / "kimi.gguf", quant)
    reader = GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    checked = 0
    for layer in (1, 2):
        for proj in ("gate", "up", "down"):
            t = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert t.tensor_type == GGMLQuantizationType.Q4_0  # whatever the requested quant
            data = np.asarray(t.data)  # [E, out, row bytes]
            values = torch.from_numpy(dequantize(data, GGMLQuantizationType.Q4_0))
            for e in range(values.shape[0]):
                expected = reference[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"]
                assert torch.equal(values[e], expected), (layer, proj, e)
                # The nibbles are compressed-tensors' codes (value + 8), in Q4_0's order.
                blocks = data[e].reshape(-1, 18)
                codes = np.concatenate([blocks[:, 2:] & 0x0F, blocks[:, 2:] >> 4], axis=1).astype(np.int32) - 8
                scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
                assert np.array_equal(codes * scale, expected.numpy().reshape(-1, 32))
                checked += 1
    assert checked == 2 * 3 * 8
    # Everything else follows the requested type (Q4_K_M's rows of 64 fall back from Q4_K to
    # Q5_0 in llama.cpp's mix).
    want = {"q8_0": GGMLQuantizationType.Q8_0, "bf16": GGMLQuantizationType.BF16,
            "q4_k_m": GGMLQuantizationType.Q5_0}[quant]
    assert tensors["blk.1.ffn_gate_shexp.weight"].tensor_type == want


@needs_llama_cpp
def test_int4_gguf_runs_in_llama_cpp(kimi_checkpoint, tmp_path):
    from hybridmoe.backend.convert import to_gguf

    directory, _ = kimi_checkpoint
    llm = open_llama(to_gguf(directory, tmp_path / "kimi.gguf", "q8_0"))
    try:
        llm.eval([5, 17, 42, 99])
        assert np.isfinite(np.array(llm.scores[:4])).all()
    finally:
        llm.close()
