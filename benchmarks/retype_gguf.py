"""A benchmark GGUF in other tensor types: random valid blocks of each type at the spread of the
source's values (backend/bench/retype.py says how and why).

    python benchmarks/retype_gguf.py SRC.gguf DST.gguf --experts iq2_xxs
    python benchmarks/retype_gguf.py SRC.gguf DST.gguf --mix ud-q2_k_xl --split 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from hybridmoe.backend.bench.retype import MIXES, retype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--experts", help="type of every routed expert tensor (e.g. iq2_xxs, q4_1, iq4_xs)")
    group.add_argument("--mix", choices=MIXES)
    p.add_argument("--split", type=int, default=1, help="write this many parts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    files = retype(args.src, args.dst, experts=args.experts, mix=args.mix, parts=args.split, seed=args.seed,
                   on_tensor=lambda name, old, new: print(f"{name}: {old} -> {new}", file=sys.stderr))
    print("\n".join(map(str, files)))


if __name__ == "__main__":
    main()
