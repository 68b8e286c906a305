"""Checkpoint layouts and config vintages the engine accepts, each giving the same model.

transformers 5.24 ``save_pretrained`` writes per-expert tensors (the hub layout) for every
family here except GPT-OSS, which it writes fused; the other layouts are produced from
those checkpoints by rewriting the tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.engine.conftest import engine, load_config, relative_error, tokens

EXPERT = re.compile(r"(model\.layers\.\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|bias)")


def _write(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def _stored_names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_transformers_writes_per_expert_tensors_except_for_gpt_oss(checkpoints):
    """The naming finding the layouts below rely on (transformers 5.24 save_pretrained)."""
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in _stored_names(checkpoints("deepseek_v3"))
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in _stored_names(checkpoints("qwen3_moe"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in _stored_names(checkpoints("mixtral"))
    gpt_oss = _stored_names(checkpoints("gpt_oss"))
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias"} <= gpt_oss
    # ... and writes num_local_experts for Qwen3-MoE, whose hub configs say num_experts.
    assert "num_local_experts" in load_config(checkpoints("qwen3_moe"))


def _fuse(tensors: dict[str, torch.Tensor], names: tuple[str, str, str], rename_block: bool) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> transformers' in-memory layout: experts.gate_up_proj [E, 2I, H]
    (gate rows first) and experts.down_proj [E, H, I]."""
    gate, up, down = names
    out, experts = {}, {}
    for name, t in tensors.items():
        m = EXPERT.fullmatch(name)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(3)), m.group(4))] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.") if rename_block else name] = t
    for layer, parts in experts.items():
        n = 1 + max(e for e, _ in parts)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat((parts[e, gate], parts[e, up])) for e in range(n)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([parts[e, down] for e in range(n)])
    return out


@pytest.mark.parametrize("family,names", [
    ("deepseek_v3", ("gate_proj", "up_proj", "down_proj")),
    ("qwen3_moe", ("gate_proj", "up_proj", "down_proj")),
    ("mixtral", ("w1", "w3", "w2")),
])
def test_fused_expert_layout_gives_the_same_model(family, names, checkpoints, tmp_path):
    path = checkpoints(family)
    fused = _write(tmp_path / "fused", _fuse(load_file(str(path / "model.safetensors")), names, family == "mixtral"),
                   load_config(path))
    assert not any(EXPERT.fullmatch(n) for n in _stored_names(fused))
    ids = tokens(12)
    expected = engine(path)(ids)
    # Equal up to float32 rounding: a fused gate_up matrix is one matmul where the per-expert
    # layout's CPU path does two.
    assert relative_error(engine(fused)(ids), expected) < 1e-5
    assert relative_error(engine(fused, placement={1: [1, 5]})(ids), expected) < 1e-5


def test_gpt_oss_per_expert_layout_gives_the_same_model(checkpoints, tmp_path):
    """GPT-OSS experts one by one, gate and up separate, with biases: the layout the GGUF
    weight source exposes (llama.cpp de-interleaves gate and up)."""
    path = checkpoints("gpt_oss")
    tensors = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?", name)
        if not m:
            out[name] = t
            continue
        prefix, proj, bias = m.groups()
        for e in range(t.shape[0]):
            w = t[e] if bias else t[e].t()  # stored for x @ W: back to [out, in]
            suffix = "bias" if bias else "weight"
            if proj == "gate_up_proj":
                out[f"{prefix}.{e}.gate_proj.{suffix}"] = w[0::2]
                out[f"{prefix}.{e}.up_proj.{suffix}"] = w[1::2]
            else:
                out[f"{prefix}.{e}.down_proj.{suffix}"] = w
    split = _write(tmp_path / "split", out, load_config(path))
    ids = tokens(12)
    expected = engine(path)(ids)
    assert relative_error(engine(split)(ids), expected) < 1e-5
    assert relative_error(engine(split, placement={0: [0, 3], 2: [7]})(ids), expected) < 1e-5


def _hub_style(config: dict) -> dict:
    """transformers 5's rope_parameters back to the hub's rope_theta + rope_scaling."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        config["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type")
    config["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    return config


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "glm4_moe", "gpt_oss"])
def test_hub_style_config_gives_the_same_model(family, checkpoints):
    path = checkpoints(family)
    config = _hub_style(load_config(path))
    if family == "qwen3_moe":
        config["num_experts"] = config.pop("num_local_experts")
    if family == "glm4_moe":
        del config["partial_rotary_factor"]  # absent from some GLM configs: 0.5 is the default
    ids = tokens(12)
    assert torch.equal(engine(path, config)(ids), engine(path)(ids))


def _kimi_k2_config(path: Path) -> dict:
    config = _hub_style(load_config(path))
    config.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], scoring_func="sigmoid",
                  topk_method="noaux_tc")
    config.pop("rope_interleave", None)  # Kimi's config.json does not carry it: interleaved by default
    return config


def test_kimi_k2_config(checkpoints):
    path = checkpoints("deepseek_v3")
    ids = tokens(12)
    assert torch.equal(engine(path, _kimi_k2_config(path))(ids), engine(path)(ids))


def test_kimi_k25_wrapper_with_language_model_prefix(checkpoints, tmp_path):
    """Kimi K2.5/K2.6: the text model under `text_config`, its tensors under
    `language_model.`, next to a vision tower the engine does not load."""
    path = checkpoints("deepseek_v3")
    tensors = {f"language_model.{k}": v for k, v in load_file(str(path / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3)
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": _kimi_k2_config(path), "vision_config": {"hidden_size": 8}}
    wrapped = _write(tmp_path / "k25", tensors, config)
    ids = tokens(12)
    assert relative_error(engine(wrapped)(ids), engine(path)(ids)) < 1e-6


def test_sharded_checkpoint_with_index(checkpoints, tmp_path):
    path = checkpoints("qwen3_moe")
    tensors = load_file(str(path / "model.safetensors"))
    out = tmp_path / "sharded"
    out.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: tensors[n] for n in names[i::3]}
        save_file(part, str(out / shard))
        weight_map.update({n: shard for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text((path / "config.json").read_text())
    ids = tokens(12)
    assert relative_error(engine(out)(ids), engine(path)(ids)) < 1e-6
