"""GPT-OSS as released: MXFP4 experts become GGML MXFP4 blocks bit for bit, whatever --quant.

A tiny GPT-OSS checkpoint written by transformers has its experts quantized here to MXFP4 in
the layout OpenAI publishes (``*_blocks`` [E, out, in/32, 16] with the even element of each
pair in the low nibble, ``*_scales`` [E, out, in/32] e8m0 exponents, gate and up rows
interleaved) and is declared ``quant_method: mxfp4`` as the published config.json is.

The reference is transformers running the same numbers: MXFP4 values (e2m1 times a power of
two) are exact in bf16, so a float twin of the checkpoint holding the dequantized experts is
what transformers' own MXFP4 loader computes on a CPU (it dequantizes to bf16 there; it needs
the accelerate package for that path, which the test environment does not have).
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.convert.conftest import (
    hf_greedy,
    hf_logits,
    llama_greedy,
    llama_logits,
    needs_llama_cpp,
    open_llama,
)

# OCP MX e2m1: code = sign << 3 | exponent << 1 | mantissa.
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
PROMPT = [5, 17, 42, 99, 120, 7, 3, 200, 61, 33]
STEPS = 16


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, scales, values) of `w` [..., out, in] quantized over the last dimension."""
    *lead, cols = w.shape
    groups = w.float().reshape(*lead, cols // 32, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-8) / 6.0))
    codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = (E2M1[codes.long()] * torch.exp2(exponent)[..., None]).reshape(w.shape)
    return blocks, (exponent + 127).to(torch.uint8), values


@pytest.fixture(scope="module")
def released(checkpoints, tmp_path_factory):
    """(MXFP4 checkpoint dir, float reference model, {HF name: (blocks, scales, values)})."""
    import transformers

    # Every token to every expert: llama.cpp rounds activations to 8 bits for MXFP4 matmuls,
    # and a top-k choice within that noise would flip (see test_parity).
    source = checkpoints("gpt_oss", True).path
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    quantized, twin = root / "mxfp4", root / "float"
    tensors = load_file(str(source / "model.safetensors"))
    q_state, f_state, packed = {}, {}, {}
    for name, t in tensors.items():
        if FUSED.fullmatch(name):
            blocks, scales, values = mxfp4(t.transpose(1, 2).contiguous())  # published layout: [E, out, in]
            q_state[f"{name}_blocks"], q_state[f"{name}_scales"] = blocks, scales
            f_state[name] = values.transpose(1, 2).contiguous().to(torch.bfloat16)
            assert torch.equal(f_state[name].float(), values.transpose(1, 2))  # exact in bf16
            packed[name] = (blocks, scales, values)
        else:
            q_state[name] = f_state[name] = t
    for directory, state in ((quantized, q_state), (twin, f_state)):
        shutil.copytree(source, directory)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    (quantized / "config.json").write_text(json.dumps(config))
    reference = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    return quantized, reference, packed


@pytest.mark.parametrize("quant", ["bf16", "q8_0", pytest.param("q4_k_m", marks=needs_llama_cpp)])
def test_mxfp4_experts_are_repacked_bit_exactly(released, tmp_path, quant):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from hybridmoe.backend.convert import to_gguf

    directory, _, packed = released
    reader = GGUFReader(to_gguf(directory, tmp_path / "gpt-oss.gguf", quant))
    tensors = {t.name: t for t in reader.tensors}
    checked = 0
    for name, (blocks, scales, values) in packed.items():
        layer, proj = FUSED.fullmatch(name).groups()
        # gate_up rows interleave gate (even) and up (odd); llama.cpp keeps them apart.
        parts = {"down": slice(None)} if proj == "down_proj" else {"gate": slice(0, None, 2), "up": slice(1, None, 2)}
        for part, rows in parts.items():
            t = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
            assert t.tensor_type == GGMLQuantizationType.MXFP4  # whatever --quant says
            data = np.asarray(t.data)  # [E, out, in/32 * 17]
            ggml = data.reshape(*data.shape[:2], -1, 17)
            # The exponent byte is the checkpoint's; the 32 codes are its codes, reordered
            # from pairs per byte to GGML's halves per block.
            assert np.array_equal(ggml[..., 0], scales[:, rows].numpy())
            codes = np.concatenate([ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4], axis=-1)
            hf_codes = torch.stack((blocks[:, rows] & 0x0F, blocks[:, rows] >> 4), dim=-1).flatten(-2)
            assert np.array_equal(codes, hf_codes.numpy())
            # And llama.cpp's decoder (gguf-py's port of it) gives back the same numbers.
            assert np.array_equal(dequantize(data, GGMLQuantizationType.MXFP4), values[:, rows].numpy())
            checked += 1
    assert checked == 3 * 3
    want = {"bf16": GGMLQuantizationType.BF16, "q8_0": GGMLQuantizationType.Q8_0}.get(quant)
    attn = tensors["blk.0.attn_q.weight"].tensor_type
    assert attn == want if want is not None else attn not in (GGMLQuantizationType.BF16, GGMLQuantizationType.MXFP4)


@needs_llama_cpp
def test_mxfp4_gguf_matches_transformers(released, tmp_path):
    """llama.cpp on the converted release computes what transformers does on the release."""
    from hybridmoe.backend.convert import to_gguf

    directory, reference, _ = released
    llm = open_llama(to_gguf(directory, tmp_path / "gpt-oss.gguf", "bf16"))
    tolerance = 0.6  # as for Q8_0 files: llama.cpp rounds activations to 8 bits for MXFP4 matmuls
    try:
        diff = (hf_logits(reference, PROMPT) - llama_logits(llm, PROMPT)).abs().max().item()
        print(f"gpt_oss mxfp4: max |logit diff| {diff:.4f}")
        assert diff < tolerance
        ours = llama_greedy(llm, PROMPT, STEPS)
    finally:
        llm.close()
    # Every greedy step picks transformers' best token, or one within the tolerance of it
    # (a near tie), with transformers fed the same sequence; nearly all agree outright.
    logits = hf_logits(reference, PROMPT + ours)[len(PROMPT) - 1 : -1]
    chosen = logits[torch.arange(STEPS), torch.tensor(ours)]
    assert (logits.max(dim=1).values - chosen <= tolerance).all()
    assert int((logits.argmax(dim=1) == torch.tensor(ours)).sum()) >= STEPS - 2
    assert ours[:4] == hf_greedy(reference, PROMPT, 4)


@needs_llama_cpp
def test_engine_runs_the_mxfp4_gguf_as_the_checkpoint(released, tmp_path):
    """The engine reads the repacked blocks as the checkpoint's (the same model), and agrees
    with llama.cpp on the file."""
    from hybridmoe.backend.convert import to_gguf
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model

    directory, _, _ = released
    path = to_gguf(directory, tmp_path / "gpt-oss.gguf", "bf16")
    ids = torch.tensor(PROMPT)

    def run(p):
        return build_model(inspect_model(p).spec.config, open_weights(p), max_context=64, dtype=torch.float32)(ids, 0)

    from_gguf, from_checkpoint = run(path), run(directory)
    # The same model to the rounding of the activations: a GGUF's experts multiply them as
    # llama.cpp does, on their Q8 values (1.6e-2 of the largest logit here), the checkpoint's
    # exactly, as transformers.
    assert float((from_gguf - from_checkpoint).abs().max()) < 0.05 * float(from_checkpoint.abs().max())
    llm = open_llama(path)
    try:
        theirs = llama_logits(llm, PROMPT)
    finally:
        llm.close()
    assert float((from_gguf - theirs).abs().max()) < 0.05 * float(theirs.abs().max())
    assert bool((from_gguf.argmax(-1) == theirs.argmax(-1)).all())
