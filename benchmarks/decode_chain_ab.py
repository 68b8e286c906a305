"""Decode with the one-call native chain against the layer-by-layer native calls, in turn.

The chain (``native/src/decode_chain.cpp``) computes the same bits as the per-layer calls
(``tests/engine/test_batching.py`` holds it to that); what it saves is the Python between the
calls. This measures what that is worth on one model file: per round, one greedy generation
with the chain, then one with the chain switched off, in one process, after the same prompt;
the figure is the median of the per-round ratios (these machines drift by tens of percent
within minutes, and alternating in one process cancels the drift that matters).

    python benchmarks/decode_chain_ab.py MODEL.gguf [--rounds 8] [--prompt-tokens 64] [--gen-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--gen-tokens", type=int, default=64)
    args = p.parse_args()

    spec = inspect_model(args.model).spec
    model = build_model(spec, open_weights(args.model), max_context=args.prompt_tokens + args.gen_tokens + 8,
                        sequences=1)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, min(spec.vocab_size, 16000), args.prompt_tokens)]

    def generate(n: int) -> float:
        """Greedy decode of n tokens after the prompt; tokens per second of the decode."""
        seq = model.cache.new_sequence()
        model(torch.tensor(prompt[:-1]), 0, last_only=True, seq=seq, prompt=True)
        token, pos = prompt[-1], len(prompt) - 1
        start = time.perf_counter()
        for _ in range(n):
            token, pos = int(model.forward_batch([(seq, [token], pos)])[0].argmax()), pos + 1
        seconds = time.perf_counter() - start
        model.cache.drop(seq)
        return n / seconds

    generate(4)  # builds the decode step (and warms the caches' code paths)
    step = model._decode_step
    chain = None if step is None else step.chain
    if chain is None:
        print(f"{args.model}: the native chain does not cover this model's layers; nothing to compare")
        return 1
    with_chain, with_calls = [], []
    for _ in range(args.rounds):
        step.chain = chain
        with_chain.append(generate(args.gen_tokens))
        step.chain = None
        with_calls.append(generate(args.gen_tokens))
    step.chain = chain
    ratios = [a / b for a, b in zip(with_chain, with_calls)]
    print(f"chain tok/s: {' '.join(f'{x:.1f}' for x in with_chain)}")
    print(f"calls tok/s: {' '.join(f'{x:.1f}' for x in with_calls)}")
    print(f"median: chain {statistics.median(with_chain):.1f}, calls {statistics.median(with_calls):.1f} tok/s; "
          f"chain / calls {statistics.median(ratios):.3f}x (median of {len(ratios)} rounds, "
          f"{min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
