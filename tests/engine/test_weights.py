"""Reading checkpoints: mmap without copies, quantized tensors folded under their logical
names and computed through the quant module, and clear errors for broken checkpoints."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.engine.moe import MoE
from hybridmoe.backend.formats.quant import QuantTensor
from hybridmoe.backend.formats.weights import SafetensorsWeights, open_weights
from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from tests.engine.conftest import engine, load_config, relative_error, tokens

EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def _write(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_weights_stay_views_of_the_mapped_file(checkpoints):
    """On the CPU, in the checkpoint's dtype, nothing is copied: the embedding and a CPU
    expert are the very bytes safetensors mapped."""
    path = checkpoints("qwen3_moe")
    weights = SafetensorsWeights(path)
    model = build_model(load_config(path), weights, max_context=16)
    assert model.embed.data_ptr() == weights.get("model.embed_tokens.weight").data_ptr()
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    stored = moe.host.weights_of(3).gate
    assert stored.data_ptr() == weights.get(f"model.layers.{moe.layer}.mlp.experts.3.gate_proj.weight").data_ptr()


# --- quantized checkpoints ------------------------------------------------------------


def _fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 style: one fp32 scale per 128x128 block (our matrices fit in one block)."""
    scale = (w.abs().max() / 448.0).reshape(1, 1)
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, scale, q.float() * scale


def _int4_g32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors pack-quantized: symmetric int4 per group of 32 (bf16 scales), eight
    values per int32 word, the first in the lowest nibble, stored as value + 8."""
    out, cols = w.shape
    groups = w.reshape(out, cols // 32, 32)
    scale = (groups.abs().amax(-1) / 7.0).to(torch.bfloat16)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).to(torch.int32).reshape(out, cols)
    nibbles = (q + 8).reshape(out, cols // 8, 8)
    packed = torch.zeros(out, cols // 8, dtype=torch.int64)
    for i in range(8):
        packed |= nibbles[..., i].to(torch.int64) << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    dequant = (q.reshape(out, cols // 32, 32).float() * scale.float()[..., None]).reshape(out, cols)
    return packed, scale, torch.tensor([out, cols], dtype=torch.int32), dequant


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPT-OSS MXFP4 over the last dimension: e2m1 codes in 32-element blocks with an e8m0
    scale; two codes per byte, the even element in the low nibble."""
    *lead, cols = w.shape
    groups = w.reshape(*lead, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-8) / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - _E2M1).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    dequant = (_E2M1[codes.long()] * torch.exp2(exponent)[..., None]).reshape(w.shape)
    return blocks, (exponent + 127).to(torch.uint8), dequant


def test_quantized_companions_fold_under_logical_names(tmp_path):
    w = torch.randn(48, 64)
    fp8, scale_inv, _ = _fp8_block(w)
    packed, scale, shape, _ = _int4_g32(w)
    blocks, scales, _ = _mxfp4(torch.randn(2, 48, 64))
    path = _write(tmp_path / "q", {
        "a.weight": fp8, "a.weight_scale_inv": scale_inv,
        "b.weight_packed": packed, "b.weight_scale": scale, "b.weight_shape": shape,
        "c.experts.gate_up_proj_blocks": blocks, "c.experts.gate_up_proj_scales": scales,
        "d.weight": w,
    }, {})
    weights = open_weights(path)
    assert set(weights.keys()) == {"a.weight", "b.weight", "c.experts.gate_up_proj", "d.weight"}
    assert "b.weight_scale" not in weights
    for name, shape_ in (("a.weight", (48, 64)), ("b.weight", (48, 64)), ("c.experts.gate_up_proj", (2, 48, 64))):
        q = weights.get(name)
        assert isinstance(q, QuantTensor) and tuple(q.shape) == shape_
    assert isinstance(weights.get("d.weight"), torch.Tensor)


def _quantize_checkpoint(path: Path, out: Path, quantize, select, config: dict | None = None) -> tuple[Path, Path]:
    """(quantized checkpoint, float checkpoint holding exactly the dequantized values)."""
    tensors = load_file(str(path / "model.safetensors"))
    quantized, floats = {}, {}
    for name, t in tensors.items():
        if select(name):
            stored, dequant = quantize(name, t)
            quantized.update(stored)
            floats[name] = dequant.to(t.dtype)
        else:
            quantized[name] = floats[name] = t
    config = config or load_config(path)
    return _write(out / "quantized", quantized, config), _write(out / "float", floats, config)


def test_deepseek_fp8_checkpoint(checkpoints, tmp_path):
    """DeepSeek-V3 fp8: routed experts and an attention projection in fp8 blocks."""
    def quantize(name, t):
        q, scale_inv, dequant = _fp8_block(t)
        return {name: q, f"{name}_scale_inv": scale_inv}, dequant

    q_path, f_path = _quantize_checkpoint(
        checkpoints("deepseek_v3"), tmp_path, quantize,
        lambda n: bool(EXPERT.fullmatch(n)) or n.endswith("self_attn.kv_b_proj.weight"))
    ids = tokens(12)
    expected = engine(f_path)(ids)
    assert relative_error(engine(q_path)(ids), expected) < 1e-5
    assert relative_error(engine(q_path, placement={1: [0, 1, 2, 3], 2: [6]})(ids), expected) < 1e-5


def test_kimi_int4_checkpoint(checkpoints, tmp_path, reference_cpu_path):
    """Kimi K2 Thinking / K2.5 style: routed experts in compressed-tensors int4 g32."""
    def quantize(name, t):
        base = name[: -len(".weight")]
        packed, scale, shape, dequant = _int4_g32(t)
        return {f"{base}.weight_packed": packed, f"{base}.weight_scale": scale, f"{base}.weight_shape": shape}, dequant

    path = checkpoints("deepseek_v3")
    config = dict(load_config(path), model_type="kimi_k2")
    q_path, f_path = _quantize_checkpoint(path, tmp_path, quantize, lambda n: bool(EXPERT.fullmatch(n)), config)
    ids = tokens(12)
    expected = engine(f_path)(ids)
    assert relative_error(engine(q_path)(ids), expected) < 1e-5
    assert relative_error(engine(q_path, placement={2: range(8)})(ids), expected) < 1e-5


def test_gpt_oss_mxfp4_checkpoint(checkpoints, tmp_path, reference_cpu_path):
    """GPT-OSS as released: experts as MXFP4 blocks in [E, out, in] order, while the float
    layout transformers writes is [E, in, out]."""
    def quantize(name, t):
        blocks, scales, dequant = _mxfp4(t.transpose(1, 2).contiguous())
        return {f"{name}_blocks": blocks, f"{name}_scales": scales}, dequant.transpose(1, 2)

    q_path, f_path = _quantize_checkpoint(
        checkpoints("gpt_oss"), tmp_path, quantize, lambda n: n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    ids = tokens(12)
    expected = engine(f_path)(ids)
    assert relative_error(engine(q_path)(ids), expected) < 1e-5
    assert relative_error(engine(q_path, placement={0: [1, 2], 1: range(8)})(ids), expected) < 1e-5


@pytest.fixture
def reference_cpu_path(monkeypatch):
    """The checkpoint's quantized experts decoded by the PyTorch reference: these tests check
    what is read (to 1e-5), and the native kernels round the activations to int8 as llama.cpp
    does (checked against this same reference in tests/native)."""
    monkeypatch.setenv("HYBRIDMOE_NATIVE", "0")


# --- errors ---------------------------------------------------------------------------


def _rewrite(path: Path, out: Path, edit) -> Path:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    return _write(out, tensors, load_config(path))


def test_missing_tensor_names_the_tensor_and_the_checkpoint(checkpoints, tmp_path):
    broken = _rewrite(checkpoints("qwen3_moe"), tmp_path / "broken",
                      lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ModelError) as err:
        engine(broken)
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in str(err.value)
    assert str(broken) in str(err.value)


def test_wrong_shape_names_the_tensor(checkpoints, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :-8]

    broken = _rewrite(checkpoints("deepseek_v3"), tmp_path / "broken", edit)
    with pytest.raises(ModelError, match=r"model\.layers\.0\.self_attn\.o_proj\.weight.*shape"):
        engine(broken)


def test_wrong_expert_shape_is_found_when_the_expert_is_read(checkpoints, tmp_path):
    def edit(t):
        t["model.layers.1.mlp.experts.0.down_proj.weight"] = t["model.layers.1.mlp.experts.0.down_proj.weight"].t()

    broken = _rewrite(checkpoints("qwen3_moe"), tmp_path / "broken", edit)
    with pytest.raises(ModelError, match=r"experts\.0\.down_proj\.weight.*shape"):
        engine(broken, placement={1: [0]})


def test_missing_shard_is_named(checkpoints, tmp_path):
    path = checkpoints("qwen3_moe")
    out = tmp_path / "sharded"
    shutil.copytree(path, out)
    names = load_file(str(path / "model.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (out / "model.safetensors").rename(out / "model-00001-of-00002.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelError, match="model-00002-of-00002.safetensors"):
        open_weights(out)


def test_unsupported_architecture_suggests_llamacpp(checkpoints):
    path = checkpoints("qwen3_moe")
    config = dict(load_config(path), model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="--backend llamacpp"):
        engine(path, config)


def test_missing_config_key_is_named(checkpoints):
    path = checkpoints("qwen3_moe")
    config = load_config(path)
    del config["num_attention_heads"]
    with pytest.raises(ModelError, match="num_attention_heads"):
        engine(path, config)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ModelError, match="no .safetensors"):
        open_weights(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelError, match="not a readable safetensors file"):
        open_weights(tmp_path)


def test_int4_packing_helper_round_trips():
    """The test's own int4 packer agrees with the quant module's reading of it."""
    from hybridmoe.backend.formats.quant import from_compressed_int4

    w = torch.randn(16, 64)
    packed, scale, shape, dequant = _int4_g32(w)
    assert torch.equal(from_compressed_int4(packed, scale, shape).dequantize(torch.float32), dequant)
    assert math.isclose(float((dequant - w).abs().max()), 0.0, abs_tol=float(scale.float().max()))
