"""Greedy choices of the engine against llama.cpp's on a small Qwen3-MoE trained here, in each
of llama.cpp's low-bit types: issue 45's accuracy check on a model whose choices are not ties.

    python benchmarks/trained_tiny.py OUT_DIR [--train-steps 400] [--types iq1_s,iq2_xxs,...]

The mid-size benchmark model's weights are random. Its logits' best two sit a few hundredths of
their spread apart, where rounding alone (8-bit activations, float summation order, in either
backend, or llama.cpp against itself with another batch size) decides the greedy token, so its
differences say nothing of accuracy. A model trained on text has a real model's margins. This:

1. trains a 4-layer Qwen3-MoE (hidden 256, 8 experts of 256, top 2, 4 query and 2 key/value heads
   of 64, a byte-level BPE of 4096 tokens) on the Python standard library's sources: about ten
   minutes on two cores, kept in OUT_DIR/checkpoint and reused;
2. converts it to a BF16 GGUF with the project's converter;
3. quantizes that with llama.cpp's own quantizer into each type's mix, the routed experts forced
   to the type (the IQ2_M mix for IQ2_S experts), with a uniform importance matrix (llama.cpp
   requires one for IQ1_S, IQ1_M, IQ2_XXS and IQ2_XS); ud-q2_k_xl is Q4_K_M with IQ2_XXS gate and
   up experts, IQ3_XXS down experts and a Q8_0 head, as the DeepSeek UD-Q2_K_XL files, ud-iq1_s
   the same with IQ1_S gate and up, IQ2_XXS down and a Q6_K head (UD-IQ1_S);
4. per file and per prompt (three snippets of Python), llama.cpp's greedy tokens and the engine
   fed the same ones, both through their serving paths (`bench generate`'s teacher-forced
   comparison), every step compared, with llama.cpp's margin wherever they differ.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(vocab_size=4096, hidden_size=256, moe_intermediate_size=256, intermediate_size=1024,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8,
             num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
CONTEXT = 256  # tokens per training sequence

# type -> (llama.cpp's mix, the routed experts' type; None: the mix's own choice per tensor)
MIXES = {
    "iq1_s": ("IQ1_S", "IQ1_S"), "iq1_m": ("IQ1_M", "IQ1_M"), "iq2_xxs": ("IQ2_XXS", "IQ2_XXS"),
    "iq2_xs": ("IQ2_XS", "IQ2_XS"), "iq2_s": ("IQ2_M", "IQ2_S"), "iq3_xxs": ("IQ3_XXS", "IQ3_XXS"),
    "iq3_s": ("IQ3_S", "IQ3_S"), "iq4_xs": ("IQ4_XS", "IQ4_XS"), "iq4_nl": ("IQ4_NL", "IQ4_NL"),
    "q4_1": ("Q4_1", "Q4_1"), "q5_1": ("Q5_1", "Q5_1"), "ud-q2_k_xl": ("Q4_K_M", None), "ud-iq1_s": ("Q4_K_M", None),
}


def ud_overrides(mix: str) -> dict[str, str]:
    """The Unsloth-shaped `mix` of `bench generate --types` (backend/bench/retype.py's MIXES,
    without their edge layers) as llama.cpp's tensor-type overrides: patterns -> types."""
    from hybridmoe.backend.bench import retype

    gate_up, _edge, down, head = retype.MIXES[mix]
    return {r"ffn_(gate|up)_exps": gate_up.upper(), r"ffn_down_exps": down.upper(), r"^output\.weight": head.upper()}


PROMPTS = (
    'import os\nimport sys\n\n\ndef main(argv=None):\n    """Parse the arguments and run."""\n'
    '    if argv is None:\n        argv = sys.argv[1:]\n',
    "class Counter:\n    def __init__(self, start=0):\n        self.value = start\n\n"
    "    def increment(self, step=1):\n",
    'def read_lines(path):\n    with open(path, encoding="utf-8") as f:\n        for line in f:\n'
    '            yield line.rstrip("\\n")\n\n\ndef ',
)


def corpus(max_chars: int = 12_000_000) -> list[str]:
    """The standard library's Python sources in name order, up to `max_chars`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return texts


def train(ckpt: Path, steps: int, seed: int = 0) -> None:
    """The tokenizer and the trained model (bf16 safetensors) into `ckpt`."""
    import torch
    from tokenizers import Tokenizer
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from benchmarks.make_midsize_qwen3 import write_tokenizer

    started = time.perf_counter()
    ckpt.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    write_tokenizer(ckpt, texts, vocab=SHAPE["vocab_size"])
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    end = tok.token_to_id("<|endoftext|>")
    ids = np.concatenate([np.array(e.ids + [end], dtype=np.int64) for e in tok.encode_batch(texts)])
    print(f"corpus: {len(texts)} files, {len(ids) / 1e6:.1f} M tokens ({time.perf_counter() - started:.0f} s)", flush=True)

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, eos_token_id=tok.token_to_id("<|im_end|>"),
                                               pad_token_id=end))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * min(1.0, s / steps)))))
    rng = np.random.default_rng(seed)
    for step in range(steps):
        starts = rng.integers(0, len(ids) - CONTEXT, size=16)
        batch = torch.from_numpy(np.stack([ids[s : s + CONTEXT] for s in starts]))
        loss = model(input_ids=batch, labels=batch).loss  # the model shifts the labels
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.to(torch.bfloat16).save_pretrained(ckpt, safe_serialization=True)


def quantize(src: Path, dst: Path, mix: str, overrides: dict[str, str]) -> None:
    """`src` into llama.cpp's `mix`, tensors matching an `overrides` pattern in its type, with a
    uniform importance matrix (one entry per input column and expert of every matrix)."""
    import llama_cpp
    from gguf import GGUFReader

    from hybridmoe.backend.convert.kquants import tensor_type_overrides
    from hybridmoe.backend.llamacpp import log

    matrices = [(t.name, [int(n) for n in t.shape]) for t in GGUFReader(src).tensors if len(t.shape) >= 2]
    entries = (llama_cpp.llama_model_imatrix_data * (len(matrices) + 1))()
    columns = []  # the arrays the entries point to, alive until the call returns
    for i, (name, shape) in enumerate(matrices):
        n = shape[0] * (shape[2] if len(shape) == 3 else 1)
        columns.append((ctypes.c_float * n)(*([1.0] * n)))
        entries[i].name, entries[i].size = name.encode(), n
        entries[i].data = ctypes.cast(columns[-1], ctypes.POINTER(ctypes.c_float))
    entries[len(matrices)].name = None
    forced = tensor_type_overrides(llama_cpp, [(getattr(llama_cpp, f"GGML_TYPE_{qtype}"), pattern)
                                               for pattern, qtype in overrides.items()])
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
    params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    params.tt_overrides = ctypes.cast(forced, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    log.install(llama_cpp)  # its tensor-by-tensor report kept off the terminal
    with log.capture() as said:
        failed = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0
    if failed:
        raise SystemExit(f"llama.cpp could not quantize {src} into {mix}: {said.failure()}")


def compare_file(path: Path) -> list[dict]:
    """Per prompt, `bench generate`'s teacher-forced comparison on `path`."""
    from hybridmoe.backend.bench.generate import GREEDY_STEPS, _forced, _load_engine, _prefill
    from hybridmoe.backend.llamacpp.model import RawModel

    context = 512
    net, plan = _load_engine(str(path), context, 2)
    llm = RawModel(str(path), n_ctx=context, n_batch=512, n_threads=2)
    results = []
    try:
        for text in PROMPTS:
            ids = llm.tokenize(text.encode())
            assert len(ids) + GREEDY_STEPS < context
            llm.reset()
            firsts = (_prefill(net, ids, plan.workload.prefill_chunk).float().numpy().copy(),
                      np.array(llm.eval(ids)[-1], dtype=np.float32))
            results.append(_forced(net, llm, len(ids), firsts))
    finally:
        llm.close()
    return results


def main() -> int:
    from hybridmoe.backend.bench.greedy import in_words
    from hybridmoe.backend.convert import to_gguf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--train-steps", type=int, default=400)
    ap.add_argument("--types", default=",".join(MIXES))
    args = ap.parse_args()
    ckpt = args.out_dir / "checkpoint"
    if not (ckpt / "model.safetensors").exists():
        train(ckpt, args.train_steps)
    bf16 = args.out_dir / "tiny-bf16.gguf"
    if not bf16.exists():
        to_gguf(ckpt, bf16, "bf16", overwrite=True)
    rows = []
    for name in args.types.split(","):
        mix, experts = MIXES[name]
        path = args.out_dir / f"tiny-{name}.gguf"
        if not path.exists():
            quantize(bf16, path, mix, ud_overrides(name) if experts is None else {r"_exps\.": experts})
        results = compare_file(path)
        same = sum(r["same"] for r in results)
        steps = sum(r["steps"] for r in results)
        rows.append(f"| {name} | {path.stat().st_size / 1e6:.1f} | {same}/{steps} | "
                    + " · ".join(in_words(r) for r in results)
                    + f" | {max(r['distance'] for r in results):.4f} |")
        print(rows[-1], flush=True)
    print("\n| type | MB | greedy, teacher-forced | per prompt (llama.cpp's margins where they differ) | "
          "logits apart (of the spread, the most of the prompts) |\n|---|---:|---:|---|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
