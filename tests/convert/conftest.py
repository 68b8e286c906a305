"""Tiny checkpoints for the converter: random models written by transformers' save_pretrained,
each with a tokenizer trained here in a fraction of a second, and helpers that run the
reference (transformers) and the converted file (llama.cpp through llama-cpp-python).

Sizes are chosen so that every matrix row is a whole number of 32-weight blocks (Q8_0/Q4_0
apply everywhere) and weights are drawn wider than transformers' init, so that the logits
are peaked enough for greedy decoding not to hinge on rounding noise.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

CORPUS = [
    "Hello world! This is a tiny corpus for a tiny tokenizer. It's 2024; numbers 12345 and 3.14159.",
    "def add(a, b):\n    return a + b\n\nclass Foo:\n    pass\n",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX'S DOG'LL RUN. I've, we're.",
    "Mixture-of-Experts models route each token to a few experts; the rest stay idle.",
    "你好，世界！日本語のテキスト。 Café naïve résumé — emoji 😀🎉",
]

SAMPLES = [
    "Hello world!",
    "  leading spaces and trailing   ",
    "It's THE fox's DOG'LL run; we've 1234567 tokens, 3.14159.",
    "你好，世界！日本語 Café 😀🎉",
    "def f(x):\n\treturn x  # tab\n\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
]

# Qwen2's split expression (tokenizer.json of Qwen2/Qwen3), which llama.cpp knows as "qwen2".
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Short stand-ins for GLM-4.5's and GPT-OSS's (harmony) templates, with their control tokens:
# what is checked is that the checkpoint's template reaches the GGUF unchanged.
GLM_TEMPLATE = (
    "[gMASK]<sop>{%- for message in messages %}<|{{ message.role }}|>\n{{ message.content }}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{%- endif %}"
)
HARMONY_TEMPLATE = (
    "{%- for message in messages %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message.role == 'user' %}"
    "{{ '[INST] ' + message.content + ' [/INST]' }}{% else %}{{ message.content + eos_token }}{% endif %}{% endfor %}"
)

FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=512, rope_theta=1e6)),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=512, use_sliding_window=False)),
    "olmoe": ("OlmoeForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)),
    "mixtral": ("MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
        rope_theta=1e6, sliding_window=None)),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
        max_position_embeddings=512, rope_theta=1e6, tie_word_embeddings=False)),
    "gpt_oss": ("GptOssForCausalLM", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4, max_position_embeddings=4096,
        tie_word_embeddings=False,
        # The published configs say "truncate": false, which ggml's YaRN cannot do (see
        # hybridmoe.backend.models.families.gpt_oss.gguf); this one asks for what ggml computes, so that the
        # comparison checks the file's contents rather than that known difference.
        rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "rope_theta": 150000.0})),
}

# Each family's tokenizer: its split expression (the one its published tokenizer.json holds,
# as the engine's pre-tokenizer table spells it), special tokens, and tokenizer_config entries.
GLM_SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>"]
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                    "<|start|>", "<|end|>", "<|message|>", "<|call|>"]


def train_byte_level_bpe(vocab_size: int = 400, split: str = QWEN2_SPLIT,
                         specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(specials), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    return tok


def train_sentencepiece_bpe(vocab_size: int = 360) -> Tokenizer:
    """Mixtral-style: <unk> <s> </s>, 256 byte-fallback tokens, then pieces with '▁'."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, limit_alphabet=60,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok


@dataclass(frozen=True)
class Checkpoint:
    family: str
    path: Path
    model: torch.nn.Module  # float32 copy of the saved (bf16-rounded) weights
    vocab_size: int


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 3:
                # Routed experts [E, out, in]: a common part plus a per-expert quarter. When
                # two experts tie for the k-th place, rounding decides which one runs; with
                # experts this alike, such a flip moves the output a little instead of
                # sending the continuation elsewhere. (A swapped expert still shows: the
                # per-expert part is large, and test_engine_reads... compares every expert.)
                # GPT-OSS keeps its fused experts [E, in, out] (the other families [E, out, in]).
                fan_in = p.shape[1] if model.config.model_type == "gpt_oss" else p.shape[-1]
                scale = fan_in ** -0.5
                common = torch.randn(p.shape[1:], generator=g)
                p.copy_(scale * (common + 0.25 * torch.randn(p.shape, generator=g)))
            elif name.endswith(("lm_head.weight", "embed_tokens.weight")):
                # Peaked output distributions: a clear argmax at each step.
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                # Unit gain per matrix (std 1/sqrt(fan_in)), as in a trained model: a wider
                # spread makes the tiny model chaotic, magnifying rounding differences.
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))


def write_tokenizer(directory: Path, tok: Tokenizer, config: dict) -> None:
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}, ensure_ascii=False), encoding="utf-8")


def build_checkpoint(directory: Path, family: str, *, seed: int = 0, dtype=torch.bfloat16,
                     overrides: dict | None = None) -> Checkpoint:
    import transformers

    from hybridmoe.backend.text.tokenizer import _GPT4O, _LLAMA3

    sentencepiece = family == "mixtral"
    if sentencepiece:
        tok = train_sentencepiece_bpe()
    elif family == "glm4_moe":
        tok = train_byte_level_bpe(split=_LLAMA3, specials=tuple(GLM_SPECIALS))
    elif family == "gpt_oss":
        tok = train_byte_level_bpe(split=_GPT4O, specials=tuple(HARMONY_SPECIALS))
    else:
        tok = train_byte_level_bpe()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    arch, kwargs = FAMILIES[family]
    cls = getattr(transformers, arch)
    eos = {"glm4_moe": "<|endoftext|>", "gpt_oss": "<|return|>"}.get(family, "<|im_end|>")
    ids = (dict(bos_token_id=1, eos_token_id=2) if sentencepiece
           else dict(bos_token_id=None, eos_token_id=tok.token_to_id(eos)))
    config = cls.config_class(vocab_size=vocab, **ids, **{**kwargs, **(overrides or {})})
    torch.manual_seed(seed)
    model = cls(config)
    _randomise(model, seed)
    model = model.to(dtype)
    model.save_pretrained(directory)
    model = model.to(torch.float32).eval()
    if sentencepiece:
        write_tokenizer(directory, tok, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                         "add_bos_token": True, "add_eos_token": False,
                                         "chat_template": MISTRAL_TEMPLATE})
    elif family == "glm4_moe":
        # As GLM-4.5 ships it: no BOS token configured, the template writes [gMASK]<sop>.
        write_tokenizer(directory, tok, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
        (directory / "chat_template.jinja").write_text(GLM_TEMPLATE, encoding="utf-8")
    elif family == "gpt_oss":
        write_tokenizer(directory, tok, {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                                         "pad_token": "<|endoftext|>", "add_bos_token": False})
        (directory / "chat_template.jinja").write_text(HARMONY_TEMPLATE, encoding="utf-8")
    else:
        write_tokenizer(directory, tok, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                                         "add_bos_token": False})
        (directory / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    return Checkpoint(family, directory, model, vocab)


# Random seeds of the sparse models: ones whose greedy continuation of the test prompt has
# no near-tie in any top-k expert choice (where llama.cpp's bf16 activations, rounded
# differently from transformers' float32, would pick the other expert and continue elsewhere).
SEEDS = {"olmoe": 1}

# Every expert selected for every token: no top-k choice that rounding could flip (see
# test_parity); the sparse models cover the choice itself at bf16.
ALL_EXPERTS = {
    "qwen3_moe": dict(num_experts_per_tok=8),
    "deepseek_v3": dict(num_experts_per_tok=8, n_group=1, topk_group=1),
    "mixtral": dict(num_experts_per_tok=8),
    "glm4_moe": dict(num_experts_per_tok=8),
    "gpt_oss": dict(num_experts_per_tok=8),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """(family, all_experts=False) -> Checkpoint, built on first use and kept for the session."""
    cache: dict[tuple[str, bool], Checkpoint] = {}

    def get(family: str, all_experts: bool = False) -> Checkpoint:
        key = (family, all_experts)
        if key not in cache:
            overrides = ALL_EXPERTS[family] if all_experts else None
            cache[key] = build_checkpoint(tmp_path_factory.mktemp(family), family, overrides=overrides,
                                          seed=SEEDS.get(family, 0))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory, checkpoints):
    """(family, quant, all_experts=False) -> GGUF path, converted once per session. A quant made
    by llama.cpp's quantizer (q4_k_m) skips the test where llama-cpp-python is not installed."""
    from hybridmoe.backend.convert import kquants, to_gguf

    cache: dict[tuple[str, str, bool], Path] = {}

    def get(family: str, quant: str, all_experts: bool = False) -> Path:
        key = (family, quant, all_experts)
        if quant in kquants.FTYPES and not kquants.available():
            pytest.skip(f"--quant {quant} needs llama.cpp's quantizer; llama-cpp-python is not installed")
        if key not in cache:
            out = tmp_path_factory.mktemp(f"gguf_{family}") / f"{family}-{quant}.gguf"
            cache[key] = to_gguf(checkpoints(family, all_experts).path, out, quant)
        return cache[key]

    return get


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed")


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model: torch.nn.Module, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(nxt)
            ids.append(nxt)
    return out


def open_llama(path: Path):
    """The GGUF opened in llama.cpp for logits, through the project's one way of loading it."""
    from hybridmoe.backend.llamacpp.model import RawModel

    return RawModel(path, n_ctx=64, n_threads=2, logits_all=True)


def llama_logits(llm, ids: list[int]) -> torch.Tensor:
    llm.reset()
    return torch.from_numpy(llm.eval(ids))


def llama_greedy(llm, ids: list[int], steps: int) -> list[int]:
    llm.reset()
    logits = llm.eval(ids)
    out = []
    for _ in range(steps):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        logits = llm.eval([nxt])
    return out
