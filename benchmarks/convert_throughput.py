"""Conversion throughput and peak memory on a multi-GB Qwen3-MoE-shaped checkpoint.

    python benchmarks/convert_throughput.py [--layers 4] [--experts 64] [--quants q8_0 q4_0] [--dir /tmp]

Writes a random bf16 checkpoint (safetensors shards written directly, one per layer, with a
tiny trained tokenizer), converts it with ``hybridmoe.backend.convert.to_gguf`` once per quantization,
each in a fresh process, and prints for each: seconds, input GB/s (checkpoint bytes read
per second), output size, and peak memory: VmHWM (resident high-water mark, which counts the
checkpoint pages mapped while they are read: page cache the kernel can drop) and the peak
anonymous (process-owned) memory, sampled every 20 ms. Everything is deleted afterwards.
Not part of the test suite: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HIDDEN, MOE_INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 768, 32, 4, 128, 16384


def write_checkpoint(directory: Path, layers: int, experts: int) -> int:
    """A random Qwen3-MoE checkpoint, one shard per layer; returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    weight_map, total = {}, 0

    def save(tensors: dict, name: str) -> None:
        nonlocal total
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()

    save({"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN),
          "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}, "model-embed.safetensors")
    for i in range(layers):
        p = f"model.layers.{i}"
        t = {
            f"{p}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            f"{p}.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            f"{p}.self_attn.q_norm.weight": torch.ones(HEAD_DIM, dtype=torch.bfloat16),
            f"{p}.self_attn.k_norm.weight": torch.ones(HEAD_DIM, dtype=torch.bfloat16),
            f"{p}.mlp.gate.weight": rand(experts, HIDDEN),
        }
        for e in range(experts):
            t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rand(MOE_INTER, HIDDEN)
            t[f"{p}.mlp.experts.{e}.up_proj.weight"] = rand(MOE_INTER, HIDDEN)
            t[f"{p}.mlp.experts.{e}.down_proj.weight"] = rand(HIDDEN, MOE_INTER)
        save(t, f"model-{i:05d}.safetensors")
        del t
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": HIDDEN,
        "intermediate_size": 6144, "moe_intermediate_size": MOE_INTER, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_experts": experts, "num_experts_per_tok": 8, "norm_topk_prob": True, "vocab_size": VOCAB,
        "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["a tiny corpus for a tokenizer, 12345"] * 10, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    return total


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run_one(model: Path, out: Path, quant: str) -> dict:
    """One conversion in this process; memory sampled alongside."""
    from hybridmoe.backend.convert import to_gguf

    peak_anon = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak_anon
        while not stop.is_set():
            peak_anon = max(peak_anon, _status_kib("RssAnon"))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    to_gguf(model, out, quant)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    return {"quant": quant, "seconds": seconds, "out_bytes": out.stat().st_size,
            "vm_hwm_kib": _status_kib("VmHWM"), "peak_anon_kib": peak_anon}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--quants", nargs="+", default=["q8_0", "q4_0"])
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--run-one", nargs=3, metavar=("MODEL", "OUT", "QUANT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run_one:
        model, out, quant = args.run_one
        print(json.dumps(run_one(Path(model), Path(out), quant)))
        return

    work = Path(tempfile.mkdtemp(prefix="hybridmoe-bench-", dir=args.dir))
    try:
        model = work / "qwen3moe-random"
        model.mkdir()
        t = time.perf_counter()
        size = write_checkpoint(model, args.layers, args.experts)
        print(f"checkpoint: {size / 1e9:.2f} GB bf16 ({args.layers} layers x {args.experts} experts, hidden "
              f"{HIDDEN}, moe_intermediate {MOE_INTER}) written in {time.perf_counter() - t:.1f} s; "
              f"{os.cpu_count()} CPUs")
        for quant in args.quants:
            out = work / f"out-{quant}.gguf"
            proc = subprocess.run([sys.executable, __file__, "--run-one", str(model), str(out), quant],
                                  check=True, capture_output=True, text=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"{quant:7s} {r['seconds']:6.1f} s  {size / r['seconds'] / 1e9:5.2f} GB/s in  "
                  f"out {r['out_bytes'] / 1e9:5.2f} GB  VmHWM {r['vm_hwm_kib'] / 2**20:5.2f} GiB  "
                  f"peak anon {r['peak_anon_kib'] / 2**20:5.2f} GiB")
            out.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
