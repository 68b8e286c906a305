"""A DeepSeek/Kimi GGUF's latent attention with kv_b as the file stores it against kv_b held whole.

The engine reads a GGUF's split kv_b (attn_k_b / attn_v_b) in its stored format on the CPU
(``backend/engine/latent_maps.py``); before, it rebuilt kv_b_proj and held it in the compute
dtype. This loads the file twice in one process, once each way, and alternates them (the
order swapped every round): decode tokens/s over `--gen-tokens` after a 64-token prompt, the
decode step's attention part (step profile), and one whole prompt of `--prompt-tokens`. The
figures are medians over the rounds and the median of the per-round ratios (these machines
drift by tens of percent within minutes; alternating in one process cancels that drift).

    python benchmarks/latent_maps_ab.py MODEL.gguf [--rounds 8] [--gen-tokens 32] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from hybridmoe.backend.engine import build_layers, step_profile
from hybridmoe.backend.engine.session import EngineBackend
from hybridmoe.backend.hardware import detect
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=512)
    args = p.parse_args()

    inspected = inspect_model(args.model)
    context = 64 + args.gen_tokens + args.prompt_tokens + 8
    plan = make(inspected.spec, inspected.inventory, detect(measure_bandwidth=False),
                Workload(context=context, strategy="cpu-only"))
    stored_maps = build_layers.stored_maps
    models = {}
    for name in ("stored", "whole"):
        build_layers.stored_maps = stored_maps if name == "stored" else (lambda *_: None)
        models[name] = EngineBackend().load(args.model, plan).model
    build_layers.stored_maps = stored_maps
    if all(m.stored_maps is None for m in models["stored"].modules() if hasattr(m, "stored_maps")):
        print(f"{args.model}: no split kv_b the kernels read (not a DeepSeek/Kimi GGUF?)", file=sys.stderr)
        return 1
    ids = torch.randint(1000, inspected.spec.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    figures = {name: {"decode": [], "attend": [], "prompt": []} for name in models}
    with torch.inference_mode():
        for model in models.values():
            model(ids[:, :64], 0, last_only=True)
        for r in range(args.rounds):
            for name in (("stored", "whole") if r % 2 == 0 else ("whole", "stored")):
                model, f = models[name], figures[name]
                t0 = time.perf_counter()
                for pos in range(64, 64 + args.gen_tokens):
                    model(ids[:, pos : pos + 1], pos)
                f["decode"].append(args.gen_tokens / (time.perf_counter() - t0))
                with step_profile.recording() as profile:
                    model(ids[:, 64 + args.gen_tokens : 65 + args.gen_tokens], 64 + args.gen_tokens)
                f["attend"].append(profile.seconds.get("attend", 0.0) * 1e3)
                t0 = time.perf_counter()
                model(ids[:, : args.prompt_tokens], 0, last_only=True)
                f["prompt"].append((time.perf_counter() - t0) * 1e3)
                model(ids[:, :64], 0, last_only=True)  # the decode positions again, for the next round
    s, w = figures["stored"], figures["whole"]
    med = statistics.median
    print(f"{args.model}: {args.rounds} rounds in one process, the order swapped every round")
    print(f"decode tok/s: stored {med(s['decode']):.1f}, whole {med(w['decode']):.1f}; per-round ratio "
          f"{med(a / b for a, b in zip(s['decode'], w['decode'])):.3f}")
    print(f"decode attention, ms a token: stored {med(s['attend']):.2f}, whole {med(w['attend']):.2f}")
    print(f"{args.prompt_tokens}-token prompt, ms: stored {med(s['prompt']):.0f}, whole {med(w['prompt']):.0f}; "
          f"per-round ratio {med(a / b for a, b in zip(s['prompt'], w['prompt'])):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
