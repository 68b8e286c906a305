"""The engine's hybrid layout against llama.cpp's with the same routed experts on the GPU (issue 46).

``hybridmoe bench generate FILE --plan PLAN`` (or ``python -m hybridmoe.backend.bench.gpu_side_by_side``):
the engine runs the plan's layout (its GPU experts, how it holds them, its pipeline); llama.cpp
runs the same GGUF with every layer offloaded (``n_gpu_layers`` all) and the routed experts of the
layers the plan keeps on the host overridden to the CPU (``tensor_buft_overrides``, llama.cpp's
``-ot PATTERN=CPU``), so that both hold the same experts on the card.

llama.cpp keeps a layer's routed experts in one tensor per projection, so it can only hold whole
layers' experts; a plan holding part of a layer's experts on the GPU (the planner's own uniform
layout) has no exact llama.cpp equivalent. ``--gpu-share F`` replaces the plan's GPU experts by
whole layers (F of the MoE layers, the last ones first, as llama.cpp's `--n-cpu-moe` counts), and
the default ``--llamacpp-layout same`` refuses a partial layer; ``count`` gives llama.cpp as many
whole layers as the plan's GPU experts fill instead (the engine then keeps its own layout).

Each backend lives in a worker process of its own (two CUDA runtimes, PyTorch's and the one
llama.cpp was built against, never share a process; each has its own threads and peak memory),
loaded once and driven over a pipe. The measurements take turns: for every pair, each backend
runs the same measurement right after the other (which goes first alternates), and the figure is
the median of the per-pair ratios, steady on a machine whose speed drifts. Measured: decode at
64 and 4096 positions (a pass of ``decode_tokens`` greedy tokens after a prompt of that length),
prefill of 512 and 4096 tokens (from an empty cache). The host's read bandwidth is probed before
every pair and the card's host-to-device copy rate (pinned) at the start and the end, in the
same run, by the parent process while both workers wait.

Without CUDA (here) it still runs: the engine builds the plan's GPU side on the CPU (a stand-in)
and llama.cpp is a CPU build whose overrides still put exactly the planned tensors on the CPU; the
figures then test the plumbing, not the issue's targets. With CUDA, a llama.cpp without a GPU
device is refused (scripts/gpu_bench.sh builds one and points ``LLAMA_CPP_LIB_PATH`` at it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridmoe.backend.errors import HybridMoeError, UsageError
from hybridmoe.backend.files import write_atomic
from hybridmoe.backend.workload_choices import GPU_EXPERT_FORMS

DECODE_AT = (64, 4096)
PREFILL = (512, 4096)
# The targets, engine / llama.cpp with half the experts on the GPU.
TARGETS = {"decode@64": 1.3, "decode@4096": 1.3, "prefill 4096": 2.0}
_REPLAN = "Make a plan for this file: `hybridmoe plan FILE --backend engine --save PLAN.json`."


# ---- the plan in llama.cpp's terms ---------------------------------------------------------


@dataclass(frozen=True)
class LlamaLayout:
    """Where llama.cpp holds each MoE layer's routed experts, and the overrides that say so."""

    gpu_layers: tuple[int, ...]
    cpu_layers: tuple[int, ...]
    override_tensor: tuple[str, ...]  # "-ot" entries, PATTERN=CPU
    exact: bool  # the engine holds exactly these experts on the GPU
    engine_gpu_experts: int
    llamacpp_gpu_experts: int

    def settings(self, block_count: int, context: int, threads: int, gpu: bool) -> dict[str, Any]:
        """A plan's ``llama_cpp`` settings (backend/llamacpp/params.py reads them) for this layout:
        every block and the output layer offloaded, the CPU layers' experts overridden."""
        return {"n_gpu_layers": block_count + 1, "n_cpu_moe": 0, "override_tensor": list(self.override_tensor),
                "n_ctx": context, "n_parallel": 1, "n_threads": threads, "n_batch": 2048,
                # A micro-batch of 2048 lets llama.cpp copy host experts to the GPU for prompts
                # ("op offload"), as the planner's llama.cpp settings do.
                "n_ubatch": 2048 if gpu else 512, "flash_attn": True, "cache_type_k": "f16", "cache_type_v": "f16",
                # With a GPU, llama.cpp asks for --no-mmap when experts are overridden to the CPU
                # (they then sit in host buffers it copies from faster during op offload).
                "use_mmap": not gpu}

    def command(self, block_count: int, gpu: bool = True) -> str:
        """The same placement and settings as llama-server options, for the report."""
        ot = "".join(f" -ot '{o}'" for o in self.override_tensor)
        return f"-ngl {block_count + 1}{ot} -fa on -b 2048 " + ("-ub 2048 --no-mmap" if gpu else "-ub 512")


def llamacpp_layout(gpu_experts: Mapping[int, Sequence[int]], moe_layers: Sequence[int], n_experts: int,
                    match: str = "same") -> LlamaLayout:
    """The llama.cpp placement of a plan's GPU experts (MoE layer -> expert ids on the GPU).

    ``match="same"``: a layer with all its experts on the GPU stays there, one with none goes to
    the CPU; a layer with some of them cannot be expressed (llama.cpp moves a layer's experts
    together) and is refused. ``match="count"``: as many whole layers on the GPU as the plan's
    GPU experts fill (rounded to the nearest layer), the last layers first, whatever the plan's
    layout."""
    from hybridmoe.backend.plan.llamacpp import expert_override_pattern

    layers = sorted(moe_layers)
    held = {layer: len(set(gpu_experts.get(layer, ()))) for layer in layers}
    unknown = sorted(set(gpu_experts) - set(layers))
    if unknown:
        raise UsageError(f"the plan places GPU experts in layers {unknown}, which have no routed experts here", _REPLAN)
    total = sum(held.values())
    if match == "same":
        partial = [layer for layer in layers if 0 < held[layer] < n_experts]
        if partial:
            first = partial[0]
            raise UsageError(
                f"the plan holds {held[first]} of layer {first}'s {n_experts} routed experts on the GPU "
                f"({len(partial)} layers in part): llama.cpp keeps a layer's experts in one tensor per projection "
                "and cannot split them",
                "Pass --gpu-share F to hold whole layers on both backends, or --llamacpp-layout count to give "
                "llama.cpp as many whole layers as the plan's GPU experts fill.")
        gpu = [layer for layer in layers if held[layer] == n_experts]
    elif match == "count":
        count = min(len(layers), round(total / n_experts)) if n_experts else 0
        gpu = layers[len(layers) - count:]
    else:
        raise UsageError(f"unknown llama.cpp layout {match!r}", "Choose same or count.")
    cpu = [layer for layer in layers if layer not in gpu]
    exact = all(held[layer] == (n_experts if layer in gpu else 0) for layer in layers)
    return LlamaLayout(tuple(gpu), tuple(cpu), (expert_override_pattern(cpu),) if cpu else (), exact, total,
                       len(gpu) * n_experts)


def whole_layers(moe_layers: Sequence[int], n_experts: int, share: float) -> dict[int, tuple[int, ...]]:
    """GPU experts for ``share`` of the routed experts in whole layers: the last
    round(share x layers) MoE layers entirely, the others none (llama.cpp's `--n-cpu-moe`
    keeps the first layers on the host, so both backends can hold exactly these)."""
    if not 0 <= share <= 1:
        raise UsageError(f"--gpu-share must be between 0 and 1, got {share}")
    layers = sorted(moe_layers)
    count = round(share * len(layers))
    return {layer: tuple(range(n_experts)) if i >= len(layers) - count else () for i, layer in enumerate(layers)}


def cpu_expert_tensors(tensor_names: Sequence[str], layout: LlamaLayout) -> set[str]:
    """The tensors llama.cpp must report overridden to the CPU: the routed-expert tensors of the
    layout's CPU layers, found by the same expression as the overrides."""
    from hybridmoe.backend.plan.llamacpp import EXPERT_TENSORS

    pattern = re.compile(rf"^blk\.(\d+)\.{EXPERT_TENSORS}\.")
    cpu = set(layout.cpu_layers)
    return {name for name in tensor_names if (m := pattern.match(name)) and int(m.group(1)) in cpu}


def with_gpu_experts(plan, gpu_experts: Mapping[int, Sequence[int]]):
    """``plan`` with these GPU experts (whole layers from --gpu-share) and its routed-expert
    byte counts to match; the rest of the plan (devices, pipeline, how GPU experts are held)
    as it was."""
    gpu_experts = {layer: tuple(ids) for layer, ids in gpu_experts.items() if ids}
    on_gpu = sum(len(ids) * plan.bytes_per_expert[layer] for layer, ids in gpu_experts.items())
    devices = plan.devices
    if plan.parallel == "tp":  # each card a share of every layer: deal the new experts anew
        from hybridmoe.backend.plan.placement import deal

        cards = [d for d in devices if d.kind == "gpu"]
        dealt = iter(deal(gpu_experts, [max(d.free_bytes, 1) for d in cards], plan.gpu_bytes_per_expert or plan.bytes_per_expert))
        devices = tuple(dataclasses.replace(d, experts=next(dealt)) if d.kind == "gpu" else d for d in devices)
    return dataclasses.replace(plan, gpu_experts=gpu_experts, devices=devices, gpu_routed_expert_bytes=int(on_gpu),
                               host_routed_expert_bytes=int(plan.routed_expert_bytes_total - on_gpu))


def check_plan_for_file(plan, model: str, context: int) -> None:
    """The plan must be made for this file's model, with room for the longest measurement."""
    from hybridmoe.backend.models import inspect_model

    spec = inspect_model(model).spec
    if tuple(plan.moe_layers) != tuple(spec.moe_layers) or plan.n_routed_experts != spec.n_routed_experts:
        raise UsageError(
            f"the plan was made for {plan.model} (MoE layers {_span(plan.moe_layers)}, {plan.n_routed_experts} experts), "
            f"but {Path(model).name} has MoE layers {_span(spec.moe_layers)} and {spec.n_routed_experts} experts", _REPLAN)
    if plan.workload.context < context:
        raise UsageError(f"the plan's context ({plan.workload.context} tokens) is shorter than the longest measurement "
                         f"({context} tokens)", "Make the plan with --context 8192 or more.")


def plan_here(model: str, context: int, gpu_expert_form: str = "auto"):
    """A plan for ``model`` on this machine for the engine (what `hybridmoe plan FILE --backend
    engine` makes), with room for ``context`` tokens."""
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    inspected = inspect_model(model)
    # Room for the measurements and for some more (a plan is sized for a context); never more
    # than the model's own maximum, which the planner refuses.
    context = max(context, min(8192, inspected.spec.max_context))
    return make(inspected.spec, inspected.inventory, detect(measure_bandwidth=False),
                Workload(context=context, backend="engine", gpu_expert_form=gpu_expert_form))


def _span(layers: Sequence[int]) -> str:
    layers = list(layers)
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers)) or "none"


# ---- workers -------------------------------------------------------------------------------


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    # Avoid the low ids, where special and control tokens live (as bench generate does).
    return [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(n)]


class _EngineWorker:
    def __init__(self, model: str, plan, threads: int):
        import torch

        from hybridmoe.backend.engine.session import EngineBackend

        torch.set_num_threads(threads)
        os.environ.setdefault("HYBRIDMOE_CPU_THREADS", str(threads))
        self.cuda = torch.cuda.is_available()
        # Without CUDA the plan's GPU side is built on the CPU, standing in for the card.
        self.net = EngineBackend().load(model, plan, device=None if self.cuda else "cpu").model
        self.seq, self.chunk = self.net.sequence, plan.workload.prefill_chunk
        self.vocab = self.net.config.require("vocab_size")
        self.info = {"device": "cuda" if self.cuda else "cpu (standing in for the GPU)",
                     "gpu_experts": plan.gpu_expert_count, "gpu_expert_format": plan.gpu_expert_format}

    def eval(self, ids: Sequence[int], start: int) -> int:
        """Run ``ids`` from position ``start``: the greedy next token (its read waits for the device)."""
        logits = None
        for pos in range(0, len(ids), self.chunk):
            (logits,) = self.net.forward_batch([(self.seq, list(ids[pos : pos + self.chunk]), start + pos)],
                                               prompt=len(ids) > 1)
        return int(logits.argmax())

    def step(self, token: int, pos: int) -> int:
        (logits,) = self.net.forward_batch([(self.seq, [token], pos)])
        return int(logits.argmax())


class _LlamaWorker:
    def __init__(self, model: str, plan, threads: int, layout: LlamaLayout, context: int):
        from importlib.metadata import version

        from hybridmoe.backend.llamacpp import log
        from hybridmoe.backend.llamacpp.header import read_header
        from hybridmoe.backend.llamacpp.library import ggml, llama
        from hybridmoe.backend.llamacpp.model import RawModel
        from hybridmoe.backend.llamacpp.params import build
        from hybridmoe.backend.llamacpp.placement import OverrideArray, overrides_from_plan

        b = llama()
        header = read_header(model)
        devices = ggml().devices()
        gpus = [d for d in devices if d["type"] in ("GPU", "IGPU")]
        settings = layout.settings(header.block_count, context, threads, gpu=bool(gpus))
        buffer_types = ggml().buffer_types()
        overrides = OverrideArray(overrides_from_plan(settings, header, buffer_types), buffer_types)
        params = build(b, dataclasses.replace(plan, llama_cpp=settings), overrides, None)
        with log.capture() as captured:
            self.llm = RawModel(header.path, params=params)
        self.vocab = self.llm.n_vocab()
        placed = captured.overridden_tensors()
        want = cpu_expert_tensors(header.tensor_names, layout)
        layers = captured.layer_devices()
        off_gpu = sorted(i for i in range(header.block_count) if gpus and layers.get(i, "CPU").upper().startswith("CPU"))
        buffers = buffer_sizes(captured.lines)
        on_card = sum(v for k, v in buffers.items() if not _is_host(k))
        self.info = {"version": version("llama-cpp-python"), "library": _library_path(),
                     "devices": [f"{d['name']} ({d['description']})" for d in gpus] or ["CPU only"],
                     "settings": settings, "command": layout.command(header.block_count, gpu=bool(gpus)),
                     "cpu_tensors": len(placed), "cpu_tensors_expected": len(want),
                     "buffers_mib": buffers,
                     # What the card's model buffers should hold: every tensor but the CPU layers'
                     # experts and the token embedding (llama.cpp keeps its input layer on the host).
                     "gpu_buffer_expected_mib": gpu_bytes(header.path, want) / 2**20 if gpus else 0.0,
                     "gpu_buffer_mib": on_card,
                     # Exactly the planned tensors moved, and with a GPU every block on it.
                     # (With a GPU llama.cpp may put them in its pinned host buffers, "CUDA_Host".)
                     "placement_ok": set(placed) == want and all(_is_host(v) for v in placed.values()) and not off_gpu}
        if not self.info["placement_ok"]:
            wrong = sorted(set(placed) ^ want)[:4]
            raise RuntimeError(f"llama.cpp did not place the tensors as asked: {len(placed)} overridden to the CPU "
                               f"(expected {len(want)}; differing: {wrong}), blocks off the GPU: {off_gpu}")

    def eval(self, ids: Sequence[int], start: int) -> int:
        self.llm.rewind(start)
        return int(self.llm.eval(list(ids))[-1].argmax())

    def step(self, token: int, pos: int) -> int:
        self.llm.rewind(pos)
        return int(self.llm.eval([token])[-1].argmax())


_BUFFER = re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB")


def buffer_sizes(lines) -> dict[str, float]:
    """llama.cpp's "<buffer type> model buffer size = N MiB" lines of a load, summed by type."""
    out: dict[str, float] = {}
    for line in lines:
        m = _BUFFER.search(line.text)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def gpu_bytes(path: Path, host_tensors: set[str]) -> int:
    """Bytes of the file's tensors llama.cpp should hold on the GPU with every layer offloaded:
    all but ``host_tensors`` and the token embedding."""
    from hybridmoe.backend.models.gguf_reader import open_gguf_set

    files = open_gguf_set(path, allow_unknown_types=True)
    try:
        return sum(t.nbytes or 0 for g in files for t in g.tensors
                   if t.name not in host_tensors and t.name != "token_embd.weight")
    finally:
        for g in files:
            g.close()


def _is_host(buffer_type: str) -> bool:
    # "CPU", "CPU_Mapped", "CPU_REPACK", "CUDA_Host" (pinned host memory) all live in host RAM.
    return buffer_type.upper().startswith("CPU") or buffer_type.endswith("_Host")


def _library_path() -> str:
    """Where llama-cpp-python loaded libllama from (LLAMA_CPP_LIB_PATH, or its own lib/)."""
    import llama_cpp.llama_cpp as bindings

    return str(bindings._base_path)


class Worker:
    """One backend loaded in this process, answering measurements (``serve``)."""

    def __init__(self, backend: str, model: str, plan, threads: int, layout: LlamaLayout, context: int):
        started = time.perf_counter()
        self.impl = (_EngineWorker(model, plan, threads) if backend == "engine"
                     else _LlamaWorker(model, plan, threads, layout, context))
        self.load_s = time.perf_counter() - started
        self.prompt = prompt_ids(self.impl.vocab, context)
        self.prefix = 0  # leading positions of the cache that hold the prompt

    def prefill(self, n: int) -> dict:
        t0 = time.perf_counter()
        self.impl.eval(self.prompt[:n], 0)
        seconds = time.perf_counter() - t0
        self.prefix = n
        return {"seconds": seconds, "rate": n / seconds}

    def decode(self, at: int, tokens: int) -> dict:
        """``tokens`` greedy tokens after the first ``at`` prompt tokens (prefilled untimed when
        the cache does not hold them); the first one fed is the prompt's next token."""
        if self.prefix < at:
            self.impl.eval(self.prompt[self.prefix : at], self.prefix)
        self.prefix = at
        tok, out = self.prompt[at], []
        t0 = time.perf_counter()
        for i in range(tokens):
            tok = self.impl.step(tok, at + i)
            out.append(tok)
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "rate": tokens / seconds, "tokens": out}


def serve(backend: str, model: str, plan_path: str, threads: int, match: str, context: int) -> int:
    """A worker's main loop: JSON requests on stdin, one JSON answer a line on the protocol fd.
    Native code may print to stdout, so the protocol gets a copy of it and stdout goes to stderr."""
    from hybridmoe.backend.plan.plan import Plan

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        plan = Plan.load(plan_path)
        layout = llamacpp_layout(plan.gpu_experts, plan.moe_layers, plan.n_routed_experts, match)
        worker = Worker(backend, model, plan, threads, layout, context)
    except Exception as err:  # noqa: BLE001 - the parent reports it as this backend's error
        proto.write(json.dumps({"error": f"{type(err).__name__}: {err}"}) + "\n")
        return 1
    proto.write(json.dumps({"ready": True, "load_s": worker.load_s, **worker.impl.info}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "quit":
                break
            answer = worker.prefill(req["tokens"]) if req["op"] == "prefill" else worker.decode(req["at"], req["tokens"])
        except Exception as err:  # noqa: BLE001 - see above
            answer = {"error": f"{type(err).__name__}: {err}"}
        proto.write(json.dumps(answer) + "\n")
    return 0


class _Remote:
    """A worker process seen from the parent. Its stderr goes to a file: a pipe nobody reads
    while it measures would stall a worker that writes more than the pipe holds."""

    def __init__(self, backend: str, model: str, plan_path: Path, threads: int, match: str, context: int,
                 log_dir: Path):
        self.backend = backend
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(log_dir / f"{backend}-worker.log", "w+", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hybridmoe.backend.bench.gpu_side_by_side", model, "--worker", backend,
             "--plan", str(plan_path), "--threads", str(threads), "--llamacpp-layout", match,
             "--context", str(context)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.info = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:  # the worker died: its exception's line from its log
            from hybridmoe.backend.bench.generate import worker_error

            self.proc.wait()
            self.log.seek(0)
            return {"error": worker_error(self.log.read())}
        return json.loads(line)

    def ask(self, **request) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:  # a dead worker's pipe
            pass
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---- probes --------------------------------------------------------------------------------


def host_probe(threads: int) -> float:
    from hybridmoe.backend.hardware.bandwidth import measure_host_read_bandwidth

    return measure_host_read_bandwidth(threads=threads, passes=3)


def copy_probe(size: int = 1 << 28) -> float | None:
    """The card's host-to-device copy rate from pinned memory, bytes/s (best of 4); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True).fill_(1)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    rates = []
    for _ in range(4):
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(size / (time.perf_counter() - t0))
    del host, dev
    torch.cuda.empty_cache()
    return max(rates)


# ---- the run -------------------------------------------------------------------------------


def measure(model: str, plan, *, pairs: int = 8, decode_at: Sequence[int] = DECODE_AT,
            prefill: Sequence[int] = PREFILL, decode_tokens: int = 16, threads: int | None = None,
            match: str = "same", log_dir: str | Path | None = None, budget_s: float | None = None,
            on_pair=None, on_progress=None) -> dict:
    """Both backends on ``model`` with ``plan``'s GPU experts: ``pairs`` rounds of every
    measurement, the backends in turn. Returns every pass's rate, the per-pair ratios, their
    medians and quartiles, the probes, and what each backend reported of its layout. The
    workers' own output (stderr) goes to ``log_dir`` (default: a temporary folder). With
    ``budget_s``, no pair starts that would end after that many seconds from the start (the
    last pair's time taken as the next one's), so a run given a deadline ends with a result;
    ``on_pair`` hears the results so far after each pair."""
    import tempfile

    import psutil
    import torch

    started = time.monotonic()
    threads = threads or psutil.cpu_count(logical=False) or 1
    context = max([*prefill, *(a + decode_tokens + 1 for a in decode_at)])
    check_plan_for_file(plan, model, context)
    layout = llamacpp_layout(plan.gpu_experts, plan.moe_layers, plan.n_routed_experts, match)
    tasks = [(f"prefill {n}", {"op": "prefill", "tokens": n}) for n in prefill]
    tasks += [(f"decode@{a}", {"op": "decode", "at": a, "tokens": decode_tokens}) for a in decode_at]
    # Long prompts first, then the decode at their length reuses the cache they left.
    tasks.sort(key=lambda t: -max(t[1].get("tokens", 0) if t[1]["op"] == "prefill" else t[1]["at"], 0))
    result: dict[str, Any] = {
        "model": model, "plan": {"model": plan.model, "gpu_experts": plan.gpu_expert_count,
                                 "gpu_expert_format": plan.gpu_expert_format,
                                 "routed_experts": plan.n_routed_experts * len(plan.moe_layers),
                                 "gpu_layers": [layer for layer, ids in sorted(plan.gpu_experts.items()) if ids]},
        "layout": dataclasses.asdict(layout), "cuda": torch.cuda.is_available(), "threads": threads,
        "pairs": pairs, "decode_tokens": decode_tokens, "context": context, "measurements": {},
        "host_probe": [], "copy_probe": []}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan.save(plan_path)
        remotes: dict[str, _Remote] = {}
        try:
            for backend in ("engine", "llamacpp"):  # one after the other: loads do not compete
                if on_progress:
                    on_progress(f"loading {backend}")
                remotes[backend] = _Remote(backend, model, plan_path, threads, match, context, Path(log_dir or tmp))
                result[backend] = remotes[backend].info
                if "error" in result[backend]:
                    return summarize(result)
            if result["cuda"] and result["llamacpp"]["devices"] == ["CPU only"]:
                result["llamacpp"]["error"] = (
                    f"the llama.cpp library in {result['llamacpp']['library']} has no GPU device: build it with CUDA "
                    "(scripts/gpu_bench.sh) and set LLAMA_CPP_LIB_PATH to its folder")
                return summarize(result)
            deadline = started + budget_s if budget_s else None
            _alternate(remotes, tasks, result, threads, deadline, on_pair, on_progress)
        finally:
            for remote in remotes.values():
                remote.close()
    return summarize(result)


def _alternate(remotes: dict, tasks: list, result: dict, threads: int, deadline: float | None, on_pair,
               on_progress) -> None:
    """The untimed passes, then ``pairs`` rounds of every task, the backends taking turns; the
    probes around them. Stops at a backend's first error (recorded as that backend's), or
    before a round that would end after ``deadline``."""
    from hybridmoe.backend.text.generation import common_prefix

    result["copy_probe"].append(copy_probe())
    for _, request in tasks:  # one untimed pass each: lazy kernels, allocators, page faults
        for backend, remote in remotes.items():
            answer = remote.ask(**request)
            if "error" in answer:
                result[backend]["error"] = answer["error"]
                return
    pairs = result["pairs"]
    for i in range(pairs):
        round_started = time.monotonic()
        result["host_probe"].append(host_probe(threads))
        for name, request in tasks:
            if on_progress:
                on_progress(f"pair {i + 1} of {pairs}: {name}")
            order = ("engine", "llamacpp") if i % 2 == 0 else ("llamacpp", "engine")
            got = {}
            for backend in order:
                time.sleep(0.02)  # the other's threads spin a while after their last call
                got[backend] = remotes[backend].ask(**request)
                if "error" in got[backend]:
                    result[backend]["error"] = got[backend]["error"]
                    return
            m = result["measurements"].setdefault(name, {"engine": [], "llamacpp": [], "ratios": []})
            m["engine"].append(got["engine"]["rate"])
            m["llamacpp"].append(got["llamacpp"]["rate"])
            m["ratios"].append(got["engine"]["rate"] / got["llamacpp"]["rate"])
            if "tokens" in got["engine"] and "greedy_in_common" not in m:
                # Random weights: the two agree only as long as rounding does not tip a choice.
                m["greedy_in_common"] = common_prefix(got["engine"]["tokens"], got["llamacpp"]["tokens"])
        result["pairs_done"] = i + 1
        if on_pair:
            on_pair(result)
        now = time.monotonic()
        if deadline is not None and i + 1 < pairs and now + (now - round_started) > deadline:
            result["stopped"] = f"time budget: {i + 1} of {pairs} pairs"
            break
    result["host_probe"].append(host_probe(threads))
    result["copy_probe"].append(copy_probe())


def summarize(result: dict) -> dict:
    """Medians of the rates, the per-pair ratios' median and quartiles, and the targets."""
    for name, m in result["measurements"].items():
        ratios = m["ratios"]
        if not ratios:
            continue
        q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        m.update(engine_median=statistics.median(m["engine"]), llamacpp_median=statistics.median(m["llamacpp"]),
                 ratio=median, quartiles=[q1, q3])
        if name in TARGETS:
            m["target"] = TARGETS[name]
            m["meets_target"] = median >= TARGETS[name]
    return result


def table(result: dict) -> str:
    gb = 1e9
    plan, layout = result["plan"], result["layout"]
    engine, llama = result.get("engine", {}), result.get("llamacpp", {})
    same = "the same experts" if layout["exact"] else (
        f"{layout['llamacpp_gpu_experts']} experts in whole layers against the engine's {layout['engine_gpu_experts']}")
    lines = [f"{result['model']}: {plan['gpu_experts']} of {plan['routed_experts']} routed experts on the GPU "
             f"(engine: {plan['gpu_expert_format']}; llama.cpp: MoE layers {_span(layout['gpu_layers'])}, {same})"]
    if not result["cuda"]:
        lines.append("no CUDA: the engine's GPU side runs on the CPU (a stand-in) and llama.cpp is a CPU build; "
                     "the figures test the benchmark, not the issue's targets")
    for name, info in (("engine", engine), ("llama.cpp", llama)):
        if "error" in info:
            lines.append(f"{name}: error: {info['error']}")
    if engine.get("ready"):
        lines.append(f"engine: {engine['device']}, loaded in {engine['load_s']:.1f} s")
    if llama.get("ready"):
        buffers = ", ".join(f"{k} {v:,.0f} MiB" for k, v in llama["buffers_mib"].items())
        lines.append(f"llama.cpp {llama['version']} ({llama['library']}): {', '.join(llama['devices'])}, loaded in "
                     f"{llama['load_s']:.1f} s; {llama['cpu_tensors']} expert tensors on the CPU as asked; "
                     f"buffers: {buffers}")
        if llama["gpu_buffer_expected_mib"]:
            lines.append(f"  llama.cpp's GPU model buffers {llama['gpu_buffer_mib']:,.0f} MiB; the file's tensors outside "
                         f"the CPU layers' experts and the embedding: {llama['gpu_buffer_expected_mib']:,.0f} MiB")
        lines.append(f"  as llama-server options: {llama['command']}")
    probes = result["host_probe"]
    if probes:
        lines.append(f"host read probe {statistics.median(probes) / gb:.1f} GB/s (median of {len(probes)}, "
                     f"{min(probes) / gb:.1f}-{max(probes) / gb:.1f})")
    copies = [c for c in result["copy_probe"] if c]
    if copies:
        lines.append(f"host-to-device copy (pinned) {min(copies) / gb:.1f}-{max(copies) / gb:.1f} GB/s "
                     "(start and end of the run)")
    if result.get("stopped"):
        lines.append(f"stopped early ({result['stopped']})")
    if result["measurements"]:
        lines.append(f"{'tokens/s':14} {'engine':>9} {'llama.cpp':>9} {'ratio':>7} {'quartiles':>11}  target "
                     f"(median of {result.get('pairs_done', 0)} pairs in alternation; decode passes of "
                     f"{result['decode_tokens']} tokens)")
    for name, m in sorted(result["measurements"].items(), key=lambda kv: (kv[0].startswith("prefill"), _n(kv[0]))):
        if "ratio" not in m:
            continue
        target = ""
        if "target" in m:
            target = f">= {m['target']:.1f}x {'met' if m['meets_target'] else 'NOT met'}"
        lines.append(f"{name:14} {m['engine_median']:9.1f} {m['llamacpp_median']:9.1f} {m['ratio']:6.2f}x "
                     f"{m['quartiles'][0]:5.2f}-{m['quartiles'][1]:.2f}  {target}")
    return "\n".join(lines)


def _n(name: str) -> int:
    return int(re.sub(r"\D", "", name) or 0)


# ---- command line --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options this benchmark adds (also to `hybridmoe bench generate`)."""
    p.add_argument("--plan", help="side by side on the GPU: the engine with this plan's layout against llama.cpp with "
                   "the same experts on the GPU (a .toml/.json from `hybridmoe plan FILE --save`)")
    p.add_argument("--gpu-share", type=float, help="with --plan (or a plan made here): hold this share of the routed "
                   "experts on the GPU in whole layers, the last ones first, on both backends")
    p.add_argument("--gpu-experts", choices=GPU_EXPERT_FORMS, default="auto",
                   help="without --plan: how the engine holds its GPU experts in the plan made here (stored: the "
                        "GGUF's blocks, the bytes llama.cpp holds; int4: the 4-bit codes, as many for Q4_0)")
    p.add_argument("--llamacpp-layout", choices=("same", "count"), default="same",
                   help="same: llama.cpp holds exactly the plan's GPU experts (whole layers only); count: as many "
                        "whole layers as the plan's GPU experts fill")
    p.add_argument("--decode-at", type=_ints, default=list(DECODE_AT), help="decode positions (default 64,4096)")
    p.add_argument("--prefill", type=_ints, default=list(PREFILL), help="prompt lengths (default 512,4096)")
    p.add_argument("--out", help="also write the results as JSON to this file")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, got {text!r}")
    return values


def run(model: str, *, plan_path: str | None, gpu_share: float | None, match: str, pairs: int,
        decode_at: Sequence[int], prefill: Sequence[int], decode_tokens: int, threads: int | None,
        gpu_expert_form: str = "auto", out: str | None = None, log_dir: str | None = None,
        budget_s: float | None = None, on_progress=None) -> dict:
    """Load or make the plan, apply --gpu-share, measure; write ``out`` when given (also after
    every pair, so that a run cut short leaves what it measured)."""
    import copy
    from hybridmoe.backend.plan.plan import Plan

    context = max([*prefill, *(a + decode_tokens + 1 for a in decode_at)])
    if plan_path:
        plan = Plan.load(plan_path)
    else:
        plan = plan_here(model, context, gpu_expert_form)
    check_plan_for_file(plan, model, context)
    if gpu_share is not None:
        plan = with_gpu_experts(plan, whole_layers(plan.moe_layers, plan.n_routed_experts, gpu_share))
    def write(result: dict) -> None:
        if out:
            write_atomic(out, json.dumps(result, indent=1))

    result = measure(model, plan, pairs=pairs, decode_at=decode_at, prefill=prefill, decode_tokens=decode_tokens,
                     threads=threads, match=match, log_dir=log_dir, budget_s=budget_s,
                     on_pair=lambda partial: write(summarize(copy.deepcopy(partial))), on_progress=on_progress)
    write(result)
    return result


def failed(result: dict) -> list[str]:
    return [b for b in ("engine", "llamacpp") if "error" in result.get(b, {})]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a .gguf file")
    p.add_argument("--worker", choices=("engine", "llamacpp"), help=argparse.SUPPRESS)
    p.add_argument("--context", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens per decode pass (default 16)")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    p.add_argument("--logs", help="keep the workers' own output (stderr) in this folder")
    p.add_argument("--budget", type=float, help="seconds for the whole run: no pair starts that would end later")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.worker:
        return serve(args.worker, args.model, args.plan, args.threads or 1, args.llamacpp_layout, args.context)
    try:
        result = run(args.model, plan_path=args.plan, gpu_share=args.gpu_share, match=args.llamacpp_layout,
                     pairs=args.pairs, decode_at=args.decode_at, prefill=args.prefill,
                     decode_tokens=args.decode_tokens, threads=args.threads, gpu_expert_form=args.gpu_experts,
                     out=args.out, log_dir=args.logs, budget_s=args.budget,
                     on_progress=lambda m: print(m, file=sys.stderr, flush=True))
    except HybridMoeError as err:  # a plan for another file, a context too long: one message
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 1 if failed(result) else 0


if __name__ == "__main__":
    sys.exit(main())
