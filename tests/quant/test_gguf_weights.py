"""GGUF files as a weight source under Hugging Face names (hybridmoe.backend.formats.gguf_weights).

Tiny GGUFs are written with gguf.GGUFWriter and read back: names, shapes, values (against
gguf-py's numpy dequantization of what was written), views into the mmap, llama.cpp's
layout changes undone, split sets, and the errors a user can cause.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import get_tensor_name_map
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES

from hybridmoe.backend.formats.gguf_weights import SUPPORTED_ARCHITECTURES, GGUFWeights, open_gguf
from hybridmoe.backend.formats.quant import QuantTensor
from hybridmoe.backend.errors import ModelError, UnsupportedModelError

from .tiny_gguf import llama_permute, rand, write_gguf

H, NH, NKV, HD, E, I, V = 64, 4, 2, 16, 4, 32, 96


def _floats(x):
    return x.dequantize() if isinstance(x, QuantTensor) else x.float()


def _in_mmap(w: GGUFWeights, t: torch.Tensor) -> bool:
    """Whether `t`'s bytes lie inside one of the files' mappings (i.e. nothing was copied)."""
    ptr = t.data_ptr()
    return any(r.data.ctypes.data <= ptr < r.data.ctypes.data + r.data.nbytes for r in w._readers)


def _attn(rng, b, qtype=T.Q8_0, bias=False):
    t = {
        b + "attn_norm.weight": (rand(rng, H), T.F32),
        b + "attn_q.weight": (rand(rng, NH * HD, H), qtype),
        b + "attn_k.weight": (rand(rng, NKV * HD, H), qtype),
        b + "attn_v.weight": (rand(rng, NKV * HD, H), qtype),
        b + "attn_output.weight": (rand(rng, H, NH * HD), qtype),
    }
    if bias:
        for p, n in (("q", NH * HD), ("k", NKV * HD), ("v", NKV * HD), ("output", H)):
            t[b + f"attn_{p}.bias"] = (rand(rng, n), T.F32)
    return t


def _experts(rng, b, qtype, n_in=H, inter=I, n_expert=E):
    return {
        b + "ffn_gate_exps.weight": (rand(rng, n_expert, inter, n_in), qtype),
        b + "ffn_up_exps.weight": (rand(rng, n_expert, inter, n_in), qtype),
        b + "ffn_down_exps.weight": (rand(rng, n_expert, n_in, inter), qtype),
    }


def _globals(rng):
    return {
        "token_embd.weight": (rand(rng, V, H), T.Q8_0),
        "output.weight": (rand(rng, V, H), T.F16),
        "output_norm.weight": (rand(rng, H), T.F32),
    }


# ---- Qwen3-MoE: merged experts in Q8_0 and Q4_0 ----------------------------------------


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    rng = np.random.default_rng(0)
    t = _globals(rng)
    for layer, qtype in ((0, T.Q8_0), (1, T.Q4_0)):
        b = f"blk.{layer}."
        t |= _attn(rng, b)
        t |= {
            b + "attn_q_norm.weight": (rand(rng, HD), T.F32),
            b + "attn_k_norm.weight": (rand(rng, HD), T.F32),
            b + "ffn_norm.weight": (rand(rng, H), T.F32),
            b + "ffn_gate_inp.weight": (rand(rng, E, H), T.F32),
        }
        t |= _experts(rng, b, qtype)
    kv = {"qwen3moe.block_count": 2, "qwen3moe.attention.head_count": NH,
          "qwen3moe.attention.head_count_kv": NKV, "qwen3moe.expert_count": E,
          "qwen3moe.rope.freq_base": 1e6, "general.name": "tiny qwen3"}
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3moe.gguf"
    stored = write_gguf(path, "qwen3moe", t, kv)
    return path, stored


def test_qwen3moe_names(qwen3):
    path, _ = qwen3
    w = open_gguf(path)
    assert w.architecture == "qwen3moe"
    expected = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    for layer in range(2):
        p = f"model.layers.{layer}."
        expected |= {p + s for s in (
            "input_layernorm.weight", "post_attention_layernorm.weight",
            "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
            "mlp.gate.weight")}
        expected |= {f"{p}mlp.experts.{e}.{proj}.weight" for e in range(E) for proj in ("gate_proj", "up_proj", "down_proj")}
    assert set(w.keys()) == expected and len(w) == len(expected) and set(w) == expected
    assert w.unmapped == ()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in w
    assert "model.layers.1.mlp.experts.4.down_proj.weight" not in w
    with pytest.raises(KeyError, match="tiny-qwen3moe.gguf"):
        w.get("model.layers.2.self_attn.q_proj.weight")


def test_qwen3moe_values_shapes_and_views(qwen3):
    path, stored = qwen3
    w = open_gguf(path)
    for name in w:
        t = w.get(name)
        ref = stored[w.gguf_name(name)]
        m = re.search(r"experts\.(\d+)\.", name)
        if m:
            ref = ref[int(m.group(1))]
        assert tuple(t.shape) == ref.shape, name
        np.testing.assert_array_equal(_floats(t).numpy(), ref, err_msg=name)
        raw = t.parts["data"] if isinstance(t, QuantTensor) else t
        assert _in_mmap(w, raw), f"{name} was copied"
    gate = w.get("model.layers.1.mlp.experts.2.gate_proj.weight")
    assert isinstance(gate, QuantTensor) and gate.format == "q4_0" and tuple(gate.shape) == (I, H)
    assert w.tensor_format("model.layers.0.mlp.experts.0.up_proj.weight") == "q8_0"
    assert w.tensor_format("model.layers.1.mlp.experts.0.up_proj.weight") == "q4_0"
    assert w.tensor_format("lm_head.weight") == "f16" and w.get("lm_head.weight").dtype == torch.float16
    assert w.tensor_format("model.norm.weight") == "f32"
    assert w.gguf_name("model.layers.1.mlp.experts.2.down_proj.weight") == "blk.1.ffn_down_exps.weight"
    merged = w.get_gguf("blk.1.ffn_down_exps.weight")
    assert tuple(merged.shape) == (E, H, I)
    assert torch.equal(merged[2].dequantize(), w.get("model.layers.1.mlp.experts.2.down_proj.weight").dequantize())


def test_metadata(qwen3):
    w = open_gguf(qwen3[0])
    md = w.metadata
    assert md["general.architecture"] == "qwen3moe" and md["general.name"] == "tiny qwen3"
    assert md["qwen3moe.attention.head_count"] == NH and md["qwen3moe.expert_count"] == E
    assert md["qwen3moe.rope.freq_base"] == pytest.approx(1e6)
    assert not any(k.startswith("GGUF.") for k in md)
    with w:
        pass
    assert len(w) == 0  # closed


# ---- DeepSeek-V3 (deepseek2): MLA, dense first layer, shared experts, both kv_b forms -------

NOPE, ROPE, VD, KVL, QL, DH = 32, 16, 32, 32, 32, 2  # qk_nope, qk_rope, v_head, kv_lora, q_lora, heads


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    rng = np.random.default_rng(1)
    t = _globals(rng)
    kv_b = {}
    for layer in range(3):
        b = f"blk.{layer}."
        t |= {
            b + "attn_norm.weight": (rand(rng, H), T.F32),
            b + "ffn_norm.weight": (rand(rng, H), T.F32),
            b + "attn_q_a.weight": (rand(rng, QL, H), T.Q8_0),
            b + "attn_q_a_norm.weight": (rand(rng, QL), T.F32),
            b + "attn_q_b.weight": (rand(rng, DH * (NOPE + ROPE), QL), T.Q8_0),
            b + "attn_kv_a_mqa.weight": (rand(rng, KVL + ROPE, H), T.Q8_0),
            b + "attn_kv_a_norm.weight": (rand(rng, KVL), T.F32),
            b + "attn_output.weight": (rand(rng, H, DH * VD), T.Q8_0),
        }
        kv_b[layer] = rand(rng, DH * (NOPE + VD), KVL)
        if layer < 2:
            t[b + "attn_kv_b.weight"] = (kv_b[layer], T.Q8_0 if layer else T.F32)
        else:
            # newer llama.cpp conversions: split per head, k part transposed (MLA absorption)
            heads = kv_b[layer].reshape(DH, NOPE + VD, KVL)
            t[b + "attn_k_b.weight"] = (heads[:, :NOPE].transpose(0, 2, 1), T.Q8_0)  # [DH, KVL, NOPE]
            t[b + "attn_v_b.weight"] = (heads[:, NOPE:], T.Q8_0)  # [DH, VD, KVL]
        if layer == 0:
            t |= {b + "ffn_gate.weight": (rand(rng, 2 * I, H), T.F16),
                  b + "ffn_up.weight": (rand(rng, 2 * I, H), T.F16),
                  b + "ffn_down.weight": (rand(rng, H, 2 * I), T.F16)}
        else:
            t |= {b + "ffn_gate_inp.weight": (rand(rng, E, H), T.F32),
                  b + "exp_probs_b.bias": (rand(rng, E), T.F32),
                  b + "ffn_gate_shexp.weight": (rand(rng, I, H), T.Q8_0),
                  b + "ffn_up_shexp.weight": (rand(rng, I, H), T.Q8_0),
                  b + "ffn_down_shexp.weight": (rand(rng, H, I), T.Q8_0)}
            t |= _experts(rng, b, T.Q4_0 if layer == 1 else T.Q8_0)
    t["rope_freqs.weight"] = (rand(rng, 8), T.F32)  # no HF counterpart
    kv = {"deepseek2.block_count": 3, "deepseek2.attention.head_count": DH,
          "deepseek2.attention.head_count_kv": 1, "deepseek2.leading_dense_block_count": 1}
    path = tmp_path_factory.mktemp("ds") / "tiny-deepseek.gguf"
    stored = write_gguf(path, "deepseek2", t, kv)
    return path, stored, kv_b


def test_deepseek2_names_and_values(deepseek):
    path, stored, _ = deepseek
    w = open_gguf(path)
    a = "model.layers.1.self_attn."
    for s in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
        assert f"{a}{s}.weight" in w
    for s in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.mlp.{s}.weight" in w  # dense first layer
        assert f"model.layers.0.mlp.shared_experts.{s}.weight" not in w
        assert f"model.layers.1.mlp.shared_experts.{s}.weight" in w
        assert f"model.layers.2.mlp.experts.3.{s}.weight" in w
    assert "model.layers.0.mlp.gate.weight" not in w
    bias = w.get("model.layers.2.mlp.gate.e_score_correction_bias")
    np.testing.assert_array_equal(bias.numpy(), stored["blk.2.exp_probs_b.bias"])
    assert w.unmapped == ("rope_freqs.weight",)
    assert w.get("model.layers.1.mlp.experts.0.up_proj.weight").format == "q4_0"
    q_b = w.get("model.layers.0.self_attn.q_b_proj.weight")
    assert tuple(q_b.shape) == (DH * (NOPE + ROPE), QL)
    np.testing.assert_array_equal(q_b.dequantize().numpy(), stored["blk.0.attn_q_b.weight"])


def test_deepseek2_kv_b_from_either_form(deepseek):
    path, stored, kv_b = deepseek
    w = open_gguf(path)
    direct = w.get("model.layers.0.self_attn.kv_b_proj.weight")
    np.testing.assert_array_equal(direct.numpy(), kv_b[0])  # F32: exactly what was written
    rebuilt = w.get("model.layers.2.self_attn.kv_b_proj.weight")
    assert rebuilt.shape == (DH * (NOPE + VD), KVL) and rebuilt.dtype == torch.float32
    # exactly the stored (Q8_0) halves put back together ...
    k = stored["blk.2.attn_k_b.weight"].transpose(0, 2, 1)
    expect = np.concatenate([k, stored["blk.2.attn_v_b.weight"]], axis=1).reshape(-1, KVL)
    np.testing.assert_array_equal(rebuilt.numpy(), expect)
    # ... which is the original kv_b within Q8_0 rounding
    np.testing.assert_allclose(rebuilt.numpy(), kv_b[2], atol=np.abs(kv_b[2]).max() / 100)
    assert w.tensor_format("model.layers.2.self_attn.kv_b_proj.weight") == "q8_0"
    assert w.gguf_name("model.layers.2.self_attn.kv_b_proj.weight") == "blk.2.attn_k_b.weight"


# ---- Mixtral (llama arch): the Q/K row permutation ------------------------------------


def _rope_tables(n, hd, base=10000.0):
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    return ang.cos()[:, None], ang.sin()[:, None]  # [T, 1, hd/2]


def _rope_hf(x):
    """transformers' rotate_half RoPE: pairs (i, i + hd/2)."""
    cos, sin = _rope_tables(x.shape[0], x.shape[-1])
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_ggml_normal(x):
    """ggml's 'normal' RoPE, used by llama.cpp for the llama arch: pairs (2i, 2i + 1)."""
    cos, sin = _rope_tables(x.shape[0], x.shape[-1])
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).reshape(x.shape)


def _scores(x, wq, wk, rope):
    n = x.shape[0]
    q = rope((x @ wq.T).reshape(n, NH, HD))
    k = rope((x @ wk.T).reshape(n, NKV, HD)).repeat_interleave(NH // NKV, dim=1)
    return torch.einsum("thd,shd->hts", q, k)


def test_llama_permutation_is_what_ggml_rope_needs():
    """llama.cpp's permuted Q/K with its interleaved RoPE give the attention scores that the
    HF weights give with rotate-half RoPE (so undoing the permutation is right for HF code)."""
    g = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(NH * HD, H, generator=g, dtype=torch.float64), torch.randn(NKV * HD, H, generator=g, dtype=torch.float64)
    x = torch.randn(5, H, generator=g, dtype=torch.float64)
    hf = _scores(x, wq, wk, _rope_hf)
    wq_g = torch.from_numpy(llama_permute(wq.numpy(), NH))
    wk_g = torch.from_numpy(llama_permute(wk.numpy(), NKV))
    torch.testing.assert_close(_scores(x, wq_g, wk_g, _rope_ggml_normal), hf)
    assert not torch.allclose(_scores(x, wq, wk, _rope_ggml_normal), hf)  # the permutation matters


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    rng = np.random.default_rng(2)
    t = _globals(rng)
    hf = {}
    for layer, qtype in ((0, T.F32), (1, T.Q8_0)):
        b = f"blk.{layer}."
        hf[layer] = {"q": rand(rng, NH * HD, H), "k": rand(rng, NKV * HD, H)}
        t |= _attn(rng, b)
        t[b + "attn_q.weight"] = (llama_permute(hf[layer]["q"], NH), qtype)
        t[b + "attn_k.weight"] = (llama_permute(hf[layer]["k"], NKV), qtype)
        t |= {b + "ffn_norm.weight": (rand(rng, H), T.F32), b + "ffn_gate_inp.weight": (rand(rng, 2, H), T.F32)}
    t |= _experts(rng, "blk.0.", T.Q8_0, n_expert=2)
    for e in range(2):  # early-2024 GGUFs: one tensor per expert
        t |= {f"blk.1.ffn_gate.{e}.weight": (rand(rng, I, H), T.Q4_0),
              f"blk.1.ffn_up.{e}.weight": (rand(rng, I, H), T.Q4_0),
              f"blk.1.ffn_down.{e}.weight": (rand(rng, H, I), T.Q4_0)}
    kv = {"llama.block_count": 2, "llama.attention.head_count": NH, "llama.attention.head_count_kv": NKV,
          "llama.expert_count": 2, "llama.expert_used_count": 2}
    path = tmp_path_factory.mktemp("mixtral") / "tiny-mixtral.gguf"
    stored = write_gguf(path, "llama", t, kv)
    return path, stored, hf


def test_llama_q_k_come_back_in_hf_row_order(mixtral):
    path, stored, hf = mixtral
    w = open_gguf(path)
    q0 = w.get("model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_array_equal(q0.numpy(), hf[0]["q"])  # F32: the exact HF weight
    np.testing.assert_array_equal(w.get("model.layers.0.self_attn.k_proj.weight").numpy(), hf[0]["k"])
    # Q8_0: quantization is per row, so un-permuting rows gives quantize(HF) exactly
    from gguf import quants as gq
    for p, n in (("q", NH), ("k", NKV)):
        got = w.get(f"model.layers.1.self_attn.{p}_proj.weight")
        assert isinstance(got, QuantTensor) and got.format == "q8_0"
        np.testing.assert_array_equal(got.dequantize().numpy(), gq.dequantize(gq.quantize(hf[1][p], T.Q8_0), T.Q8_0))
    # v/o are not permuted by the converter and come back as written
    np.testing.assert_array_equal(w.get("model.layers.1.self_attn.v_proj.weight").dequantize().numpy(),
                                  stored["blk.1.attn_v.weight"])


def test_mixtral_expert_forms_and_aliases(mixtral):
    path, stored, _ = mixtral
    w = open_gguf(path)
    merged = w.get("model.layers.0.mlp.experts.1.down_proj.weight")
    np.testing.assert_array_equal(merged.dequantize().numpy(), stored["blk.0.ffn_down_exps.weight"][1])
    old = w.get("model.layers.1.mlp.experts.1.up_proj.weight")
    np.testing.assert_array_equal(old.dequantize().numpy(), stored["blk.1.ffn_up.1.weight"])
    # the names of Mixtral's own checkpoint work as aliases
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in w
    for hf_name, name in (("block_sparse_moe.experts.1.w1", "mlp.experts.1.gate_proj"),
                          ("block_sparse_moe.experts.1.w3", "mlp.experts.1.up_proj"),
                          ("block_sparse_moe.experts.0.w2", "mlp.experts.0.down_proj"),
                          ("block_sparse_moe.gate", "mlp.gate")):
        a, b = w.get(f"model.layers.1.{hf_name}.weight"), w.get(f"model.layers.1.{name}.weight")
        assert torch.equal(_floats(a), _floats(b))
    assert not any("block_sparse_moe" in k for k in w.keys())  # listed once, under one name


# ---- GPT-OSS: MXFP4 experts with biases, sinks, router bias ----------------------------


def test_gpt_oss(tmp_path):
    rng = np.random.default_rng(3)
    t = _globals(rng)
    b = "blk.0."
    t |= _attn(rng, b, bias=True)
    t |= _experts(rng, b, T.MXFP4, n_expert=2)
    t |= {b + "post_attention_norm.weight": (rand(rng, H), T.F32),
          b + "attn_sinks.weight": (rand(rng, NH), T.F32),
          b + "ffn_gate_inp.weight": (rand(rng, 2, H), T.F32),
          b + "ffn_gate_inp.bias": (rand(rng, 2), T.F32),
          b + "ffn_gate_exps.bias": (rand(rng, 2, I), T.F32),
          b + "ffn_up_exps.bias": (rand(rng, 2, I), T.F32),
          b + "ffn_down_exps.bias": (rand(rng, 2, H), T.F32)}
    stored = write_gguf(tmp_path / "gpt-oss.gguf", "gpt-oss", t, {"gpt-oss.attention.head_count": NH})
    w = open_gguf(tmp_path / "gpt-oss.gguf")
    p = "model.layers.0."
    up = w.get(p + "mlp.experts.1.up_proj.weight")
    assert up.format == "mxfp4" and up.layout == "gguf"
    np.testing.assert_array_equal(up.dequantize().numpy(), stored[b + "ffn_up_exps.weight"][1])
    np.testing.assert_array_equal(w.get(p + "mlp.experts.1.down_proj.bias").numpy(), stored[b + "ffn_down_exps.bias"][1])
    np.testing.assert_array_equal(w.get(p + "self_attn.sinks").numpy(), stored[b + "attn_sinks.weight"])
    np.testing.assert_array_equal(w.get(p + "mlp.router.bias").numpy(), stored[b + "ffn_gate_inp.bias"])
    assert p + "mlp.router.weight" in w and p + "mlp.gate.weight" not in w
    assert p + "post_attention_layernorm.weight" in w and p + "self_attn.o_proj.bias" in w
    # no permutation outside the llama arch
    np.testing.assert_array_equal(w.get(p + "self_attn.q_proj.weight").dequantize().numpy(), stored[b + "attn_q.weight"])


# ---- every tensor llama.cpp defines for each supported arch ------------------------------


def _shape(gguf_name):
    if "_exps" in gguf_name:
        return (2, 4, 32)
    if gguf_name.startswith("blk.0.attn_k_b"):
        return (2, 32, 16)
    if gguf_name.startswith("blk.0.attn_v_b"):
        return (2, 16, 32)
    if any(s in gguf_name for s in ("norm", "exp_probs_b", "sinks", "rope_freqs", "inp_shexp")):
        return (32,)
    return (4, 32)


@pytest.mark.parametrize("arch_name", SUPPORTED_ARCHITECTURES)
def test_mapping_agrees_with_gguf_py_tensor_map(tmp_path, arch_name):
    """Write every tensor gguf-py lists for the arch; each must get the HF name whose
    gguf-py mapping (HF -> GGUF, the converter's table) leads back to it."""
    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name)
    tensors = {}
    for kind in MODEL_TENSORS[arch]:
        base = TENSOR_NAMES[kind].format(bid=0)
        names = [base] if base in ("attn_sinks",) else [base + ".weight"]
        if base in ("blk.0.exp_probs_b",):
            names = [base + ".bias"]
        for n in names:
            tensors[n] = (np.ones(_shape(n), dtype=np.float32), T.F32)
    write_gguf(tmp_path / "all.gguf", arch_name, tensors,
               {f"{arch_name}.attention.head_count": 2, f"{arch_name}.attention.head_count_kv": 2})
    w = open_gguf(tmp_path / "all.gguf")
    assert set(w.unmapped) <= {"rope_freqs.weight", "blk.0.attn_rot_embd.weight"}
    tmap = get_tensor_name_map(arch, 1)
    for name in w:
        gguf_name = w.gguf_name(name)
        if name.endswith("kv_b_proj.weight") and "attn_k_b" in gguf_name:
            continue  # rebuilt from two tensors
        generic = re.sub(r"\.experts\.\d+\.", ".experts.", name)  # merged-experts HF name
        # the DeepSeek-V3 converter renames this one before mapping it
        generic = generic.replace("e_score_correction_bias", "e_score_correction.bias")
        stem, _, suffix = generic.rpartition(".")
        mapped = tmap.get_name(generic) if suffix not in ("weight", "bias") else tmap.get_name(generic, try_suffixes=(".weight", ".bias"))
        if mapped is None and suffix in ("weight", "bias"):
            mapped = tmap.get_name(stem)
        if suffix not in ("weight", "bias") and mapped is not None:
            # GPT-OSS sinks have no suffix in HF; the converter adds ".weight" (llama.cpp
            # loads blk.N.attn_sinks.weight), older files may lack it: both are accepted.
            assert gguf_name in (mapped, mapped + ".weight"), (name, gguf_name, mapped)
        else:
            assert mapped == gguf_name, (name, gguf_name, mapped)
        _floats(w.get(name))  # every mapped tensor can be read


# ---- split sets and errors ---------------------------------------------------------------


def test_split_gguf(tmp_path):
    rng = np.random.default_rng(4)
    t = _globals(rng) | _attn(rng, "blk.0.") | _experts(rng, "blk.0.", T.Q8_0)
    stored = write_gguf(tmp_path / "tiny.gguf", "qwen3moe", t, {"qwen3moe.attention.head_count": NH},
                        split_max_tensors=3)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(parts) == 4 and parts[0].name == "tiny-00001-of-00004.gguf"
    w = open_gguf(parts[2])  # any part opens the set
    assert w.files == tuple(parts)
    assert w.architecture == "qwen3moe" and w.metadata["qwen3moe.attention.head_count"] == NH
    np.testing.assert_array_equal(w.get("model.layers.0.mlp.experts.3.down_proj.weight").dequantize().numpy(),
                                  stored["blk.0.ffn_down_exps.weight"][3])
    np.testing.assert_array_equal(w.get("model.norm.weight").numpy(), stored["output_norm.weight"])
    assert open_gguf(tmp_path).files == tuple(parts)  # a directory with one model
    parts[3].unlink()
    with pytest.raises(ModelError, match="tiny-00004-of-00004.gguf"):
        open_gguf(parts[0])


@pytest.fixture
def small_gguf(tmp_path):
    rng = np.random.default_rng(5)
    write_gguf(tmp_path / "m.gguf", "qwen3moe", _globals(rng) | _experts(rng, "blk.0.", T.Q4_0))
    return tmp_path / "m.gguf"


@pytest.mark.parametrize("keep", [0.5, 0.98, 40 / 100_000])
def test_truncated_gguf(small_gguf, keep):
    size = small_gguf.stat().st_size
    bad = small_gguf.with_name("cut.gguf")
    shutil.copy(small_gguf, bad)
    with open(bad, "r+b") as f:
        f.truncate(max(8, int(size * keep)))
    with pytest.raises(ModelError) as err:
        open_gguf(bad)
    assert "cut.gguf" in str(err.value) and ("truncated" in str(err.value) or "corrupt" in str(err.value))
    assert not isinstance(err.value, UnsupportedModelError)


def test_not_a_gguf(tmp_path):
    for name, content in (("config.json", b'{"model_type": "qwen3_moe"}'), ("empty.gguf", b"")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ModelError, match=name.replace(".", r"\.")):
            open_gguf(tmp_path / name)
    with pytest.raises(ModelError, match="missing.gguf"):
        open_gguf(tmp_path / "missing.gguf")
    (tmp_path / "sub").mkdir()
    with pytest.raises(ModelError, match="neither config.json nor a .gguf model file"):  # inspect's words
        open_gguf(tmp_path / "sub")


def test_unsupported_architecture_and_type(tmp_path):
    write_gguf(tmp_path / "bert.gguf", "bert", {"token_embd.weight": (np.ones((4, 32), np.float32), T.F32)})
    with pytest.raises(UnsupportedModelError, match="bert"):
        open_gguf(tmp_path / "bert.gguf")

    from gguf import GGUFWriter
    w = GGUFWriter(tmp_path / "tq1.gguf", "qwen3moe")  # TQ1_0: a type the engine does not read
    w.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((2, 4, 54), dtype=np.uint8), raw_dtype=T.TQ1_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError) as err:
        open_gguf(tmp_path / "tq1.gguf")
    assert "TQ1_0" in str(err.value) and "blk.0.ffn_down_exps.weight" in str(err.value)
