"""DeepSeek-V3 fp8 block checkpoints: every weight is dequantized block by block (weight ×
its 128×128 block's scale) before it is encoded, the same numbers the engine reads from the
checkpoint itself."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.convert.conftest import build_checkpoint

_FP8_MAX = 448.0  # float8_e4m3fn


def _to_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    pad = torch.zeros((rows + 127) // 128 * 128, (cols + 127) // 128 * 128)
    pad[:rows, :cols] = w.float()
    blocks = pad.reshape(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / _FP8_MAX
    scale[scale == 0] = 1.0
    q = (blocks / scale[:, None, :, None]).reshape(pad.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale.to(torch.float32)


def test_fp8_block_checkpoint(tmp_path):
    from hybridmoe.backend.convert import to_gguf
    from hybridmoe.backend.formats.gguf_weights import open_gguf
    from hybridmoe.backend.formats.quant import from_fp8_block

    directory = tmp_path / "ds_fp8"
    build_checkpoint(directory, "deepseek_v3", seed=5)
    path = directory / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    expected = {}
    for name in list(state):
        # As DeepSeek-V3 ships: every Linear in fp8 except the router; embeddings, head and
        # norms in bf16.
        if name.endswith(("proj.weight", "proj_with_mqa.weight")):
            q, scale = _to_fp8_blocks(state[name])
            state[name] = q
            state[name + "_scale_inv"] = scale
            expected[name] = from_fp8_block(q, scale).dequantize(torch.bfloat16)
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))

    out = to_gguf(directory, tmp_path / "ds.gguf", "bf16")
    with open_gguf(out) as g:
        for name, want in expected.items():
            got = g.get(name)
            if "kv_b_proj" in name:
                # Rebuilt by the engine from attn_k_b / attn_v_b, stored bf16 each.
                assert torch.equal(got.to(torch.bfloat16), want), name
            else:
                assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    assert len(expected) > 20
