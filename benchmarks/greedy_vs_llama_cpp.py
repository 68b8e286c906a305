"""Greedy choices of the engine against llama.cpp's on one GGUF, teacher-forced: llama.cpp
generates `--steps` greedy tokens after a random prompt; the engine, fed the same tokens,
says at each step whether its best token is llama.cpp's, and where not, both margins (the
gap between the two tokens in llama.cpp's logits and in the engine's): a difference at a
margin under about 5e-3 is a near tie that rounding decides.

    python benchmarks/greedy_vs_llama_cpp.py FILE.gguf [--dtype auto,bf16,fp32] [--steps 32] [--text PROMPT]
        [--reference | --llama-self]

`--reference` asks who is right where they differ: the exact product of the file's weights
(the engine's PyTorch path with the native kernels off, in float32: every weight
dequantized, no activation rounded) generates the tokens instead, and llama.cpp and the
engine are each held to it: how many of its greedy tokens each chooses, and the mean
distance of each one's logits from it (RMS over the vocabulary, in units of the logits'
spread). A random model whose routing sits on near ties (many experts, grouped top-k)
amplifies any rounding: there neither backend keeps the reference's tokens for long, and the
distance says which stays closer.

`--llama-self` measures that floor on llama.cpp alone: its prompt evaluated in batches of 8
against 512 (for the i-quants and K-quant mixes other matmul paths), teacher-forced the same
way. The plain comparison also prints how far the engine's logits are from llama.cpp's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridmoe.backend.bench.greedy import compare, distance  # noqa: E402


def prompt_ids(model: str, n: int, text: str | None) -> list[int]:
    """`text` in the model's tokens, or else `n` random ids of its vocabulary."""
    from hybridmoe.backend.llamacpp.model import RawModel

    llm = RawModel(model, n_ctx=64, n_threads=1)
    try:
        if text is not None:
            return llm.tokenize(text.encode())
        top = min(16000, llm.n_vocab())  # 16000: the figures of earlier runs on the 16384-token models
        return [int(x) for x in np.random.default_rng(0).integers(min(100, top // 2), top, size=n)]
    finally:
        llm.close()


def engine_rows(model: str, prompt: list[int], forced: list[int] | None, steps: int,
                dtype: str, exact: bool = False) -> tuple[list[int], list[np.ndarray]]:
    """The engine's logits before each token (the prompt's last row, then one per token); its own
    greedy tokens unless `forced`; `exact`: with a float32 cache."""
    import torch

    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model

    m = build_model(inspect_model(model).spec.config, open_weights(model), max_context=len(prompt) + steps + 8,
                    dtype={"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype], device="cpu",
                    cache_dtype=torch.float32 if exact else None)
    tokens, rows = [], []
    with torch.inference_mode():
        row = m(torch.tensor(prompt), 0)[-1].float()
        for i in range(steps):
            rows.append(row.numpy())
            tokens.append(forced[i] if forced else int(row.argmax()))
            if i + 1 < steps:
                row = m(torch.tensor([tokens[-1]]), len(prompt) + i)[-1].float()
    return tokens, rows


def llama_rows(model: str, prompt: list[int], forced: list[int] | None, steps: int,
               batch: int = 512) -> tuple[list[int], list[np.ndarray]]:
    """llama.cpp's logits before each token; its own greedy tokens unless `forced`. `batch`: the
    prompt's tokens per evaluation (llama.cpp's n_batch and n_ubatch)."""
    from hybridmoe.backend.llamacpp.model import RawModel

    llm = RawModel(model, n_ctx=len(prompt) + steps + 8, n_batch=batch, n_ubatch=batch, n_threads=2)
    try:
        llm.reset()
        logits = llm.eval(prompt)
        tokens, rows = [], []
        for i in range(steps):
            row = np.array(logits[-1])
            rows.append(row)
            tokens.append(forced[i] if forced else int(np.argmax(row)))
            logits = llm.eval([tokens[-1]])
    finally:
        llm.close()
    return tokens, rows


def reference(model: str, prompt_args: list[str], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """The exact product's greedy tokens and logits, from a process with the kernels off."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reference.npz"
        subprocess.run([sys.executable, __file__, model, "--write-reference", str(out), "--steps", str(steps),
                        *prompt_args], check=True,
                       env={**os.environ, "HYBRIDMOE_NATIVE": "0"})
        z = np.load(out)
        return z["tokens"].tolist(), list(z["logits"])


def write_reference(model: str, prompt: list[int], steps: int, out: str) -> None:
    tokens, rows = engine_rows(model, prompt, None, steps, "fp32", exact=True)  # run with HYBRIDMOE_NATIVE=0
    np.savez(out, tokens=np.array(tokens), logits=np.stack(rows))


def held_to(name: str, rows: list[np.ndarray], tokens: list[int], ref: list[np.ndarray]) -> None:
    """How `rows` (logits before each of `tokens`) keep the reference's choices."""
    result = compare(tokens, ref, rows)
    notes = [f"step {d['step']}: the reference's margin {d['llamacpp_margin']:.4f}" for d in result["differences"][:4]]
    print(f"{name}: the reference's token at {result['same']} of {len(tokens)} steps; logits {result['distance']:.4f} "
          f"of the spread from the reference's" + (f" ({'; '.join(notes)})" if notes else ""), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="auto",
                   help="engine compute dtypes to try, comma-separated: auto (the engine's own: float32 activations "
                        "and a float16 cache on the CPU), bf16, fp32 (with a float16 cache)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64, help="a prompt of this many random tokens")
    p.add_argument("--text", help="this prompt instead (a trained model's: benchmarks/trained_tiny.py)")
    p.add_argument("--reference", action="store_true", help="hold both to the exact product of the weights")
    p.add_argument("--llama-self", action="store_true", help="llama.cpp against itself, its prompt in batches of 8")
    p.add_argument("--write-reference", help=argparse.SUPPRESS)
    args = p.parse_args()
    prompt = prompt_ids(args.model, args.prompt_tokens, args.text)
    prompt_args = ["--prompt-tokens", str(args.prompt_tokens)] + (["--text", args.text] if args.text is not None else [])
    if args.write_reference:
        return write_reference(args.model, prompt, args.steps, args.write_reference)

    if args.llama_self:
        # llama.cpp against itself: the prompt in batches of 8 instead of 512 takes other
        # matmul paths for some types; where that moves its logits, its choices differ at
        # margins that are rounding's, the floor under any other backend's agreement with it.
        tokens, rows = llama_rows(args.model, prompt, None, args.steps)
        other = llama_rows(args.model, prompt, tokens, args.steps, batch=8)[1]
        same = sum(int(np.argmax(o)) == t for o, t in zip(other, tokens))
        for i, (r, o, t) in enumerate(zip(rows, other, tokens)):
            if int(np.argmax(o)) != t:
                print(f"step {i}: batches of 8 choose {int(np.argmax(o))}, of 512 {t}; margin {float(r[t] - r[int(np.argmax(o))]):.4f}")
        apart = distance(other, rows)
        print(f"llama.cpp, prompt in batches of 8 against 512: the same choice at {same} of {args.steps} steps; logits "
              f"{apart:.4f} of the spread apart (their spread {np.mean([r.std() for r in rows]):.3f})")
        return

    if args.reference:
        tokens, ref = reference(args.model, prompt_args, args.steps)
        held_to("llama.cpp", llama_rows(args.model, prompt, tokens, args.steps)[1], tokens, ref)
        for name in args.dtype.split(","):
            held_to(f"engine {name}", engine_rows(args.model, prompt, tokens, args.steps, name)[1], tokens, ref)
        return

    theirs, their_logits = llama_rows(args.model, prompt, None, args.steps)
    for name in args.dtype.split(","):
        result = compare(theirs, their_logits, engine_rows(args.model, prompt, theirs, args.steps, name)[1])
        for d in result["differences"]:
            print(f"{name}: step {d['step']}: engine {d['engine']}, llama.cpp {d['llamacpp']}; llama.cpp's margin "
                  f"{d['llamacpp_margin']:.4f}, the engine's {d['engine_margin']:.4f}")
        print(f"{name}: the engine's greedy choice is llama.cpp's at {result['same']} of {args.steps} steps; logits "
              f"{result['distance']:.4f} of the spread from llama.cpp's")


if __name__ == "__main__":
    main()
