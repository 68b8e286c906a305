"""Tiny random checkpoints of every family, written by transformers' save_pretrained.

Each is built once per session (a second or less) and cached by (family, dtype). Weights are
redrawn with a wider spread than transformers' init (std 0.02 leaves a tiny model's logits
nearly flat, so greedy decoding would be decided by rounding noise), and buffers that start
at zero (DeepSeek's e_score_correction_bias) are randomised so that they matter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# family -> (transformers class, config kwargs). Sizes: hidden 64 (GPT-OSS 96), 3 layers,
# 8 experts, top-2, vocab 256; widths chosen unequal so that a transposed layout cannot pass by
# accident, and multiples of 32 where quantized variants are tested (int4 g32, MXFP4).
FAMILIES: dict[str, tuple[str, dict]] = {
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        max_position_embeddings=4096, tie_word_embeddings=False,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0})),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=1, n_shared_experts=2,
        routed_scaling_factor=1.5, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=12, max_position_embeddings=4096)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=4096)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=4096)),
    "mixtral": ("MixtralForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
        rope_theta=1e6)),
    "olmoe": ("OlmoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, clip_qkv=2.0, max_position_embeddings=4096,
        pad_token_id=1, eos_token_id=0)),
    "gpt_oss": ("GptOssForCausalLM", dict(
        vocab_size=256, hidden_size=96, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0})),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.8,
        attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5, max_position_embeddings=4096)),
}

# Families the parity tests cover, in priority order.
FAMILY_NAMES = list(FAMILIES)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases, sinks
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))


def make_checkpoint(family: str, out: Path, dtype: torch.dtype = torch.float32, seed: int = 0,
                    **overrides) -> Path:
    """Save a tiny random `family` model; `overrides` change its config (e.g. vocab_size)."""
    import transformers

    cls_name, kwargs = FAMILIES[family]
    cls = getattr(transformers, cls_name)
    config = cls.config_class(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    model = cls(config)
    _randomise(model, seed)
    model.to(dtype).save_pretrained(out)
    return out


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """These models are tiny: a thread pool only adds synchronisation (and on a busy machine
    its spinning threads slow the suite several times over)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """checkpoints(family, dtype=torch.float32) -> directory of a tiny saved checkpoint."""
    cache: dict[tuple[str, torch.dtype], Path] = {}

    def get(family: str, dtype: torch.dtype = torch.float32) -> Path:
        key = (family, dtype)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{family}_{str(dtype).split('.')[-1]}")
            cache[key] = make_checkpoint(family, out, dtype)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def references():
    """references(path, dtype) -> the transformers model loaded from that checkpoint (cached),
    with transformers' default attention and experts implementations (sdpa where the model
    supports it, grouped experts), which is what its generate() runs."""
    cache: dict[tuple[Path, torch.dtype], torch.nn.Module] = {}

    def get(path: Path, dtype: torch.dtype = torch.float32):
        import transformers

        key = (path, dtype)
        if key not in cache:
            cache[key] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        return cache[key]

    return get


def engine(path: Path, config: dict | None = None, **kwargs):
    """The engine's model for a checkpoint directory (config.json unless `config` is given)."""
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights

    kwargs.setdefault("max_context", 64)
    return build_model(config or load_config(path), open_weights(path), **kwargs)


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """n greedy tokens after `prompt` [1, T]: one prefill, then one token per call."""
    logits = model(prompt, 0, last_only=True)
    pos, out = prompt.shape[-1], []
    for _ in range(n):
        token = int(logits[0, -1].argmax())
        out.append(token)
        logits = model(torch.tensor([[token]]), pos)
        pos += 1
    return out


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def load_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = ours.float(), ref.float()
    return float((ours - ref).abs().max() / ref.abs().max())


class Dequantized:
    """An expert group whose quantized matrices (int8, int4, stored) come back dequantized to `dtype`:
    the reference the quantized products are held to."""

    stacked = False  # one expert at a time: experts_forward's loop, never the stacks' launches

    def __init__(self, group, dtype: torch.dtype = torch.float32):
        self.__dict__.update(group.__dict__)
        self.group, self.dtype = group, dtype

    def __len__(self):
        return len(self.group)

    def weights_of(self, e):
        from hybridmoe.backend.engine.experts import ExpertMatrices

        w = self.group.weights_of(e)

        def widened(m):
            return None if m is None else m.dequantize(self.dtype)

        # (Held as stored, gate and up are apart: stored_experts.)
        return ExpertMatrices(down=widened(w.down), gate_up=widened(w.gate_up), gate=widened(w.gate),
                              up=widened(w.up), gate_up_bias=w.gate_up_bias, gate_bias=w.gate_bias,
                              up_bias=w.up_bias, down_bias=w.down_bias)


def run_kernel_check(check: str, cases: list[dict], tmp_path: Path, timeout: int) -> list[dict]:
    """A Triton kernel test's script `check` run on `cases` in a process of its own (Triton picks
    its interpreter when imported): it gets the cases' JSON and the device, compiled kernels on
    a CUDA card where there is one, else the interpreter (TRITON_INTERPRET=1, set here) on CPU
    tensors; returns the rows it printed last (also printed here: the measured errors, for
    pytest -rP)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "check.py"
    script.write_text(check)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(root), os.environ.get("PYTHONPATH", "")))}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # read when Triton is imported: set before the script starts
    r = subprocess.run([sys.executable, str(script), json.dumps(cases), device], capture_output=True, text=True,
                       timeout=timeout, cwd=root, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.splitlines()[-1])
    print(device, *rows, sep="\n")
    return rows
