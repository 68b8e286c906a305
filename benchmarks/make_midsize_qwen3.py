"""The mid-size Qwen3-MoE-shaped benchmark model of issue 17, as a checkpoint and a GGUF.

    python benchmarks/make_midsize_qwen3.py OUT_DIR [--quant q4_0] [--family glm4_moe|deepseek_v3]

Writes OUT_DIR (a random bf16 checkpoint: 8 layers, hidden 2048, 128 experts of 768, top 8,
32 query heads and 4 key/value heads of 128, a vocabulary of 16384; about 10 GB) with a
byte-level BPE tokenizer of exactly that vocabulary and a ChatML chat template, then converts
it with the project's converter to OUT_DIR-QUANT.gguf (q4_0: every matrix Q4_0 but the LM
head, Q8_0, as llama-quantize's Q4_0; about 2.8 GB). The weights are random, so its answers
are noise; it has the shape, the bytes per token and the file format of a real model, which is
what a speed benchmark needs.

The tokenizer is trained here on generated pseudo-words (a few seconds), so that all 16384 ids
are real tokens: every token the model generates decodes to text, and prompts can be built
from words that are one token each (``hybridmoe bench serve`` does).

``--family glm4_moe`` writes the same sizes in GLM-4.5's layer shape instead: q|k|v bias, half
of each head rotated, a dense first layer (intermediate 3072), sigmoid routing with a correction
bias, and a shared expert of the routed experts' size in the other seven layers.
``--family deepseek_v3``: DeepSeek-V3's instead, with 16 heads of latent attention (q LoRA 1536,
latent 512, rotary 64, nope and value heads 128), a dense first layer (intermediate 3072), and
sigmoid routing over eight groups of which four are kept.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(layers=8, hidden=2048, inter=768, experts=128, k=8, heads=32, kv_heads=4, head_dim=128)
VOCAB = 16384
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _corpus(seed: int = 0, lines: int = 20000) -> list[str]:
    """Sentences of pseudo-words with a Zipf-like frequency, so that BPE finds 16K merges."""
    rng = random.Random(seed)
    onsets = "b c d f g h j k l m n p r s t v w z br ch dr fl gr kl pl sh st th tr".split()
    vowels = "a e i o u ai ea ie oo ou".split()
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]
    lexicon = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                       for _ in range(rng.choice((1, 1, 2, 2, 3)))) for _ in range(40000)]
    cumulative = list(itertools.accumulate(1 / (i + 1) for i in range(len(lexicon))))
    return [" ".join(rng.choices(lexicon, cum_weights=cumulative, k=30)) + rng.choice(".,!?;")
            + f" {rng.randrange(100000)}" for _ in range(lines)]


def write_tokenizer(directory: Path, corpus: list[str] | None = None, vocab: int = VOCAB) -> int:
    """A byte-level BPE (Qwen2's split expression, as the converter tests' tokenizers) of
    exactly `vocab` tokens trained on `corpus` (default: the pseudo-words), with ChatML; returns
    its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.convert.conftest import CHATML, QWEN2_SPLIT, write_tokenizer as write_hf_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(SPECIALS), show_progress=False)
    tok.train_from_iterator(_corpus() if corpus is None else corpus, trainer)
    write_hf_tokenizer(directory, tok, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                                        "add_bos_token": False})
    (directory / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    return tok.get_vocab_size(with_added_tokens=True)


def make(out_dir: Path, quant: str = "q4_0", family: str = "qwen3_moe") -> Path:
    """Checkpoint in ``out_dir``, GGUF beside it; returns the GGUF's path."""
    import torch

    from hybridmoe.backend.convert import to_gguf
    from scripts.gpu_check import write_deepseek_v3, write_glm4_moe, write_qwen3_moe

    started = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    size = write_tokenizer(out_dir)
    if size > VOCAB:  # the converter pads a smaller vocabulary to the embedding's rows, never the reverse
        raise SystemExit(f"the trained tokenizer has {size} tokens, more than the model's {VOCAB}")
    print(f"tokenizer: {size} tokens ({time.perf_counter() - started:.0f} s)", flush=True)
    write = {"glm4_moe": write_glm4_moe, "deepseek_v3": write_deepseek_v3}.get(family, write_qwen3_moe)
    shape = dict(SHAPE, heads=16) if family == "deepseek_v3" else SHAPE
    write(out_dir, vocab=VOCAB, dtype=torch.bfloat16, **shape)
    print(f"checkpoint: {out_dir} ({time.perf_counter() - started:.0f} s)", flush=True)
    gguf = out_dir.with_name(f"{out_dir.name}-{quant}.gguf")
    to_gguf(out_dir, gguf, quant, overwrite=True)
    print(f"gguf: {gguf}, {gguf.stat().st_size / 1e9:.2f} GB ({time.perf_counter() - started:.0f} s)", flush=True)
    return gguf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--quant", default="q4_0", choices=("bf16", "q8_0", "q4_0", "q4_k_m"))
    ap.add_argument("--family", default="qwen3_moe", choices=("qwen3_moe", "glm4_moe", "deepseek_v3"))
    args = ap.parse_args()
    make(args.out_dir, args.quant, args.family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
