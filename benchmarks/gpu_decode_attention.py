"""GPU decode with and without the paged decode-attention kernels, from short to long contexts.

``engine/paged_decode.py`` replaces the reference attention of decode rows on CUDA (about 30
launches a layer) by two Triton launches, for grouped-query and latent attention alike. This
decodes the GPU check's mid-size Qwen3-shaped model and its DeepSeek-V3-shaped (latent) one,
every expert on the GPU, from each starting position: 32 greedy steps with the kernels, then
the same with the reference attention (``MAX_KEYS = 0``), a fresh model for each.

    python benchmarks/gpu_decode_attention.py [--starts 64 1024 3584]

Without CUDA it runs a tiny model on the CPU (the kernels do not apply there): a check of
the script, not a measurement.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_check  # noqa: E402 - the GPU check's model writers and builders

from hybridmoe.backend.engine import paged_decode  # noqa: E402
from hybridmoe.backend.engine.hybrid import HybridOptions  # noqa: E402


def decode_rate(path: Path, device: str, experts: int, start: int, steps: int = 32) -> float:
    ids = torch.randint(0, 16384, (1, start + steps + 8), generator=torch.Generator().manual_seed(0))
    model = gpu_check.build(path, max_context=start + steps + 16, device=device,
                            placement=gpu_check._share(path, experts, 100), hybrid=HybridOptions())
    try:
        for p in range(0, start, 2048):
            model(ids[:, p:min(p + 2048, start)], p, last_only=True)
        for i in range(4):  # warm-up steps
            int(model(ids[:, start + i:start + i + 1], start + i)[0, -1].argmax())
        gpu_check.sync()
        t0 = time.perf_counter()
        for i in range(4, 4 + steps):
            int(model(ids[:, start + i:start + i + 1], start + i)[0, -1].argmax())  # the next step's token: a sync
        return steps / (time.perf_counter() - t0)
    finally:
        if model.scheduler is not None:
            model.scheduler.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--starts", type=int, nargs="+", default=[64, 1024, 3584], help="positions decoding starts from")
    args = p.parse_args()
    if torch.cuda.is_available():
        device = "cuda"
        dims = dict(layers=8, experts=64, hidden=2048, inter=768, heads=32, kv_heads=4, head_dim=128, vocab=16384)
    else:
        device, args.starts = "cpu", [64, 100]
        dims = dict(layers=2, experts=64, hidden=256, inter=128, heads=4, kv_heads=2, head_dim=64, vocab=16384)
    work = Path(tempfile.mkdtemp(prefix="hybridmoe-decode-attention-"))
    models = {"grouped-query": gpu_check.write_qwen3_moe(work / "gqa", dtype=torch.bfloat16, **dims),
              "latent": gpu_check.write_deepseek_v3(work / "latent", dtype=torch.bfloat16,
                                                    **{**dims, "layers": min(4, dims["layers"]), "heads": 16})}
    max_keys = paged_decode.MAX_KEYS
    for start in args.starts:
        for name, path in models.items():
            rates = {}
            for kernels in (True, False):
                paged_decode.MAX_KEYS = max_keys if kernels else 0
                try:
                    rates[kernels] = decode_rate(path, device, dims["experts"], start)
                finally:
                    paged_decode.MAX_KEYS = max_keys
                if device == "cuda":
                    torch.cuda.empty_cache()
            print(f"{name:13} from {start:5}: kernels {rates[True]:7.1f} tok/s, reference attention "
                  f"{rates[False]:7.1f} tok/s ({rates[True] / rates[False]:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
