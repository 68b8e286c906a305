"""A benchmark GGUF in another of llama.cpp's mixes, made by llama.cpp's own quantizer from a
quantized one (requantizing: fine for speed, not for quality).

The converter writes bf16, q8_0, q4_0 and q4_k_m; the low-bit mixes that DeepSeek and Kimi are
mostly run in (Q2_K, Q3_K_M) come from llama.cpp. This turns the mid-size bench model
(`benchmarks/make_midsize_qwen3.py DIR --quant q4_0`) into them in a minute or two:

    python benchmarks/requantize.py DIR-q4_0.gguf DIR-q2_k.gguf q2_k      (or q3_k_m, q4_k_m, q5_k_m, q6_k)
"""

from __future__ import annotations

import argparse
import sys


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("mix", help="llama.cpp's name without the prefix: q2_k, q3_k_m, q4_k_m, ...")
    args = p.parse_args()
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.mix.upper()}")
    params.allow_requantize = True
    sys.exit(llama_cpp.llama_model_quantize(args.src.encode(), args.dst.encode(), params))


if __name__ == "__main__":
    main()
