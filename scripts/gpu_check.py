#!/usr/bin/env python
"""Hybrid execution on a GPU machine, checked and measured in one run (issue 8).

    python scripts/gpu_check.py [--json FILE] [--layers 8] [--experts 64] [--budget 280]

Sections, each guarded (a failure is reported and the next section runs):

1. environment: torch, CUDA devices, the native CPU kernels in use;
2. parity: tiny float32 checkpoints of several families, logits of the hybrid engine
   (GPU main device; CPU experts overlapped, streamed prefill, int8 GPU experts, a
   pipeline when there are two GPUs, three sequences decoding in the same steps) against
   the CPU-only engine;
3. bandwidth: host-to-device (pinned and pageable) and device-to-host copy rates, and the
   streamed-prefill threshold they give (docs/sizing.md §6);
4. speed: a mid-size random Qwen3-MoE checkpoint in bf16 (hidden 2048, 64 experts of 768,
   top 8; 8 layers: 4.8 GB of experts): decode tokens/s CPU-only and with 0, 25, 50, 100 %
   of the experts on the GPU (100 % also as int8), 4K-token prefill tokens/s CPU-only, with
   the CPU experts computed on the CPU (0 %), and streamed to the GPU (0 %, 50 %); then the
   issue's targets: decode at 0 % at least CPU-only decode plus the saved attention time,
   decode rising with the GPU share, streamed prefill at least 3x the CPU-expert prefill;
5. flagship (issue 18): a tiny Q4_0 model with int4 GPU experts against the same experts on
   the CPU; tensor parallelism over two cards against the CPU-only engine (with two or more
   GPUs; the CPU stands in for the cards on a machine without CUDA, as for parity);
6. decode kernels: one MoE layer's GPU experts through ``engine.decode_experts`` (two
   launches) at 1 and 4 tokens, mid-size shape in bf16 and int8, Kimi's (hidden 7168, 2048)
   in 4-bit: error against the dequantized matrices, time and bytes over time; block sizes
   tried at one token;
7. launch cost: what one small kernel launch costs the host thread;
8. stored projections (issue 46): DeepSeek-V3's always-read projections at full width in
   their GGUF blocks (``engine.stored_linear``): decode read rate against the card's copy
   rate (target >= 70 %), error against the dequantized matrix, a 512-token prompt, GEMV
   block sizes; then MLA's kv_b held as stored (``engine.stored_latent``), split and whole:
   the absorbed form's two per-head products at 1 and 4 rows, read rate, error, the bf16
   matmuls over the widened maps they replace, block sizes. ``--sections "stored
   projections"`` runs it alone (about a minute and a half);
9. stored experts (issue 46): one MoE layer's GPU experts at DeepSeek-V3's width held as the
   GGUF stores them (``engine.stored_experts``), Q4_K_M's types, IQ4_XS, i-quants, Q4_0 beside
   its int4 codes: decode read rate against the card's copy rate (target >= 70 %), error,
   block sizes, a prompt's call. With TRITON_INTERPRET=1 and no CUDA it runs on the CPU at a
   small shape (a check of the code).

The speed section also decodes with the reference loop over the GPU experts instead of the
decode kernels, with the reference attention instead of the decode-attention kernels
(``engine.paged_decode``; also for a DeepSeek-V3-shaped model's latent attention), and with
the CPU half of decode steps on the scheduler's worker thread (``engine.hybrid``), in the
same run for the ratios; it profiles a decode step by operator, and the hybrid rows' host
time by part of a MoE layer (``engine.step_profile``).

Prints a table and writes JSON (to --json, default $OUT/gpu_check.json or ./gpu_check.json).
Without CUDA (a CPU-only machine) the GPU sections are skipped with a message and parity
runs with the CPU standing in for the GPU; `--cpu-speed` also runs a small speed section
there, to exercise its code. Nothing is installed; everything is written under a temporary
directory and removed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

GB = 1e9


class Report:
    def __init__(self, deadline: float):
        self.deadline = deadline
        self.data: dict = {"sections": {}}
        self.cache: dict = {}  # figures sections share (the card's copy rate)
        self.lines: list[str] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def run(self, name: str, fn, *args) -> None:
        self.say(f"\n== {name} ==")
        started = time.monotonic()
        try:
            result = fn(self, *args)
            self.data["sections"][name] = {"status": "ok", **(result or {})}
        except Skip as why:
            self.say(f"skipped: {why}")
            self.data["sections"][name] = {"status": "skipped", "reason": str(why)}
        except Exception as err:  # noqa: BLE001 - every section is guarded: report it and go on
            self.say(f"FAILED: {type(err).__name__}: {err}")
            traceback.print_exc()
            self.data["sections"][name] = {"status": "failed", "error": f"{type(err).__name__}: {err}",
                                           "traceback": traceback.format_exc()}
        self.say(f"({time.monotonic() - started:.1f} s)")


class Skip(Exception):
    pass


def cuda() -> bool:
    return torch.cuda.is_available()


# ---- 1. environment ---------------------------------------------------------------------


def environment(r: Report) -> dict:
    from hybridmoe.backend.engine import native_kernels

    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": cuda(),
            "cpu_count": os.cpu_count(), "native": native_kernels.isa(),
            "torch_threads": torch.get_num_threads()}
    if cuda():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda_version"] = torch.version.cuda
        info["int8_op_on_cuda"] = _int8_op_on_cuda()
    for k, v in info.items():
        r.say(f"{k:16} {v}")
    if not native_kernels.available():
        r.say("note: the native CPU kernels are not built: CPU experts run the PyTorch reference "
              "(slow); build them with `pip install -e . --no-build-isolation` for real figures")
    if not cuda():
        r.say("note: no CUDA device: GPU sections are skipped; parity runs with the CPU standing in")
    return info


def _int8_op_on_cuda() -> str:
    try:
        x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
        w = torch.randint(-127, 128, (32, 64), device="cuda", dtype=torch.int8)
        s = torch.rand(32, device="cuda", dtype=torch.bfloat16)
        torch._weight_int8pack_mm(x, w, s)
        torch.cuda.synchronize()
        return "yes"
    except Exception as err:  # noqa: BLE001 - informational: whichever way the op fails
        return f"no ({type(err).__name__})"


# ---- checkpoints ------------------------------------------------------------------------


def tiny_checkpoint(family: str, out: Path) -> Path:
    """A tiny float32 checkpoint: written by transformers (the tests' writer) when it is
    installed, else (qwen3_moe only) straight to safetensors."""
    try:
        from tests.engine.conftest import make_checkpoint
    except ImportError:
        if family != "qwen3_moe":
            raise Skip("transformers is not installed") from None
        return write_qwen3_moe(out, layers=3, experts=8, hidden=64, inter=32, heads=4, kv_heads=2, head_dim=16,
                               vocab=256, dtype=torch.float32, scale=0.15)
    return make_checkpoint(family, out, torch.float32)


class _RandomShards:
    """A random checkpoint written one safetensors shard at a time. Tensors are drawn from one
    pool of random numbers at random offsets (fast; every tensor has its own memory)."""

    def __init__(self, out: Path, dtype: torch.dtype, scale: float):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.dtype, self.weight_map = out, dtype, {}
        self.g = torch.Generator().manual_seed(0)
        self.pool = (torch.randn(1 << 24, generator=self.g) * scale).to(dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        n = 1
        for s in shape:
            n *= s
        parts, left = [], n
        while left:
            take = min(left, self.pool.numel() // 2)
            start = int(torch.randint(0, self.pool.numel() - take, (1,), generator=self.g))
            parts.append(self.pool[start : start + take])
            left -= take
        return torch.cat(parts).reshape(shape).clone()

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=self.dtype)

    def save(self, tensors: dict, name: str) -> None:
        from safetensors.torch import save_file

        save_file(tensors, str(self.out / name), metadata={"format": "pt"})
        self.weight_map.update({key: name for key in tensors})

    def finish(self, config: dict) -> Path:
        (self.out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": self.weight_map}))
        (self.out / "config.json").write_text(json.dumps({**config, "torch_dtype": str(self.dtype).split(".")[-1]}))
        return self.out

    def embeddings(self, vocab: int, hidden: int) -> None:
        self.save({"model.embed_tokens.weight": self.rand(vocab, hidden), "lm_head.weight": self.rand(vocab, hidden),
                   "model.norm.weight": self.ones(hidden)}, "model-embed.safetensors")

    def experts(self, p: str, experts: int, hidden: int, inter: int) -> dict:
        t = {}
        for e in range(experts):
            t |= self.mlp(f"{p}.experts.{e}", hidden, inter)
        return t

    def first_dense_then_shared_moe(self, p: str, layer: int, experts: int, hidden: int, inter: int,
                                    dense_inter: int) -> dict:
        """GLM-4.5's and DeepSeek-V3's feed-forward block: a dense MLP in the first layer; after
        it a sigmoid router with its (zero) correction bias, the routed experts and one shared
        expert of their size."""
        if layer == 0:
            return self.mlp(p, hidden, dense_inter)
        return ({f"{p}.gate.weight": self.rand(experts, hidden),
                 f"{p}.gate.e_score_correction_bias": torch.zeros(experts, dtype=torch.float32)}
                | self.experts(p, experts, hidden, inter) | self.mlp(f"{p}.shared_experts", hidden, inter))

    def mlp(self, p: str, hidden: int, inter: int) -> dict:
        return {f"{p}.gate_proj.weight": self.rand(inter, hidden), f"{p}.up_proj.weight": self.rand(inter, hidden),
                f"{p}.down_proj.weight": self.rand(hidden, inter)}


def _attention(w: _RandomShards, p: str, hidden: int, heads: int, kv_heads: int, head_dim: int,
               bias: bool = False) -> dict:
    t = {f"{p}.input_layernorm.weight": w.ones(hidden), f"{p}.post_attention_layernorm.weight": w.ones(hidden),
         f"{p}.self_attn.q_proj.weight": w.rand(heads * head_dim, hidden),
         f"{p}.self_attn.k_proj.weight": w.rand(kv_heads * head_dim, hidden),
         f"{p}.self_attn.v_proj.weight": w.rand(kv_heads * head_dim, hidden),
         f"{p}.self_attn.o_proj.weight": w.rand(hidden, heads * head_dim),
         f"{p}.self_attn.q_norm.weight": w.ones(head_dim), f"{p}.self_attn.k_norm.weight": w.ones(head_dim)}
    if bias:
        t |= {f"{p}.self_attn.{x}_proj.bias": w.rand(n * head_dim)
              for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    return t


def write_qwen3_moe(out: Path, *, layers: int, experts: int, hidden: int, inter: int, heads: int, kv_heads: int,
                    head_dim: int, vocab: int, dtype: torch.dtype, scale: float = 0.02, k: int = 8) -> Path:
    """A random Qwen3-MoE checkpoint, one safetensors shard per layer."""
    w = _RandomShards(out, dtype, scale)
    w.embeddings(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        t = _attention(w, p, hidden, heads, kv_heads, head_dim)
        t[f"{p}.mlp.gate.weight"] = w.rand(experts, hidden)
        w.save(t | w.experts(f"{p}.mlp", experts, hidden, inter), f"model-{i:05d}.safetensors")
    return w.finish({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": hidden,
        "intermediate_size": 4 * hidden, "moe_intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_experts": experts, "num_experts_per_tok": k if experts >= k else 2, "norm_topk_prob": True,
        "vocab_size": vocab, "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False})


def write_glm4_moe(out: Path, *, layers: int, experts: int, hidden: int, inter: int, heads: int, kv_heads: int,
                   head_dim: int, vocab: int, dtype: torch.dtype, scale: float = 0.02, k: int = 8,
                   dense_inter: int | None = None) -> Path:
    """A random GLM-4.5-shaped checkpoint (one safetensors shard per layer): q|k|v bias, per-head
    q/k norm, half the head rotated, a dense first layer, sigmoid routing with a correction
    bias, one shared expert of the routed experts' size."""
    w = _RandomShards(out, dtype, scale)
    w.embeddings(vocab, hidden)
    dense_inter = dense_inter or 4 * inter
    for i in range(layers):
        p = f"model.layers.{i}"
        t = _attention(w, p, hidden, heads, kv_heads, head_dim, bias=True)
        t |= w.first_dense_then_shared_moe(f"{p}.mlp", i, experts, hidden, inter, dense_inter)
        w.save(t, f"model-{i:05d}.safetensors")
    return w.finish({
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": hidden,
        "intermediate_size": dense_inter, "moe_intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "n_routed_experts": experts, "num_experts_per_tok": k, "n_shared_experts": 1, "n_group": 1,
        "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5, "vocab_size": vocab,
        "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False})


def write_deepseek_v3(out: Path, *, layers: int, experts: int, hidden: int, inter: int, heads: int, kv_heads: int,
                      head_dim: int, vocab: int, dtype: torch.dtype, scale: float = 0.02, k: int = 8) -> Path:
    """A random DeepSeek-V3-shaped checkpoint (one safetensors shard per layer): latent attention
    (``heads`` heads; DeepSeek-V3's q LoRA 1536, latent 512, rotary 64, nope and value heads
    ``head_dim``), a dense first layer, sigmoid routing over eight groups (four kept; one group
    under 16 experts) with a correction bias, one shared expert of the routed experts' size. ``kv_heads`` is unused (the
    latent cache is one head) and kept for the writers' common signature."""
    w = _RandomShards(out, dtype, scale)
    w.embeddings(vocab, hidden)
    q_lora, kv_lora, rope, nope, v = 1536, 512, 64, head_dim, head_dim
    for i in range(layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        t = {f"{p}.input_layernorm.weight": w.ones(hidden), f"{p}.post_attention_layernorm.weight": w.ones(hidden),
             f"{a}.q_a_proj.weight": w.rand(q_lora, hidden), f"{a}.q_a_layernorm.weight": w.ones(q_lora),
             f"{a}.q_b_proj.weight": w.rand(heads * (nope + rope), q_lora),
             f"{a}.kv_a_proj_with_mqa.weight": w.rand(kv_lora + rope, hidden),
             f"{a}.kv_a_layernorm.weight": w.ones(kv_lora), f"{a}.kv_b_proj.weight": w.rand(heads * (nope + v), kv_lora),
             f"{a}.o_proj.weight": w.rand(hidden, heads * v)}
        t |= w.first_dense_then_shared_moe(f"{p}.mlp", i, experts, hidden, inter, 4 * inter)
        w.save(t, f"model-{i:05d}.safetensors")
    return w.finish({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": hidden,
        "intermediate_size": 4 * inter, "moe_intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "n_routed_experts": experts,
        # Eight groups of at least two experts, four kept, as DeepSeek-V3; one group for fewer experts.
        "num_experts_per_tok": k, "n_shared_experts": 1, "n_group": 8 if experts >= 16 else 1,
        "topk_group": 4 if experts >= 16 else 1, "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope,
        "v_head_dim": v, "vocab_size": vocab, "max_position_embeddings": 32768, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False})


def build(path: Path, **kwargs):
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights

    config = json.loads((path / "config.json").read_text())
    return build_model(config, open_weights(path), **kwargs)


def moe_layers_of(model) -> list:
    from hybridmoe.backend.engine.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def run_tokens(model, ids: torch.Tensor, prefill: int, chunk: int) -> torch.Tensor:
    steps = [model(ids[:, p : min(p + chunk, prefill)], p) for p in range(0, prefill, chunk)]
    steps += [model(ids[:, t : t + 1], t) for t in range(prefill, ids.shape[1])]
    return torch.cat([s.float().cpu() for s in steps], dim=1)


def run_batched(model, prompts: list[torch.Tensor], prefill: int) -> list[torch.Tensor]:
    """Each prompt [1, T] prefilled alone (prompt rows), then its tokens after `prefill` one
    per decode step, all prompts' tokens in the same steps (continuous batching): each
    prompt's decode logits [1, T - prefill, V]."""
    seqs = [model.cache.new_sequence() for _ in prompts]
    for seq, ids in zip(seqs, prompts):
        model(ids[0, :prefill], 0, seq=seq, prompt=True)
    rows = [[] for _ in prompts]
    for t in range(prefill, prompts[0].shape[1]):
        out = model.forward_batch([(seq, [int(ids[0, t])], t) for seq, ids in zip(seqs, prompts)])
        for i, logits in enumerate(out):
            rows[i].append(logits.float().cpu())
    return [torch.stack(r).unsqueeze(0) for r in rows]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# ---- 2. parity --------------------------------------------------------------------------


def parity_case(r: Report, results: list, family: str, name: str, run) -> bool:
    """Run one parity case (``run() -> (rel err, ok, extra entries)``), report and record
    it; a case that raises is a failure that must not hide the others."""
    try:
        err, ok, extra = run()
    except Exception as error:  # noqa: BLE001 - one case failing must not hide the others
        results.append({"family": family, "case": name, "error": f"{type(error).__name__}: {error}"})
        r.say(f"{family:12} {name:28} FAILED: {type(error).__name__}: {error}")
        traceback.print_exc()
        return False
    results.append({"family": family, "case": name, "rel_err": err, "ok": ok, **extra})
    r.say(f"{family:12} {name:28} rel err {err:.2e}  {'ok' if ok else 'MISMATCH'}  "
          + "  ".join(f"{k} {v}" for k, v in extra.items()))
    return ok


def parity(r: Report, work: Path) -> dict:
    from hybridmoe.backend.engine.hybrid import HybridOptions

    device = "cuda" if cuda() else "cpu"
    where = "GPU" if cuda() else "CPU standing in for the GPU"
    results, failures = [], 0
    for family in ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen2_moe"):
        if r.left() < 60:
            r.say(f"{family}: skipped, time budget spent")
            continue
        try:
            path = tiny_checkpoint(family, work / f"tiny-{family}")
        except Skip as why:
            r.say(f"{family}: skipped ({why})")
            continue
        ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
        reference = build(path, device="cpu", max_context=64)
        layers = [m.layer for m in moe_layers_of(reference)]
        n = reference.stats.n_experts
        expected = run_tokens(reference, ids, prefill=16, chunk=8)
        expected_counts = {layer: c.clone() for layer, c in reference.stats.counts.items()}
        half = {layer: list(range(0, n, 2)) for layer in layers}
        everything = {layer: list(range(n)) for layer in layers}
        cases = [
            ("overlapped, 0% on GPU", {}, {"hybrid": HybridOptions()}),
            ("overlapped, 50% on GPU", half, {"hybrid": HybridOptions()}),
            ("all experts on GPU", everything, {"hybrid": HybridOptions()}),
            ("streamed prefill, 0%", {}, {"hybrid": HybridOptions(stream_min_tokens=8)}),
            ("streamed prefill, 50%", half, {"hybrid": HybridOptions(stream_min_tokens=8)}),
            ("int8 GPU experts, 50%", half, {"hybrid": HybridOptions(), "resident_form": "int8"}),
        ]
        if cuda() and torch.cuda.device_count() >= 2:
            n_layers = len(reference.layers)
            cut = n_layers // 2
            stages = [("cuda:0", tuple(range(cut))), ("cuda:1", tuple(range(cut, n_layers)))]
            cases.append(("pipeline over 2 GPUs, 50%", half,
                          {"hybrid": HybridOptions(stream_min_tokens=8), "pipeline": stages}))
        for name, placement, kwargs in cases:
            want = expected
            tolerance = 1e-4
            if kwargs.get("resident_form") == "int8":
                # The same int8 weights on the CPU: the hybrid path must reproduce them.
                want = run_tokens(build(path, device="cpu", max_context=64, placement=placement,
                                        resident_form="int8"), ids, prefill=16, chunk=8)

            def one_sequence(placement=placement, kwargs=kwargs, want=want, tolerance=tolerance):
                model = build(path, device=device, max_context=64, placement=placement, **kwargs)
                err = rel_err(run_tokens(model, ids, prefill=16, chunk=8), want)
                calls = dict(model.scheduler.calls) if model.scheduler else {}
                model.scheduler and model.scheduler.close()
                # The activation counts (kept on the device in decode) are the CPU engine's; int8
                # experts may route a token otherwise, so there they are only reported.
                counts = all(torch.equal(model.stats.counts[layer], c) for layer, c in expected_counts.items())
                ok = err < tolerance and (counts or "resident_form" in kwargs)
                return err, ok, {"calls": calls, "counts": "same" if counts else "DIFFER"}

            failures += not parity_case(r, results, family, name, one_sequence)

        # Continuous batching on the hybrid path: three sequences decoding in the same steps
        # each get the logits the CPU-only engine gives that sequence alone.
        def batched():
            prompts = [torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3)]
            want = [run_tokens(reference, p, prefill=16, chunk=8)[:, 16:] for p in prompts]
            model = build(path, device=device, max_context=64, placement=half, sequences=3, hybrid=HybridOptions())
            err = max(rel_err(g, w) for g, w in zip(run_batched(model, prompts, prefill=16), want))
            model.scheduler and model.scheduler.close()
            return err, err < 1e-4, {}

        if r.left() >= 30:
            failures += not parity_case(r, results, family, "3 sequences batched, 50%", batched)
    r.say(f"parity ({where}): {len(results) - failures} of {len(results)} cases agree with the CPU-only engine")
    return {"where": where, "cases": results, "failures": failures}


# ---- 3. bandwidth -----------------------------------------------------------------------


def bandwidth(r: Report) -> dict:
    if not cuda():
        raise Skip("no CUDA device")
    size = 1 << 30
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    out = {}
    for name, host in (("h2d_pinned", torch.empty(size, dtype=torch.uint8, pin_memory=True)),
                       ("h2d_pageable", torch.empty(size, dtype=torch.uint8))):
        host.fill_(1)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        rates = []
        for _ in range(4):
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            rates.append(size / (time.perf_counter() - t))
        out[name] = max(rates)
        if name == "h2d_pinned":
            t = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            out["d2h_pinned"] = size / (time.perf_counter() - t)
    for k, v in out.items():
        r.say(f"{k:14} {v / GB:7.1f} GB/s")
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.plan.estimate import (
        cpu_flops,
        prefill_crossover_tokens,
        prefill_stream_min_tokens,
    )

    hw = detect(measure_bandwidth=False)
    flops = cpu_flops(hw.cpu.physical_cores, hw.cpu.features)
    theory = next((g.pcie_bandwidth_bytes_per_s for g in hw.gpus if g.pcie_bandwidth_bytes_per_s), None)
    for label, bw in (("theoretical PCIe", theory), ("measured pinned", out["h2d_pinned"])):
        cross = prefill_crossover_tokens(16, flops, bw)  # bf16 experts
        thr = prefill_stream_min_tokens(cross, 64, 8)
        r.say(f"crossover ({label}{'' if bw is None else f', {bw / GB:.1f} GB/s'}): "
              f"{'unknown' if cross is None else f'{cross:.0f} tokens per expert'}, "
              f"stream prompts from {thr} tokens (bf16, 64 experts, top 8)")
        out[f"stream_min_tokens_{label.split()[0]}"] = thr
    out["cpu_flops_assumed"] = flops
    return out


# ---- 4. speed ---------------------------------------------------------------------------


def speed(r: Report, work: Path, args) -> dict:
    on_gpu = cuda()
    if not on_gpu and not args.cpu_speed:
        raise Skip("no CUDA device (pass --cpu-speed to exercise this section on the CPU with a small model)")
    from hybridmoe.backend.engine.hybrid import HybridOptions

    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        dims = dict(layers=args.layers, experts=args.experts, hidden=2048, inter=768, heads=32, kv_heads=4,
                    head_dim=128, vocab=16384)
        prompt, decode_n = args.prompt, 32
    else:  # exercising the code on a CPU-only machine: tiny and quick, the figures mean nothing
        dims = dict(layers=2, experts=16, hidden=256, inter=128, heads=4, kv_heads=2, head_dim=64, vocab=2048)
        prompt, decode_n = 256, 8
    t = time.monotonic()
    path = write_qwen3_moe(work / "mid", dtype=torch.bfloat16, **dims)
    expert_gb = dims["layers"] * dims["experts"] * 3 * dims["hidden"] * dims["inter"] * 2 / GB
    r.say(f"checkpoint: {dims['layers']} layers x {dims['experts']} experts (hidden {dims['hidden']}, "
          f"moe_intermediate {dims['inter']}), {expert_gb:.2f} GB of bf16 experts, written in "
          f"{time.monotonic() - t:.1f} s")
    vocab, n, chunk = dims["vocab"], dims["experts"], 2048
    ids = torch.randint(0, vocab, (1, prompt + decode_n + 8), generator=torch.Generator().manual_seed(0))
    stream_min = min(1024, prompt)  # every 2048-token chunk streams in the streamed runs
    rows: dict[str, dict] = {}

    def measure(label: str, *, prefill: bool, profile: bool = False, checkpoint: Path | None = None, **kwargs) -> None:
        if r.left() < 20:
            r.say(f"{label}: skipped, time budget spent")
            return
        model = build(checkpoint or path, max_context=prompt + decode_n + 16, **kwargs)
        busy = _time_cpu_experts(model)
        model(ids[:, :8], 0)  # warm up kernels and allocators
        row = {}
        if prefill:
            busy.clear()
            sync()
            t0 = time.perf_counter()
            for p in range(0, prompt, chunk):
                model(ids[:, p : min(p + chunk, prompt)], p, last_only=True)
            sync()
            row["prefill_tok_s"] = prompt / (time.perf_counter() - t0)
            if busy:
                row["prefill_cpu_experts_s"] = sum(busy)
            start = prompt
        else:
            model(ids[:, 8:64], 8, last_only=True)
            start = 64
        for i in range(4):  # warm-up decode steps
            model(ids[:, start + i : start + i + 1], start + i)
        busy.clear()
        t0 = time.perf_counter()
        for i in range(4, decode_n):
            logits = model(ids[:, start + i : start + i + 1], start + i)
            int(logits[0, -1].argmax())  # the token the next step would need: a real sync
        step = (time.perf_counter() - t0) / (decode_n - 4)
        row["decode_tok_s"] = 1 / step
        row["cpu_experts_ms_per_token"] = 1000 * sum(busy) / (decode_n - 4)
        if model.scheduler is not None:  # where a decode step's host time goes (``step_profile``)
            from hybridmoe.backend.engine import step_profile

            with step_profile.recording() as recorded:
                t0 = time.perf_counter()
                for i in range(decode_n, decode_n + 8):
                    int(model(ids[:, start + i : start + i + 1], start + i)[0, -1].argmax())
                recorded.close(time.perf_counter() - t0)
            row["host_ms_per_token"] = {p: round(1000 * v["seconds"], 2) for p, v in recorded.per_token(8).items()}
        if profile:  # where a decode step's time goes, by operator (host time and launches)
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as profiler

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
            with profiler(activities=activities) as prof:
                for i in range(decode_n, decode_n + 4):
                    int(model(ids[:, start + i : start + i + 1], start + i)[0, -1].argmax())
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40)
            row["profile"] = table
            r.say(f"{label}: 4 decode steps by operator\n{table}")
        if model.scheduler is not None:
            row["calls"] = dict(model.scheduler.calls)
            model.scheduler.close()
        rows[label] = row
        r.say(f"{label:34} " + "  ".join(f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in row.items() if k != "profile"))
        del model
        if on_gpu:
            torch.cuda.empty_cache()

    measure("cpu-only", prefill=True, device="cpu")
    for share in (0, 25, 50, 100):
        placement = _share(path, n, share)
        if share == 0:
            measure("hybrid 0% GPU, CPU-expert prefill", prefill=True, device=device, placement=placement,
                    hybrid=HybridOptions())
        # Prefill here streams the CPU experts (at 100 % there are none left to stream).
        measure(f"hybrid {share}% GPU", prefill=share in (0, 50, 100), device=device, placement=placement,
                hybrid=HybridOptions(stream_min_tokens=stream_min))
    measure("hybrid 100% GPU, int8", prefill=False, device=device, placement=_share(path, n, 100),
            resident_form="int8")
    # The same decode with the reference loop over the GPU experts instead of the two kernel
    # launches, and a profile of the step as it now runs.
    from hybridmoe.backend.engine import decode_experts

    kernel_tokens, decode_experts.MAX_TOKENS = decode_experts.MAX_TOKENS, 0
    try:
        measure("hybrid 100% GPU, reference loop", prefill=False, device=device, placement=_share(path, n, 100),
                hybrid=HybridOptions())
    finally:
        decode_experts.MAX_TOKENS = kernel_tokens
    measure("hybrid 100% GPU, profiled", prefill=False, profile=True, device=device,
            placement=_share(path, n, 100), hybrid=HybridOptions())
    # Decode from position 64 (the rows with a prompt decode past paged_decode.MAX_KEYS, where the
    # reference attention serves), then the same with the reference attention instead of the
    # decode-attention kernels: the mid-size model and a DeepSeek-V3-shaped one (latent, 16 heads).
    from hybridmoe.backend.engine import paged_decode

    measure("hybrid 0% GPU, decode from 64", prefill=False, device=device, placement=_share(path, n, 0),
            hybrid=HybridOptions())
    latent = write_deepseek_v3(work / "mid-latent", dtype=torch.bfloat16, **{**dims, "layers": min(4, dims["layers"]),
                                                                               "heads": 16, "head_dim": 128})
    measure("latent, 100% GPU", prefill=False, device=device, placement=_share(latent, n, 100),
            hybrid=HybridOptions(), checkpoint=latent)
    max_keys, paged_decode.MAX_KEYS = paged_decode.MAX_KEYS, 0
    try:
        for share in (0, 100):
            measure(f"hybrid {share}% GPU, reference attention", prefill=False, device=device,
                    placement=_share(path, n, share), hybrid=HybridOptions())
        measure("latent, 100% GPU, reference attention", prefill=False, device=device,
                placement=_share(latent, n, 100), hybrid=HybridOptions(), checkpoint=latent)
    finally:
        paged_decode.MAX_KEYS = max_keys
    # The CPU half of decode steps handed to the scheduler's worker thread, as longer calls do.
    from hybridmoe.backend.engine import hybrid

    inline_rows, hybrid.INLINE_ROWS = hybrid.INLINE_ROWS, 0
    try:
        for share in (0, 50):
            measure(f"hybrid {share}% GPU, worker thread", prefill=False, device=device,
                    placement=_share(path, n, share), hybrid=HybridOptions())
    finally:
        hybrid.INLINE_ROWS = inline_rows
    return {"dims": dims, "prompt_tokens": prompt, "rows": rows, "targets": targets(r, rows),
            "crossover": measured_crossover(r, rows, dims, prompt)}


def measured_crossover(r: Report, rows: dict, dims: dict, prompt: int) -> dict:
    """The prefill crossover from this machine's figures instead of the Plan's theoretical ones:
    the CPU experts' achieved flop rate in the CPU-expert prefill, and the measured pinned
    host-to-device rate (docs/sizing.md §6: (bits/8) · F_cpu / (2 · B_pcie))."""
    from hybridmoe.backend.plan.estimate import prefill_stream_min_tokens

    row = rows.get("hybrid 0% GPU, CPU-expert prefill") or rows.get("cpu-only") or {}
    busy = row.get("prefill_cpu_experts_s")
    bw = r.data["sections"].get("bandwidth", {}).get("h2d_pinned")
    if not busy or not bw:
        return {}
    k = 8 if dims["experts"] >= 8 else 2
    flop = 2 * 3 * dims["hidden"] * dims["inter"] * k * dims["layers"] * prompt
    f_cpu = flop / busy
    crossover = (16 / 8) * f_cpu / (2 * bw)
    threshold = prefill_stream_min_tokens(crossover, dims["experts"], k)
    r.say(f"measured: CPU experts {f_cpu / 1e12:.2f} TFLOP/s in prefill, H2D {bw / GB:.1f} GB/s -> crossover "
          f"{crossover:.0f} tokens per expert, stream prompts from {threshold} tokens")
    return {"cpu_expert_flops": f_cpu, "h2d_bytes_per_s": bw, "crossover_tokens_per_expert": crossover,
            "stream_min_tokens": threshold}


def _share(path: Path, n: int, percent: int) -> dict[int, list[int]]:
    config = json.loads((path / "config.json").read_text())
    count = round(n * percent / 100)
    first_moe = config.get("first_k_dense_replace", 0)  # DeepSeek-V3: dense layers first
    return {layer: list(range(count)) for layer in range(first_moe, config["num_hidden_layers"])}


def _time_cpu_experts(model) -> list[float]:
    """Seconds spent in each CPU-half call (on whichever thread runs it)."""
    busy: list[float] = []
    for moe in moe_layers_of(model):
        inner = moe.cpu_part

        def timed(*args, _inner=inner):
            t = time.perf_counter()
            try:
                return _inner(*args)
            finally:
                busy.append(time.perf_counter() - t)

        moe.cpu_part = timed
    return busy


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def cuda_seconds(fn, reps: int = 50) -> float:
    """Seconds one call of `fn` takes on the card: one warm-up call, then the mean of `reps`."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def targets(r: Report, rows: dict) -> dict:
    out = {}
    cpu, h0 = rows.get("cpu-only"), rows.get("hybrid 0% GPU")
    h100 = rows.get("hybrid 100% GPU")
    if cpu and h0 and h100:
        # CPU-only decode plus the saved attention time: the CPU experts' time per token plus
        # the GPU's time for everything else (bounded above by the all-on-GPU step).
        t_target = cpu["cpu_experts_ms_per_token"] / 1000 + 1 / h100["decode_tok_s"]
        out["decode_0pct_vs_cpu_only"] = h0["decode_tok_s"] / cpu["decode_tok_s"]
        out["decode_0pct_target_tok_s"] = 1 / t_target
        out["decode_0pct_meets_target"] = h0["decode_tok_s"] >= 1 / t_target
    shares = [rows.get(f"hybrid {share}% GPU") for share in (0, 25, 50, 100)]
    if all(shares):
        speeds = [s["decode_tok_s"] for s in shares]
        out["decode_by_share"] = speeds
        # 3 % slack: timing noise between neighbouring shares is not a fall.
        out["decode_rises_with_share"] = all(b >= a * 0.97 for a, b in itertools.pairwise(speeds))
    cpu_prefill = rows.get("hybrid 0% GPU, CPU-expert prefill", {}).get("prefill_tok_s")
    streamed = (h0 or {}).get("prefill_tok_s")
    if cpu_prefill and streamed:
        out["prefill_streamed_over_cpu_experts"] = streamed / cpu_prefill
        out["prefill_meets_3x"] = streamed >= 3 * cpu_prefill
    for k, v in out.items():
        r.say(f"target {k:36} {v if not isinstance(v, float) else f'{v:.2f}'}")
    return out


# ---- 5. flagship: 4-bit GPU experts, tensor parallelism ---------------------------------


def q4_0_matrix(rows: int, cols: int, seed: int):
    """A random Q4_0 matrix as a GGUF stores it (codes random, block scales ~0.01)."""
    from gguf import GGMLQuantizationType

    from hybridmoe.backend.formats import quant

    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows * cols // 32, 18), dtype=torch.uint8, generator=g)
    d = (torch.randn(rows * cols // 32, generator=g) * 0.01).to(torch.float16)
    blocks[:, :2] = d.view(torch.uint8).reshape(-1, 2)
    return quant.from_gguf(blocks.reshape(rows, -1), GGMLQuantizationType.Q4_0, (rows, cols))


def flagship(r: Report, work: Path) -> dict:
    """Without CUDA the GEMV timings are skipped and the CPU stands in for the cards."""
    from hybridmoe.backend.convert import to_gguf
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model

    out: dict = {}
    if not cuda():
        r.say("no CUDA device: the model checks run with the CPU standing in")
    device = "cuda" if cuda() else "cpu"

    # A model with int4 GPU experts: the same stored experts on the CPU give the same logits.
    try:
        from tests.convert.conftest import build_checkpoint  # a checkpoint the converter maps whole
    except ImportError:
        raise Skip("transformers is not installed") from None
    build_checkpoint(work / "tiny-int4", "qwen3_moe")
    path = to_gguf(work / "tiny-int4", work / "tiny-q4_0.gguf", "q4_0")
    spec = inspect_model(path).spec
    half = {layer: list(range(0, spec.n_routed_experts, 2)) for layer in spec.moe_layers}
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    models = [build_model(spec, open_weights(path), placement=half, device=d, max_context=64, resident_form="int4")
              for d in ("cpu", device)]
    err = rel_err(*(run_tokens(m, ids, prefill=16, chunk=8) for m in reversed(models)))
    out["int4_model_rel_err"] = err
    r.say(f"int4 GPU experts in a model ({device}): rel err {err:.2e} against the same experts on the CPU")

    # Tensor parallelism over two cards, float32, against the CPU-only engine.
    if torch.cuda.device_count() >= 2:
        # What the planner takes an all-reduce to cost (plan.estimate.ALL_REDUCE_SECONDS): one
        # token's hidden state from the second card added on the first, as Shards does.
        h = torch.randn(1, 7168, device="cuda:1", dtype=torch.bfloat16)
        acc = torch.zeros(1, 7168, device="cuda:0")
        for _ in range(20):
            acc += h.to("cuda:0").float()
        torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
        t0 = time.perf_counter()
        for _ in range(500):
            acc += h.to("cuda:0").float()
        torch.cuda.synchronize("cuda:0")
        out["card_sum_us"] = (time.perf_counter() - t0) / 500 * 1e6
        r.say(f"one token's partial sum from cuda:1 added on cuda:0: {out['card_sum_us']:.1f} us (planner assumes 10)")
    if torch.cuda.device_count() >= 2 or not cuda():
        cards = ("cuda:0", "cuda:1") if cuda() else ("cpu", "cpu")
        results = []
        for family in ("qwen3_moe", "deepseek_v3", "gpt_oss"):
            if r.left() < 30:
                break
            path = tiny_checkpoint(family, work / f"tp-{family}")
            layers = [m.layer for m in moe_layers_of(build(path, device="cpu", max_context=64))]
            dealt = [(cards[0], {layer: [0, 2] for layer in layers}), (cards[1], {layer: [1, 3] for layer in layers})]

            def split(path=path, dealt=dealt, layers=layers):
                want = run_tokens(build(path, device="cpu", max_context=64,
                                        placement={layer: [0, 1, 2, 3] for layer in layers}), ids, 16, 8)
                model = build(path, max_context=64, tensor_parallel=dealt)
                err = rel_err(run_tokens(model, ids, prefill=16, chunk=8), want)
                model.scheduler and model.scheduler.close()
                return err, err < 1e-4, {}

            parity_case(r, results, family, f"tensor parallel, 2 x {cards[0].split(':')[0]}", split)
        out["tensor_parallel"] = results
    else:
        r.say("one GPU: the tensor-parallel check needs two")
    return out


# ---- 6. decode kernels: a decode step's GPU experts in two launches ----------------------


def decode_kernels(r: Report) -> dict:
    """One MoE layer's GPU experts through ``decode_experts`` at 1 and 4 tokens (8 experts a
    token): the mid-size shape (hidden 2048, 768) in bf16 and int8, Kimi's (7168, 2048) in
    4-bit (Q4_0 codes); error against the dequantized matrices, time, and the distinct experts'
    bytes over that time; then block sizes tried at one token."""
    if not cuda():
        raise Skip("no CUDA device")
    import torch.nn.functional as F

    from hybridmoe.backend.engine import decode_experts
    from hybridmoe.backend.formats import int4_weights

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 16

    def dense_stack(rows, cols):
        return decode_experts.Stack("dense", (torch.randn(n, rows, cols, device="cuda", generator=g) * 0.02).to(torch.bfloat16))

    def int8_stack(rows, cols):
        q = torch.randint(-127, 128, (n, rows, cols), device="cuda", dtype=torch.int8, generator=g)
        return decode_experts.Stack("int8", q, (torch.rand(n, rows, device="cuda", generator=g) * 1e-3).to(torch.bfloat16))

    def int4_stack(rows, cols):
        parts = [int4_weights.from_quant(q4_0_matrix(rows, cols, seed=rows + e), "cuda") for e in range(n)]
        return decode_experts.Stack("int4", torch.stack([w.codes for w in parts]), torch.stack([w.scale for w in parts]),
                                    None, parts[0].table_tensor(), parts[0].table, parts[0].group)

    def dequantized(stack, e):
        if stack.form == "dense":
            return stack.w[e].float()
        if stack.form == "int8":
            return stack.w[e].float() * stack.scale[e].float()[:, None]
        return int4_weights.Int4Weight(stack.w[e], stack.scale[e], None, stack.table_name, stack.group).dequantize()

    def nbytes(stack):
        return sum(t.numel() * t.element_size() for t in (stack.w, stack.scale, stack.min) if t is not None) // n

    out = {"rows": [], "sweep": []}
    slot_of = torch.arange(n, dtype=torch.int32, device="cuda")
    shapes = {"bf16 2048x768": (dense_stack, 2048, 768), "int8 2048x768": (int8_stack, 2048, 768),
              "int4 7168x2048": (int4_stack, 7168, 2048)}
    sweep = [{"gate_up": (4, 256), "down": (8, 256)}, {"gate_up": (8, 256), "down": (16, 256)},
             {"gate_up": (8, 128), "down": (16, 128)}, {"gate_up": (8, 512), "down": (16, 512)},
             {"gate_up": (32, 256), "down": (64, 256)}]
    for label, (make, hidden, inter) in shapes.items():
        if r.left() < 30:
            r.say(f"{label}: skipped, time budget spent")
            continue
        gate_up, down = make(2 * inter, hidden), make(hidden, inter)
        per_expert = nbytes(gate_up) + nbytes(down)
        for tokens in (1, 4):
            x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(n, device="cuda", generator=g)[:8] for _ in range(tokens)])
            weights = torch.rand(tokens, 8, device="cuda", generator=g)
            got = decode_experts.forward(x, ids, weights, slot_of, gate_up, down, "silu")
            want = torch.zeros(tokens, hidden, device="cuda")
            for t in range(tokens):
                for j, e in enumerate(ids[t].tolist()):
                    gu = F.linear(x[t].float(), dequantized(gate_up, e))
                    want[t] += weights[t, j] * F.linear(F.silu(gu[:inter]) * gu[inter:], dequantized(down, e))
            err = rel_err(got, want)
            dt = cuda_seconds(lambda: decode_experts.forward(x, ids, weights, slot_of, gate_up, down, "silu"))
            distinct = len(set(ids.flatten().tolist()))
            row = {"shape": label, "tokens": tokens, "us": dt * 1e6, "gb_s": distinct * per_expert / dt / GB,
                   "rel_err": err}
            out["rows"].append(row)
            r.say(f"{label:15} T={tokens}: {row['us']:7.1f} us, {row['gb_s']:6.0f} GB/s over {distinct} experts' "
                  f"{per_expert / 1e6:.1f} MB, rel err {err:.1e}")
        x = torch.randn(1, hidden, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.randperm(n, device="cuda", generator=g)[:8][None]
        weights = torch.rand(1, 8, device="cuda", generator=g)
        for blocks in sweep:
            dt = cuda_seconds(lambda: decode_experts.forward(x, ids, weights, slot_of, gate_up, down, "silu", blocks=blocks))
            out["sweep"].append({"shape": label, "blocks": blocks, "us": dt * 1e6, "gb_s": 8 * per_expert / dt / GB})
            r.say(f"{label:15} T=1 blocks {blocks}: {dt * 1e6:7.1f} us ({8 * per_expert / dt / GB:5.0f} GB/s)")
        del gate_up, down
        torch.cuda.empty_cache()
    out["ok"] = all(row["rel_err"] < 2e-2 for row in out["rows"])
    return out


def launch_cost(r: Report) -> dict:
    """What one small kernel launch costs this machine's host thread (a decode step on the GPU
    is some 400 of them: the speed section's profile)."""
    if not cuda():
        raise Skip("no CUDA device")
    a = torch.zeros(16, device="cuda")
    per_op = min(_launches(a) for _ in range(3))
    r.say(f"one tiny kernel launch from Python: {per_op * 1e6:.1f} us")
    return {"launch_us": per_op * 1e6}


def _launches(a: torch.Tensor, n: int = 2000) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        a.add_(1)
    sync()
    return (time.perf_counter() - t0) / n


# ---- 8. stored projections -------------------------------------------------------------


def stored_matrix(qtype, rows: int, cols: int, seed: int, device: str = "cuda"):
    """A random GGUF block matrix made on `device` (the card): random codes, finite fp16 super-scales."""
    from gguf import GGML_QUANT_SIZES

    from hybridmoe.backend.formats import quant
    from tests.engine.test_stored_linear import HALVES

    block, size = GGML_QUANT_SIZES[qtype]
    g = torch.Generator(device=device).manual_seed(seed)
    data = torch.randint(0, 256, (rows * cols // block, size), dtype=torch.uint8, device=device, generator=g)
    for offset in HALVES[qtype]:
        d = (torch.randn(data.shape[0], device=device, generator=g) * 0.01).to(torch.float16)
        data[:, offset : offset + 2] = d.view(torch.uint8).reshape(-1, 2)
    return quant.from_gguf(data.reshape(rows, -1), qtype, (rows, cols))


def device_copy_traffic(r: Report, device: str = "cuda", nbytes: int = 1 << 30) -> float:
    """Bytes read plus written per second by a device-to-device copy of `nbytes` (what a kernel
    that only reads can reach at most), measured once a run."""
    key = ("copy traffic", device)
    if key not in r.cache:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        r.cache[key] = 2 * src.numel() / cuda_seconds(lambda: dst.copy_(src), reps=10)
        del src, dst
        r.say(f"device copy: {r.cache[key] / GB:.0f} GB/s read + written ({r.cache[key] / 2 / GB:.0f} GB/s copied)")
    return r.cache[key]


def stored_projections(r: Report) -> dict:
    """DeepSeek-V3's always-read projections at full width held as a GGUF stores them
    (``engine.stored_linear``, issue 46): decode (1 and 4 tokens, the GEMV kernel) read rate
    against the card's copy rate (target: the 7168 x 16384 Q4_K output projection and the Q6_K
    head at >= 70 % of it), the error against PyTorch's matmul over the dequantized matrix,
    a 512-token prompt (dequantized tiles into matmuls); GEMV block sizes tried on the output
    projection. Copy rate: bytes read plus written per second by a 1 GiB device-to-device copy
    (what a kernel that only reads can reach at most); the ratio to half of it (bytes copied
    per second) is given too."""
    if not cuda():
        raise Skip("no CUDA device")
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as Q

    from hybridmoe.backend.engine import stored_linear

    copy_traffic = device_copy_traffic(r)
    out = {"copy_traffic_gb_s": copy_traffic / GB, "rows": [], "sweep": []}
    # (name, rows, columns, type): DeepSeek-V3's shapes (128 heads of 128/192, q_lora 1536,
    # kv_lora 512 + rope 64, shared expert 2048, vocab 129280) in Q4_K_M's types and others.
    cases = [("o_proj", 7168, 16384, Q.Q4_K), ("q_b_proj", 24576, 1536, Q.Q4_K), ("q_a_proj", 1536, 7168, Q.Q4_K),
             ("kv_a_proj", 576, 7168, Q.Q6_K), ("shared down", 7168, 2048, Q.Q6_K), ("o_proj", 7168, 16384, Q.Q8_0),
             ("o_proj", 7168, 16384, Q.Q4_0), ("o_proj", 7168, 16384, Q.IQ4_XS), ("o_proj", 7168, 16384, Q.Q5_K),
             ("lm_head", 129280, 7168, Q.Q6_K)]
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, rows, cols, qtype in cases:
        if r.left() < 20:
            r.say(f"{name} {qtype.name}: skipped, time budget spent")
            continue
        lin = stored_linear.StoredLinear(stored_matrix(qtype, rows, cols, seed=rows + int(qtype)))
        nbytes = lin.data.numel()
        ref = lin.stored.dequantize(torch.bfloat16)  # the torch decoders (what the tests check the kernels against)
        for tokens in (1, 4, 512):
            if tokens == 512 and rows > 30000:
                continue  # the head's prompt call: only the last token's logits are computed
            x = torch.randn(tokens, cols, device="cuda", generator=g).to(torch.bfloat16)
            err = rel_err(lin(x), F.linear(x.float(), ref.float()))
            dt = cuda_seconds(lambda: lin(x), reps=20)
            row = {"name": name, "type": qtype.name, "rows": rows, "cols": cols, "tokens": tokens, "us": dt * 1e6,
                   "read_gb_s": nbytes / dt / GB, "of_copy_traffic": nbytes / dt / copy_traffic,
                   "of_copied": 2 * nbytes / dt / copy_traffic, "rel_err": err}
            if tokens == 512:
                row["tflop_s"] = 2 * tokens * rows * cols / dt / 1e12
                dense = cuda_seconds(lambda: F.linear(x, ref), reps=20)
                row["dense_matmul_us"] = dense * 1e6
            out["rows"].append(row)
            extra = (f", {row['tflop_s']:.0f} TFLOP/s (bf16 matmul alone {row['dense_matmul_us']:.0f} us)"
                     if tokens == 512 else f", read {row['read_gb_s']:6.0f} GB/s = {row['of_copy_traffic']:.0%} of copy "
                     f"traffic ({row['of_copied']:.0%} of copied)")
            r.say(f"{name:12} {qtype.name:7} {rows}x{cols} T={tokens:<3}: {row['us']:8.1f} us{extra}, rel err {err:.1e}")
        if name == "o_proj" and qtype == Q.Q4_K:
            x = torch.randn(1, cols, device="cuda", generator=g).to(torch.bfloat16)
            default = stored_linear.GEMV_BLOCKS["cuda"]
            try:
                for blocks in ((4, 256), (8, 128), (8, 256), (16, 64), (16, 128), (32, 64), (2, 512)):
                    stored_linear.GEMV_BLOCKS["cuda"] = blocks
                    dt = cuda_seconds(lambda: lin(x), reps=20)
                    out["sweep"].append({"blocks": blocks, "us": dt * 1e6, "of_copy_traffic": nbytes / dt / copy_traffic})
                    r.say(f"  o_proj Q4_K T=1 blocks {blocks}: {dt * 1e6:7.1f} us ({nbytes / dt / copy_traffic:.0%})")
            finally:
                stored_linear.GEMV_BLOCKS["cuda"] = default
        del lin, ref
        torch.cuda.empty_cache()
    out["kv_b"], out["kv_b_sweep"] = stored_kv_b(r, copy_traffic)
    big = [row for row in out["rows"] if row["tokens"] == 1 and row["name"] in ("o_proj", "lm_head")
           and row["type"] in ("Q4_K", "Q6_K")]
    out["target_70"] = bool(big) and all(row["of_copy_traffic"] >= 0.7 for row in big)
    out["ok"] = all(row["rel_err"] < 2e-2 for row in out["rows"] + out["kv_b"])
    r.say(f"target (o_proj Q4_K and head Q6_K at >= 70 % of the copy traffic, one token): "
          f"{'met' if out['target_70'] else 'NOT met'}; errors {'ok' if out['ok'] else 'TOO LARGE'}")
    return out


def stored_kv_b(r: Report, copy_traffic: float, device: str = "cuda") -> tuple[list[dict], list[dict]]:
    """MLA's kv_b at DeepSeek-V3's width (128 heads, nope 128, v 128, kv_lora 512) held as a GGUF
    stores it (``engine.stored_latent``): split as Q4_K_M (attn_k_b Q5_0, attn_v_b Q4_K) and Q8_0
    write it, and whole in Q4_K (an older file's attn_kv_b). Each of the absorbed form's per-head
    products, W_UK folded into the queries ("query") and W_UV after attention ("values"), at 1
    and 4 decode rows: time, its stored bytes read per second against the copy traffic, the
    error against the product over the dequantized maps in float32, and the bf16 matmul over the
    widened maps that the engine ran before (``widened_us``); block sizes tried at one row.
    On the CPU (Triton's interpreter) two heads and no block sizes: a check of this code."""
    from gguf import GGMLQuantizationType as Q

    from hybridmoe.backend.engine import stored_latent, stored_linear

    h, nope, v, c = (128 if device == "cuda" else 2), 128, 128, 512
    rows, sweep = [], []
    g = torch.Generator(device=device).manual_seed(1)
    forms = (("split Q4_K_M", (Q.Q5_0, Q.Q4_K)), ("split Q8_0", (Q.Q8_0, Q.Q8_0)), ("whole Q4_K", (Q.Q4_K,)))
    for form, types in forms:
        if r.left() < 15:
            r.say(f"kv_b {form}: skipped, time budget spent")
            continue
        if len(types) == 2:
            k_b = stored_linear.StoredLinear(stored_matrix(types[0], h * c, nope, 1, device))
            v_b = stored_linear.StoredLinear(stored_matrix(types[1], h * v, c, 2, device))
            maps = stored_latent.StoredLatent(h, nope, v, c, k_b=k_b, v_b=v_b)
            nbytes = {"query": k_b.data.numel(), "values": v_b.data.numel()}
        else:
            whole = stored_linear.StoredLinear(stored_matrix(types[0], h * (nope + v), c, 3, device))
            maps = stored_latent.StoredLatent(h, nope, v, c, whole=whole)
            nbytes = {"query": h * nope * whole.row_bytes, "values": h * v * whole.row_bytes}
        ref = maps.dense(torch.float32).view(h, nope + v, c)  # the torch decoders' values
        widened = ref.to(torch.bfloat16)
        products = {"query": (maps.query, ref[:, :nope], widened[:, :nope], nope),
                    "values": (maps.values, ref[:, nope:].transpose(1, 2), widened[:, nope:].transpose(1, 2), c)}
        for product, (fn, w_ref, w_bf16, width) in products.items():
            for tokens in (1, 4):
                x = torch.randn(h, tokens, width, device=device, generator=g).to(torch.bfloat16)
                err = rel_err(fn(x), torch.matmul(x.float(), w_ref))
                dt = cuda_seconds(lambda: fn(x), reps=20)
                dense = cuda_seconds(lambda: torch.matmul(x, w_bf16), reps=20)
                row = {"name": f"kv_b {product}", "form": form, "tokens": tokens, "us": dt * 1e6,
                       "read_gb_s": nbytes[product] / dt / GB, "of_copy_traffic": nbytes[product] / dt / copy_traffic,
                       "widened_us": dense * 1e6, "rel_err": err}
                rows.append(row)
                r.say(f"kv_b {product:6} {form:12} T={tokens}: {row['us']:7.1f} us, read {row['read_gb_s']:5.0f} "
                      f"GB/s = {row['of_copy_traffic']:.0%} of copy traffic; bf16 matmul over the widened maps "
                      f"{row['widened_us']:6.1f} us; rel err {err:.1e}")
            if form != "split Q8_0" and device == "cuda":  # block sizes at one row
                transposed = (form, product) == ("whole Q4_K", "query")  # whole kv_b's W_UK: x^T W
                table = stored_latent.GEMV_T_BLOCKS if transposed else stored_latent.GEMV_BLOCKS
                default = table["cuda"]
                x = torch.randn(h, 1, width, device=device, generator=g).to(torch.bfloat16)
                try:
                    for blocks in ((4, 128), (8, 128), (16, 128), (8, 256), (16, 64), (32, 64), (32, 128)):
                        table["cuda"] = blocks
                        dt = cuda_seconds(lambda: fn(x), reps=20)
                        sweep.append({"form": form, "product": product, "blocks": blocks, "us": dt * 1e6,
                                      "of_copy_traffic": nbytes[product] / dt / copy_traffic})
                        r.say(f"  kv_b {product} {form} T=1 blocks {blocks}: {dt * 1e6:7.1f} us "
                              f"({nbytes[product] / dt / copy_traffic:.0%})")
                finally:
                    table["cuda"] = default
        del maps, ref, widened
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, sweep


# ---- 9. stored experts ------------------------------------------------------------------


def stored_experts_section(r: Report) -> dict:
    """One MoE layer's GPU routed experts held as a GGUF stores them (``engine.stored_experts``,
    issue 46), at DeepSeek-V3's shape (hidden 7168, 2048; 16 held, 8 a token) in Q4_K_M's two
    layer kinds (Q4_K gate/up with a Q6_K or a Q4_K down), IQ4_XS, IQ2_XXS/IQ3_XXS (a community
    mix) and Q4_0, the last beside the same experts as 4-bit codes (``decode_experts`` int4): the
    decode kernels at 1 and 4 tokens, error against the dequantized experts, the distinct experts'
    bytes read per second against the card's copy traffic (target: Q4_K_M at >= 70 % at one
    token); block sizes tried on Q4_K_M; one expert's 128-token prompt call (dequantized tiles
    into matmuls) against a matmul over its widened matrices.

    Without CUDA, with TRITON_INTERPRET=1 set, it runs on the CPU at a small shape in Triton's
    interpreter: a check of this code, its figures not the card's."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if not cuda() and not interpreted:
        raise Skip("no CUDA device (TRITON_INTERPRET=1 runs it on the CPU at a small shape)")
    import torch.nn.functional as F
    from gguf import GGMLQuantizationType as Q

    from hybridmoe.backend.engine import decode_experts, stored_experts
    from hybridmoe.backend.formats import int4_weights, quant

    device = "cuda" if cuda() else "cpu"
    hidden, inter, n, k = (7168, 2048, 16, 8) if device == "cuda" else (512, 256, 4, 2)
    copy_traffic = device_copy_traffic(r, device, (1 << 30) if device == "cuda" else (64 << 20))
    g = torch.Generator(device=device).manual_seed(0)

    def stack(qtype, rows, cols, seed):
        m = stored_matrix(qtype, n * rows, cols, seed, device)
        return stored_experts.StoredStack(qtype, m.parts["data"].reshape(n, rows, -1), cols)

    def dequantized(st, e):
        return quant.from_gguf(st.w[e], st.qtype, (st.rows, st.cols)).dequantize()

    def int4_twin(gate, up, down):
        """The same Q4_0 experts as decode_experts' 4-bit codes (gate and up fused)."""
        def of(blocks, rows, cols):
            ws = [int4_weights.from_quant(quant.from_gguf(blocks[e], Q.Q4_0, (rows, cols))) for e in range(n)]
            return decode_experts.Stack("int4", torch.stack([w.codes for w in ws]), torch.stack([w.scale for w in ws]),
                                        None, ws[0].table_tensor(), ws[0].table, ws[0].group)
        return (of(torch.cat((gate.w, up.w), dim=1), 2 * inter, hidden), of(down.w, hidden, inter))

    out = {"copy_traffic_gb_s": copy_traffic / GB, "device": device, "rows": [], "sweep": [], "prompt": []}
    slot_of = torch.arange(n, dtype=torch.int32, device=device)
    cases = [("Q4_K_M (Q6_K down)", Q.Q4_K, Q.Q6_K), ("Q4_K_M (Q4_K down)", Q.Q4_K, Q.Q4_K),
             ("IQ4_XS", Q.IQ4_XS, Q.IQ4_XS), ("IQ2_XXS + IQ3_XXS down", Q.IQ2_XXS, Q.IQ3_XXS), ("Q4_0", Q.Q4_0, Q.Q4_0)]
    sweep = [{"gate_up": (4, 256), "down": (8, 256)}, {"gate_up": (8, 128), "down": (16, 128)},
             {"gate_up": (8, 512), "down": (16, 512)}, {"gate_up": (16, 256), "down": (32, 256)},
             {"gate_up": (2, 512), "down": (4, 512)}]
    for label, gu_type, down_type in cases:
        if r.left() < 30:
            r.say(f"{label}: skipped, time budget spent")
            continue
        gate, up = stack(gu_type, inter, hidden, 1), stack(gu_type, inter, hidden, 2)
        down = stack(down_type, hidden, inter, 3)
        per_expert = sum(st.w[0].numel() for st in (gate, up, down))
        twin = int4_twin(gate, up, down) if gu_type == Q.Q4_0 else None
        for tokens in (1, 4):
            x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(n, device=device, generator=g)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k, device=device, generator=g)

            def call(blocks=None, x=x, ids=ids, weights=weights):
                return stored_experts.forward(x, ids, weights, slot_of, gate, up, down, "silu", blocks=blocks)

            got = call()
            want = torch.zeros(tokens, hidden, device=device)
            for t in range(tokens):
                for j, e in enumerate(ids[t].tolist()):
                    # Rounded to bf16 where experts.expert_mlp rounds (and the kernels do).
                    def lin(v, st, e=e):
                        return F.linear(v.float(), dequantized(st, e)).to(torch.bfloat16)

                    want[t] += weights[t, j] * lin(F.silu(lin(x[t], gate)) * lin(x[t], up), down).float()
            dt = cuda_seconds(call, reps=20 if device == "cuda" else 1)
            distinct = len(set(ids.flatten().tolist()))
            row = {"case": label, "tokens": tokens, "us": dt * 1e6, "read_gb_s": distinct * per_expert / dt / GB,
                   "of_copy_traffic": distinct * per_expert / dt / copy_traffic, "rel_err": rel_err(got, want),
                   "mb_per_expert": per_expert / 1e6}
            if twin is not None:
                int4_dt = cuda_seconds(lambda: decode_experts.forward(x, ids, weights, slot_of, *twin, "silu"),
                                       reps=20 if device == "cuda" else 1)
                row["int4_us"] = int4_dt * 1e6
            out["rows"].append(row)
            r.say(f"{label:24} T={tokens}: {row['us']:8.1f} us, read {row['read_gb_s']:6.0f} GB/s = "
                  f"{row['of_copy_traffic']:.0%} of copy traffic over {distinct} experts' {per_expert / 1e6:.2f} MB, "
                  f"rel err {row['rel_err']:.1e}" + (f"; as int4 codes {row['int4_us']:.1f} us" if twin else ""))
            if tokens == 1 and label.startswith("Q4_K_M (Q6") and device == "cuda":
                for blocks in sweep:
                    bt = cuda_seconds(lambda blocks=blocks: call(blocks), reps=20)
                    out["sweep"].append({"blocks": blocks, "us": bt * 1e6,
                                         "of_copy_traffic": distinct * per_expert / bt / copy_traffic})
                    r.say(f"  blocks {blocks}: {bt * 1e6:7.1f} us ({distinct * per_expert / bt / copy_traffic:.0%})")
        if label.startswith("Q4_K_M (Q6"):
            # A prompt's call: the tokens routed to one expert, through its stored matrices.
            tokens = 128 if device == "cuda" else 16
            x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
            mats = [st.matrix(0) for st in (gate, up, down)]
            widened = [m.dequantize(torch.bfloat16) for m in mats]

            def mlp(ws):
                lin = (lambda v, w: w(v)) if ws is mats else F.linear
                return lin(F.silu(lin(x, ws[0])) * lin(x, ws[1]), ws[2])

            err = rel_err(mlp(mats), mlp(widened))
            st_dt = cuda_seconds(lambda: mlp(mats), reps=10 if device == "cuda" else 1)
            dense_dt = cuda_seconds(lambda: mlp(widened), reps=10 if device == "cuda" else 1)
            flop = 2 * tokens * 3 * hidden * inter
            out["prompt"].append({"case": label, "tokens": tokens, "us": st_dt * 1e6, "dense_us": dense_dt * 1e6,
                                  "tflop_s": flop / st_dt / 1e12, "rel_err": err})
            r.say(f"{label:24} one expert, {tokens}-token prompt call: {st_dt * 1e6:.0f} us "
                  f"({flop / st_dt / 1e12:.1f} TFLOP/s; its widened matrices {dense_dt * 1e6:.0f} us), rel err {err:.1e}")
        del gate, up, down, twin
        if device == "cuda":
            torch.cuda.empty_cache()
    target = [row for row in out["rows"] if row["tokens"] == 1 and row["case"].startswith("Q4_K_M")]
    out["target_70"] = bool(target) and all(row["of_copy_traffic"] >= 0.7 for row in target)
    out["ok"] = all(row["rel_err"] < 2e-2 for row in out["rows"] + out["prompt"])
    r.say(f"target (Q4_K_M experts at >= 70 % of the copy traffic, one token): {'met' if out['target_70'] else 'NOT met'}"
          f"{' (interpreter: not the card)' if device == 'cpu' else ''}; errors {'ok' if out['ok'] else 'TOO LARGE'}")
    return out


# ---- main -------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="where to write the results (default $OUT/gpu_check.json or ./gpu_check.json)")
    p.add_argument("--layers", type=int, default=8, help="layers of the mid-size model")
    p.add_argument("--experts", type=int, default=64, help="routed experts per layer of the mid-size model")
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens for the prefill figures")
    p.add_argument("--budget", type=float, default=280, help="seconds for the whole run (sections skip when spent)")
    p.add_argument("--cpu-speed", action="store_true", help="run a small speed section on a machine without CUDA")
    p.add_argument("--sections", help="comma-separated section names to run (default: all), e.g. 'stored projections'")
    args = p.parse_args(argv)
    report = Report(time.monotonic() + args.budget)
    work = Path(tempfile.mkdtemp(prefix="hybridmoe-gpu-check-"))
    sections = [("environment", environment), ("parity", parity, work), ("bandwidth", bandwidth),
                ("speed", speed, work, args), ("flagship", flagship, work), ("decode kernels", decode_kernels),
                ("launch cost", launch_cost), ("stored projections", stored_projections),
                ("stored experts", stored_experts_section)]
    wanted = None if not args.sections else {name.strip() for name in args.sections.split(",")}
    unknown = (wanted or set()) - {name for name, *_ in sections}
    if unknown:
        p.error(f"unknown section(s) {', '.join(sorted(unknown))}; the sections: "
                + ", ".join(name for name, *_ in sections))
    try:
        for name, fn, *rest in sections:
            if wanted is None or name in wanted or name == "environment":
                report.run(name, fn, *rest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary(report)
    default_dir = os.environ.get("OUT") or "."
    out = Path(args.json or Path(default_dir) / "gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.data, indent=1, default=str))
    print(f"\nresults written to {out}")
    statuses = [s["status"] for s in report.data["sections"].values()]
    parity_failures = report.data["sections"].get("parity", {}).get("failures", 0)
    return 1 if "failed" in statuses or parity_failures else 0


def summary(r: Report) -> None:
    r.say("\n== summary ==")
    for name, s in r.data["sections"].items():
        r.say(f"{name:12} {s['status']}" + (f": {s.get('reason') or s.get('error')}" if s["status"] != "ok" else ""))
    rows = r.data["sections"].get("speed", {}).get("rows")
    if rows:
        r.say(f"\n{'configuration':36} {'decode tok/s':>12} {'prefill tok/s':>14} {'CPU experts ms/tok':>19}")
        for label, row in rows.items():
            pre = row.get("prefill_tok_s")
            r.say(f"{label:36} {row['decode_tok_s']:12.1f} {'' if pre is None else f'{pre:14.1f}':>14} "
                  f"{row['cpu_experts_ms_per_token']:19.2f}")
        r.say("prefill: hybrid rows stream the CPU experts to the GPU, except 'CPU-expert prefill'; "
              "CPU experts ms/tok: time in the CPU half per decoded token")


if __name__ == "__main__":
    sys.exit(main())
