"""One core's CPU time for a prompt, the engine against llama.cpp on the same GGUF: each in a
process of its own, one thread, the second of two passes over the same prompt ids (the first
touches the weights), as CPU time so that a shared machine's neighbours do not enter it.

    python benchmarks/prompt_cpu_time.py FILE.gguf [--tokens 512] [--rounds 2]

Prints each backend's seconds per round, in turn, and the ratio of the medians (llama.cpp's
over the engine's: above 1, the engine's prompt costs less).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def engine(model: str, tokens: int) -> float:
    import torch

    from hybridmoe import _native
    from hybridmoe.backend.bench.generate import _prompt
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model

    _native.set_num_threads(1)
    torch.set_num_threads(1)
    net = build_model(inspect_model(model).spec.config, open_weights(model), max_context=tokens + 8,
                      dtype=torch.bfloat16, device="cpu")
    ids = _prompt(net.config.require("vocab_size"), tokens)
    seconds = 0.0
    for _ in range(2):
        start = time.process_time()
        net.forward_batch([(net.sequence, ids, 0)], prompt=True)  # the last row's logits, as a chat's prompt
        seconds = time.process_time() - start
    return seconds


def llamacpp(model: str, tokens: int) -> float:
    from hybridmoe.backend.bench.generate import _prompt
    from hybridmoe.backend.llamacpp.model import RawModel

    llm = RawModel(model, n_ctx=tokens + 8, n_batch=tokens, n_threads=1)
    ids = _prompt(llm.n_vocab(), tokens)
    seconds = 0.0
    for _ in range(2):
        llm.reset()
        start = time.process_time()
        llm.eval(ids)
        seconds = time.process_time() - start
    llm.close()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--worker", choices=("engine", "llamacpp"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print({"engine": engine, "llamacpp": llamacpp}[args.worker](args.model, args.tokens))
        return
    times: dict[str, list[float]] = {"engine": [], "llamacpp": []}
    for _ in range(args.rounds):
        for backend in times:
            out = subprocess.run([sys.executable, __file__, args.model, "--tokens", str(args.tokens), "--worker", backend],
                                 check=True, capture_output=True, text=True).stdout
            times[backend].append(float(out.strip().splitlines()[-1]))
            print(f"{backend:9} {times[backend][-1]:.3f} s", flush=True)
    ratio = statistics.median(times["llamacpp"]) / statistics.median(times["engine"])
    print(f"{args.tokens}-token prompt, one core's CPU time: llama.cpp / engine = {ratio:.2f}")


if __name__ == "__main__":
    main()
