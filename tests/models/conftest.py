"""Tiny checkpoints and GGUF files for the model-inspection tests, written once per session."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

# The real config.json files of the target models, as the catalogue ships them; and of a model
# the project does not serve (its refusal is tested).
CONFIGS = Path(__file__).resolve().parents[2] / "assets" / "configs"
UNSUPPORTED_CONFIGS = Path(__file__).resolve().parent / "data"


def shared_config(name: str) -> dict:
    path = CONFIGS / f"{name}.json"
    return json.loads((path if path.exists() else UNSUPPORTED_CONFIGS / f"{name}.json").read_text())


# Tiny sizes: hidden 64 and expert width 32 keep every row a whole number of 32-weight blocks.
TINY_HF = {
    "qwen3_moe": ("Qwen3MoeConfig", {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [0]}),
    "qwen2_moe": ("Qwen2MoeConfig", {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}),
    "mixtral": ("MixtralConfig", {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe": ("OlmoeConfig", {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "eos_token_id": 1, "pad_token_id": 0}),
    "deepseek_v3": ("DeepseekV3Config", {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 32,
        "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_group": 1,
        "topk_group": 1, "num_nextn_predict_layers": 0}),
    "glm4_moe": ("Glm4MoeConfig", {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "use_qk_norm": True, "num_nextn_predict_layers": 0}),
    "gpt_oss": ("GptOssConfig", {
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 8}),
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny bf16 checkpoint per family, saved by transformers (sharded, with an index)."""
    import torch
    import transformers

    root = tmp_path_factory.mktemp("hf")
    out = {}
    torch.manual_seed(0)
    for family, (cls_name, kwargs) in TINY_HF.items():
        config = getattr(transformers, cls_name)(**kwargs)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        path = root / family
        # A small shard size forces several shards and a model.safetensors.index.json.
        model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
        out[family] = path
    return out


@pytest.fixture(scope="session")
def kimi_like_checkpoint(tmp_path_factory) -> Path:
    """A miniature Kimi K2.6 checkpoint: language model under ``language_model.``, int4 g32
    compressed-tensors experts (weight_packed/weight_scale/weight_shape), a vision tower and
    a projector, and one MTP layer beyond num_hidden_layers."""
    import torch
    from safetensors.torch import save_file

    config = shared_config("moonshotai__Kimi-K2.6")
    t = config["text_config"]
    t.update(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
             kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
             vocab_size=128, first_k_dense_replace=1, num_nextn_predict_layers=1)
    h, inter = 64, 32
    bf = torch.bfloat16
    tensors: dict[str, torch.Tensor] = {}

    def put(name, *shape, dtype=bf):
        tensors[name] = torch.zeros(*shape, dtype=dtype)

    lm = "language_model.model"
    put(f"{lm}.embed_tokens.weight", 128, h)
    put(f"{lm}.norm.weight", h)
    put("language_model.lm_head.weight", 128, h)
    for i in range(3):  # layer 2 is the MTP layer
        p = f"{lm}.layers.{i}"
        put(f"{p}.input_layernorm.weight", h)
        put(f"{p}.post_attention_layernorm.weight", h)
        put(f"{p}.self_attn.q_a_proj.weight", 48, h)
        put(f"{p}.self_attn.q_a_layernorm.weight", 48)
        put(f"{p}.self_attn.q_b_proj.weight", 2 * 24, 48)
        put(f"{p}.self_attn.kv_a_proj_with_mqa.weight", 32 + 8, h)
        put(f"{p}.self_attn.kv_a_layernorm.weight", 32)
        put(f"{p}.self_attn.kv_b_proj.weight", 2 * 32, 32)
        put(f"{p}.self_attn.o_proj.weight", h, 2 * 16)
        if i == 0:
            for n, shape in (("gate_proj", (96, h)), ("up_proj", (96, h)), ("down_proj", (h, 96))):
                put(f"{p}.mlp.{n}.weight", *shape)
            continue
        put(f"{p}.mlp.gate.weight", 4, h)
        put(f"{p}.mlp.gate.e_score_correction_bias", 4, dtype=torch.float32)
        for n, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            put(f"{p}.mlp.shared_experts.{n}.weight", *shape)
            for e in range(4):
                out_f, in_f = shape
                q = f"{p}.mlp.experts.{e}.{n}"
                put(f"{q}.weight_packed", out_f, in_f // 8, dtype=torch.int32)
                put(f"{q}.weight_scale", out_f, in_f // 32)
                tensors[f"{q}.weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int32)
    put(f"{lm}.layers.2.eh_proj.weight", h, 2 * h)
    put("vision_tower.encoder.blocks.0.wqkv.weight", 3 * 32, 32)
    put("vision_tower.patch_embed.proj.weight", 32, 3, 14, 14)
    put("mm_projector.proj.0.weight", 128, 128)

    path = tmp_path_factory.mktemp("kimi") / "Kimi-K2.6-mini"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:]), start=1):
        shard = f"model-{k:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / shard))
        weight_map.update({n: shard for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


# --- GGUF -------------------------------------------------------------------------------

GGUF_DIMS = {"vocab": 96, "hidden": 64, "inter": 32, "dense_inter": 96, "layers": 3, "experts": 4,
             "top_k": 2, "heads": 4, "kv_heads": 2, "head_dim": 16}


def write_qwen3moe_gguf(path: Path, *, split_max_tensors: int = 0) -> list[Path]:
    """A tiny qwen3moe GGUF: merged expert tensors in Q8_0 (gate, up) and Q4_0 (down),
    attention in F16, norms and router in F32. Returns the files written."""
    import gguf
    from gguf.quants import quantize

    d = GGUF_DIMS
    h, i, e = d["hidden"], d["inter"], d["experts"]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "qwen3moe", split_max_tensors=split_max_tensors)
    w.add_name("tiny-qwen3moe")
    w.add_block_count(d["layers"])
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(d["dense_inter"])
    w.add_head_count(d["heads"])
    w.add_head_count_kv(d["kv_heads"])
    w.add_key_length(d["head_dim"])
    w.add_value_length(d["head_dim"])
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(e)
    w.add_expert_used_count(d["top_k"])
    w.add_expert_feed_forward_length(i)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{k}" for k in range(d["vocab"])])

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w.add_tensor("token_embd.weight", f32(d["vocab"], h).astype(np.float16))
    w.add_tensor("output_norm.weight", f32(h))
    w.add_tensor("output.weight", f32(d["vocab"], h).astype(np.float16))
    qd, kvd = d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    for b in range(d["layers"]):
        p = f"blk.{b}"
        w.add_tensor(f"{p}.attn_norm.weight", f32(h))
        w.add_tensor(f"{p}.ffn_norm.weight", f32(h))
        w.add_tensor(f"{p}.attn_q.weight", f32(qd, h).astype(np.float16))
        w.add_tensor(f"{p}.attn_k.weight", f32(kvd, h).astype(np.float16))
        w.add_tensor(f"{p}.attn_v.weight", f32(kvd, h).astype(np.float16))
        w.add_tensor(f"{p}.attn_output.weight", f32(h, qd).astype(np.float16))
        w.add_tensor(f"{p}.attn_q_norm.weight", f32(d["head_dim"]))
        w.add_tensor(f"{p}.attn_k_norm.weight", f32(d["head_dim"]))
        w.add_tensor(f"{p}.ffn_gate_inp.weight", f32(e, h))
        q8 = gguf.GGMLQuantizationType.Q8_0
        q4 = gguf.GGMLQuantizationType.Q4_0
        w.add_tensor(f"{p}.ffn_gate_exps.weight", quantize(f32(e, i, h), q8), raw_dtype=q8)
        w.add_tensor(f"{p}.ffn_up_exps.weight", quantize(f32(e, i, h), q8), raw_dtype=q8)
        w.add_tensor(f"{p}.ffn_down_exps.weight", quantize(f32(e, h, i), q4), raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return [path]


def write_deepseek2_gguf(path: Path) -> Path:
    """A tiny deepseek2 (Kimi-K2-like) GGUF: MLA attention, one dense leading block, shared
    expert, sigmoid routing with exp_probs_b, merged experts in Q8_0, one NextN block."""
    import gguf
    from gguf.quants import quantize

    h, inter, e, heads, vocab = 64, 32, 4, 2, 96
    kv_lora, q_lora, rope, nope, v = 32, 48, 8, 24, 32
    rng = np.random.default_rng(1)
    arch = "deepseek2"
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-deepseek2")
    w.add_block_count(4)  # 3 decoder blocks + 1 NextN block
    w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_feed_forward_length(96)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_key_length(nope + rope)
    w.add_value_length(v)
    w.add_rope_dimension_count(rope)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_q_lora_rank(q_lora)
    w.add_kv_lora_rank(kv_lora)
    w.add_leading_dense_block_count(1)
    w.add_expert_count(e)
    w.add_expert_used_count(2)
    w.add_expert_shared_count(1)
    w.add_expert_feed_forward_length(inter)
    w.add_expert_weights_scale(2.827)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_vocab_size(vocab)

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("token_embd.weight", quantize(f32(vocab, h), q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", f32(h))
    w.add_tensor("output.weight", quantize(f32(vocab, h), q8), raw_dtype=q8)
    for b in range(4):
        p = f"blk.{b}"
        w.add_tensor(f"{p}.attn_norm.weight", f32(h))
        w.add_tensor(f"{p}.ffn_norm.weight", f32(h))
        w.add_tensor(f"{p}.attn_q_a.weight", f32(q_lora, h).astype(np.float16))
        w.add_tensor(f"{p}.attn_q_a_norm.weight", f32(q_lora))
        w.add_tensor(f"{p}.attn_q_b.weight", f32(heads * (nope + rope), q_lora).astype(np.float16))
        w.add_tensor(f"{p}.attn_kv_a_mqa.weight", f32(kv_lora + rope, h).astype(np.float16))
        w.add_tensor(f"{p}.attn_kv_a_norm.weight", f32(kv_lora))
        w.add_tensor(f"{p}.attn_kv_b.weight", f32(heads * (nope + v), kv_lora).astype(np.float16))
        w.add_tensor(f"{p}.attn_output.weight", f32(h, heads * v).astype(np.float16))
        if b == 0:
            w.add_tensor(f"{p}.ffn_gate.weight", f32(96, h).astype(np.float16))
            w.add_tensor(f"{p}.ffn_up.weight", f32(96, h).astype(np.float16))
            w.add_tensor(f"{p}.ffn_down.weight", f32(h, 96).astype(np.float16))
            continue
        w.add_tensor(f"{p}.ffn_gate_inp.weight", f32(e, h))
        w.add_tensor(f"{p}.exp_probs_b.bias", f32(e))
        for n, shape in (("gate", (e, inter, h)), ("up", (e, inter, h)), ("down", (e, h, inter))):
            w.add_tensor(f"{p}.ffn_{n}_exps.weight", quantize(f32(*shape), q8), raw_dtype=q8)
            w.add_tensor(f"{p}.ffn_{n}_shexp.weight", f32(*shape[1:]).astype(np.float16))
        if b == 3:
            w.add_tensor(f"{p}.nextn.eh_proj.weight", f32(h, 2 * h).astype(np.float16))
            w.add_tensor(f"{p}.nextn.enorm.weight", f32(h))
            w.add_tensor(f"{p}.nextn.hnorm.weight", f32(h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def gguf_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    write_qwen3moe_gguf(root / "tiny-qwen3moe.gguf")
    split = root / "split"
    split.mkdir()
    write_qwen3moe_gguf(split / "tiny-qwen3moe.gguf", split_max_tensors=20)
    write_deepseek2_gguf(root / "tiny-deepseek2.gguf")
    return root


@pytest.fixture
def scratch(tmp_path) -> Path:
    return tmp_path


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst
