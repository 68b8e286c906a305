"""The engine's greedy choices against llama.cpp's on the same file, teacher-forced.

llama.cpp generates greedy tokens after a prompt, and the engine is fed the same tokens: at every
step both have the same text behind them, so every step is compared. Left to generate freely,
the two stop being comparable at their first difference (each then continues its own text); on
a random-weight model whose logits sit on near ties that comes within a few tokens and says
nothing of the steps after it. Where the two choose differently, the margins say whether it was
a near tie: the gap between the two tokens in llama.cpp's logits and in the engine's (under
about 5e-3, rounding decides). benchmarks/greedy_vs_llama_cpp.py holds both to the exact
product of the weights, where they differ wider.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NEAR_TIE = 5e-3


def distance(rows: Sequence[np.ndarray], ref: Sequence[np.ndarray]) -> float:
    """The mean over steps of the RMS gap between `rows` and `ref`, in units of `ref`'s spread."""
    return float(np.mean([np.sqrt(((r - f) ** 2).mean()) / f.std() for r, f in zip(rows, ref)]))


def compare(tokens: Sequence[int], theirs: Sequence[np.ndarray], ours: Sequence[np.ndarray]) -> dict:
    """llama.cpp's greedy `tokens` and the logits before each, `theirs` and the engine's `ours`:
    {"steps", "same", "differences": [{"step", "engine", "llamacpp", "llamacpp_margin",
    "engine_margin"}], "distance"} (distance: the engine's logits from llama.cpp's)."""
    differences = []
    for step, (row, ref, token) in enumerate(zip(ours, theirs, tokens)):
        best = int(np.argmax(row))
        if best != token:
            differences.append({"step": step, "engine": best, "llamacpp": int(token),
                                "llamacpp_margin": float(ref[token] - ref[best]),
                                "engine_margin": float(row[best] - row[token])})
    return {"steps": len(tokens), "same": len(tokens) - len(differences), "differences": differences,
            "distance": distance(ours, theirs)}


def in_words(result: dict) -> str:
    """'32/32', or '30/32 (near ties: llama.cpp margins up to 0.0018)', or with the margins that were not."""
    text = f"{result['same']}/{result['steps']}"
    margins = [d["llamacpp_margin"] for d in result["differences"]]
    if not margins:
        return text
    if all(m < NEAR_TIE for m in margins):
        return f"{text} (near ties: llama.cpp margins up to {max(margins):.4f})"
    return f"{text} (llama.cpp margins {', '.join(f'{m:.4f}' for m in sorted(margins))})"
