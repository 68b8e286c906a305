"""Decode speed with the CPU kernels reading some stored formats, against those formats left to
the PyTorch reference (dequantized per call), on one GGUF, in one process.

What a format gains from the kernels reading it: the mid-size Qwen3 model in llama.cpp's Q2_K
mix decoded at 1.7 tokens/s with q2_k and q3_k on the reference and 123.8 with the kernels
(2-core Zen 4). Each round builds the model both ways, in turns, and times `--gen-tokens` greedy
decode steps after a 32-token prompt; the medians over the rounds are printed.

    python benchmarks/native_formats_ab.py MODEL.gguf [--formats q2_k q3_k] [--rounds 2] [--gen-tokens 12]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model


def decode_rate(path: str, gen_tokens: int) -> float:
    spec = inspect_model(path).spec
    model = build_model(spec, open_weights(path), device="cpu", max_context=64 + gen_tokens)
    ids = torch.randint(0, spec.config["vocab_size"], (1, 34 + gen_tokens), generator=torch.Generator().manual_seed(0))
    model(ids[:, :32], 0, last_only=True)
    for pos in (32, 33):  # warm-up steps
        model(ids[:, pos : pos + 1], pos)
    started = time.perf_counter()
    for pos in range(34, 34 + gen_tokens):
        model(ids[:, pos : pos + 1], pos)
    return gen_tokens / (time.perf_counter() - started)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--formats", nargs="+", default=["q2_k", "q3_k"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gen-tokens", type=int, default=12)
    args = p.parse_args()
    native = native_kernels._GGUF_NATIVE
    rates: dict[str, list[float]] = {"kernels": [], "reference": []}
    for _ in range(args.rounds):
        for way in ("kernels", "reference"):
            native_kernels._GGUF_NATIVE = native if way == "kernels" else native - set(args.formats)
            rates[way].append(decode_rate(args.model, args.gen_tokens))
    native_kernels._GGUF_NATIVE = native
    kernels, reference = (statistics.median(rates[w]) for w in ("kernels", "reference"))
    print(f"{', '.join(args.formats)} read by the kernels: {kernels:.1f} tok/s; left to the PyTorch reference: "
          f"{reference:.1f} tok/s ({kernels / reference:.1f}x; {native_kernels.isa()}, medians of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
