"""Greedy choices of the engine against llama.cpp's on one GGUF, teacher-forced: llama.cpp
generates `--steps` greedy tokens after a random prompt; the engine, fed the same tokens,
says at each step whether its best token is llama.cpp's, and where not, both margins (the
gap between the two tokens in llama.cpp's logits and in the engine's): a difference at a
margin under about 5e-3 is a near tie that rounding decides.

    python benchmarks/greedy_vs_llama_cpp.py FILE.gguf [--dtype bf16,fp32] [--steps 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import torch

    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.llamacpp.model import RawModel
    from hybridmoe.backend.models import inspect_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--dtype", default="bf16", help="engine compute dtypes to try, comma-separated (bf16, fp32)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=64)
    args = p.parse_args()

    spec = inspect_model(args.model).spec
    prompt = [int(x) for x in np.random.default_rng(0).integers(100, 16000, size=args.prompt_tokens)]
    llm = RawModel(args.model, n_ctx=args.prompt_tokens + args.steps + 8, n_batch=512, n_threads=2)
    try:
        llm.reset()
        logits = llm.eval(prompt)
        theirs, their_logits = [], []
        for _ in range(args.steps):
            row = np.array(logits[-1])
            theirs.append(int(np.argmax(row)))
            their_logits.append(row)
            logits = llm.eval([theirs[-1]])
    finally:
        llm.close()

    for name in args.dtype.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
        model = build_model(spec.config, open_weights(args.model), max_context=args.prompt_tokens + args.steps + 8,
                            dtype=dtype, device="cpu")
        same = 0
        with torch.inference_mode():
            out = model(torch.tensor(prompt), 0)[-1]
            for i, token in enumerate(theirs):
                ours = out.float()
                best = int(ours.argmax())
                if best == token:
                    same += 1
                else:
                    ref = their_logits[i]
                    print(f"{name}: step {i}: engine {best}, llama.cpp {token}; llama.cpp's margin "
                          f"{float(ref[token] - ref[best]):.4f}, the engine's {float(ours[best] - ours[token]):.4f}")
                out = model(torch.tensor([token]), len(prompt) + i)[-1]
        print(f"{name}: the engine's greedy choice is llama.cpp's at {same} of {args.steps} steps")


if __name__ == "__main__":
    main()
