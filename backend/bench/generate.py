"""End-to-end prefill and decode speed of the engine and of llama.cpp on the same GGUF.

Each backend runs in a fresh process of its own (`python -m hybridmoe.backend.bench.generate
--worker ...`), so that its peak resident memory and its thread pool are its own; both get
the same prompt token ids, the same thread count and greedy decoding. Each worker runs one
untimed pass first (page faults on the mapped file, lazily built kernels' state), then
`repeats` timed ones (the engine's decode twice: plain for its rate, then the same tokens part by
part); the backends take turns for `rounds` rounds, so that a machine whose
speed drifts over minutes (a shared host) slows both alike. Reported: load time, peak RSS
after load and at the end, prefill tokens/s on the prompt and decode tokens/s, medians over
all timed passes. Then both backends in one process decode short passes in alternation
(``_run_paired``), whose median ratio is the steadiest on a shared host, and compare their
greedy choices teacher-forced (backend/bench/greedy.py). A benchmark, not a test: compare the
ratios printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BACKENDS = ("engine", "llamacpp")


def _vm_hwm() -> int:
    """Peak resident set size of this process in bytes (Linux /proc; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    # Avoid the low ids, where special and control tokens live.
    return [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(n)]


def _probe(threads: int) -> float:
    """Host read bandwidth, bytes/s, taken right before and right after each timed decode pass:
    on a shared host it moves by tens of percent within minutes (37-78 GB/s within an hour on
    a 2-core Zen 5 VM), so a pass is set against the probes around it, not a median of others."""
    from hybridmoe.backend.hardware.bandwidth import measure_host_read_bandwidth

    return measure_host_read_bandwidth(threads=threads, passes=3)


def _load_engine(model: str, context: int, threads: int):
    """The engine's model of `model` for one sequence of `context` tokens on the CPU, and its plan."""
    import torch

    from hybridmoe.backend.engine.session import EngineBackend
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    torch.set_num_threads(threads)
    os.environ.setdefault("HYBRIDMOE_CPU_THREADS", str(threads))
    inspected = inspect_model(model)
    plan = make(inspected.spec, inspected.inventory, detect(measure_bandwidth=False),
                Workload(context=context, strategy="cpu-only"))
    return EngineBackend().load(model, plan).model, plan


def _prefill(net, ids: list[int], chunk: int):
    """The prompt `ids` into the engine's one sequence from position 0, `chunk` tokens a call
    (the plan's, as the app's scheduler calls it): the last token's logits."""
    for pos in range(0, len(ids), chunk):
        (logits,) = net.forward_batch([(net.sequence, ids[pos : pos + chunk], pos)], prompt=True)
    return logits


def _run_engine(model: str, prompt_tokens: int, gen_tokens: int, threads: int, repeats: int) -> dict:
    from hybridmoe.backend.engine import native_kernels, step_profile
    from hybridmoe.backend.text.sampling import Sampler, SamplingParams

    t0 = time.perf_counter()
    net, plan = _load_engine(model, prompt_tokens + gen_tokens + 8, threads)
    load_s = time.perf_counter() - t0
    rss_load = _vm_hwm()
    ids = _prompt(net.config.require("vocab_size"), prompt_tokens)
    prefill, decode, decode_probe, probes, tokens = [], [], [], [], []
    profiles = []
    greedy = Sampler(SamplingParams(temperature=0))
    seq = net.sequence
    # The model's entry point the app's scheduler calls (``batching``), one sequence.
    for rep in range(repeats + 1):  # the first pass warms up, untimed
        t0 = time.perf_counter()
        logits = _prefill(net, ids, plan.workload.prefill_chunk)
        prefill_s = time.perf_counter() - t0
        tok = greedy.sample(logits)
        out = [tok]
        before = _probe(threads) if rep else 0.0
        t0 = time.perf_counter()
        for i in range(gen_tokens - 1):
            (logits,) = net.forward_batch([(seq, [tok], len(ids) + i)])
            tok = greedy.sample(logits)  # what `hybridmoe run` does at its default temperature 0
            out.append(tok)
        decode_s = time.perf_counter() - t0
        after = _probe(threads) if rep else 0.0
        # The same tokens again (the cache rewound to the prompt), timed part by part: the
        # timers cost about 0.2 ms a token, so the decode rate is the pass above's.
        with step_profile.recording() as profile:
            t0 = time.perf_counter()
            for i, tok in enumerate(out[:-1]):
                (logits,) = net.forward_batch([(seq, [tok], len(ids) + i)])
                t1 = time.perf_counter()
                greedy.sample(logits)
                profile.add("sampling", time.perf_counter() - t1)
            profile.close(time.perf_counter() - t0)
        if rep:
            prefill.append(len(ids) / prefill_s)
            decode.append((gen_tokens - 1) / decode_s)
            decode_probe.append((before + after) / 2)
            probes += [before, after]
            profiles.append(profile.per_token(gen_tokens - 1))
        tokens = out

    return {"load_s": load_s, "rss_after_load": rss_load, "prefill": prefill, "decode": decode,
            "decode_probe": decode_probe, "tokens": tokens, "kernels": native_kernels.isa(), "probe": probes,
            "decode_path": net.decode_plan().summary(), "breakdown": profiles,
            "plan_bytes_per_token": plan.host_bytes_per_token,
            "plan_context": plan.workload.context}


def _run_llamacpp(model: str, prompt_tokens: int, gen_tokens: int, threads: int, repeats: int) -> dict:
    from importlib.metadata import version

    import numpy as np

    from hybridmoe.backend.llamacpp.model import RawModel

    t0 = time.perf_counter()
    llm = RawModel(model, n_ctx=prompt_tokens + gen_tokens + 8, n_batch=2048, n_threads=threads)
    load_s = time.perf_counter() - t0
    rss_load = _vm_hwm()
    ids = _prompt(llm.n_vocab(), prompt_tokens)
    prefill, decode, decode_probe, probes, tokens = [], [], [], [], []
    for rep in range(repeats + 1):  # the first pass warms up, untimed
        llm.reset()
        t0 = time.perf_counter()
        logits = llm.eval(ids)
        prefill_s = time.perf_counter() - t0
        tok = int(np.argmax(logits[-1]))
        out = [tok]
        before = _probe(threads) if rep else 0.0
        t0 = time.perf_counter()
        for _ in range(gen_tokens - 1):
            tok = int(np.argmax(llm.eval([tok])[-1]))
            out.append(tok)
        decode_s = time.perf_counter() - t0
        if rep:
            after = _probe(threads)
            prefill.append(len(ids) / prefill_s)
            decode.append((gen_tokens - 1) / decode_s)
            decode_probe.append((before + after) / 2)
            probes += [before, after]
        tokens = out
    llm.close()
    return {"load_s": load_s, "rss_after_load": rss_load, "prefill": prefill, "decode": decode,
            "decode_probe": decode_probe, "probe": probes, "tokens": tokens, "version": version("llama-cpp-python")}


GREEDY_STEPS = 32  # the teacher-forced comparison's steps (after the run's prompt)


def _run_paired(model: str, prompt_tokens: int, threads: int, pairs: int, tokens: int) -> dict:
    """Both backends in one process, decoding in alternation from the same prompt: in pair i each
    decodes `tokens` tokens at the same positions, right after the other (which goes first
    alternates). On a shared host whose bandwidth moves by tens of percent within minutes, the
    ratio of two passes a fraction of a second apart is steadier than that of medians taken
    minutes apart in separate processes; its median over the pairs is the figure. Then, both
    rewound to the prompt, their greedy choices teacher-forced ("greedy": ``_forced``)."""
    import numpy as np

    from hybridmoe.backend.llamacpp.model import RawModel
    from hybridmoe.backend.text.sampling import Sampler, SamplingParams

    context = prompt_tokens + max(pairs * tokens, GREEDY_STEPS) + 8
    net, plan = _load_engine(model, context, threads)
    llm = RawModel(model, n_ctx=context, n_batch=2048, n_threads=threads)
    try:
        ids = _prompt(llm.n_vocab(), prompt_tokens)
        greedy, seq = Sampler(SamplingParams(temperature=0)), net.sequence
        firsts = (_prefill(net, ids, plan.workload.prefill_chunk).float().numpy().copy(),
                  np.array(llm.eval(ids)[-1], dtype=np.float32))
        state = {"engine": int(np.argmax(firsts[0])), "llamacpp": int(np.argmax(firsts[1]))}

        def engine(start: int) -> None:
            tok = state["engine"]
            for i in range(tokens):
                (out,) = net.forward_batch([(seq, [tok], start + i)])
                tok = greedy.sample(out)
            state["engine"] = tok

        def llama(start: int) -> None:
            tok = state["llamacpp"]
            for _ in range(tokens):
                tok = int(np.argmax(llm.eval([tok])[-1]))
            state["llamacpp"] = tok

        rates: dict[str, list[float]] = {"engine": [], "llamacpp": []}
        probes = [_probe(threads)]
        for i in range(pairs):
            start = prompt_tokens + i * tokens
            for name in (("engine", "llamacpp") if i % 2 == 0 else ("llamacpp", "engine")):
                time.sleep(0.02)  # the other's threads spin a while after its last call: let them go idle
                t0 = time.perf_counter()
                (engine if name == "engine" else llama)(start)
                rates[name].append(tokens / (time.perf_counter() - t0))
        probes.append(_probe(threads))
        forced = _forced(net, llm, len(ids), firsts)
    finally:
        llm.close()
    return {"pairs": pairs, "tokens": tokens, **rates, "probe": probes,
            "ratios": [e / lc for e, lc in zip(rates["engine"], rates["llamacpp"])], "greedy": forced}


def _forced(net, llm, prompt_tokens: int, firsts) -> dict:
    """llama.cpp's GREEDY_STEPS greedy tokens after the prompt, and the engine fed the same ones,
    both from their logits after the prompt (`firsts`: the engine's, llama.cpp's) with their
    caches rewound to it: every step's choices compared (backend/bench/greedy.py)."""
    import numpy as np

    from hybridmoe.backend.bench import greedy

    ours, theirs, tokens = [firsts[0]], [firsts[1]], [int(np.argmax(firsts[1]))]
    llm.rewind(prompt_tokens)
    for i in range(GREEDY_STEPS - 1):
        (row,) = net.forward_batch([(net.sequence, [tokens[-1]], prompt_tokens + i)])
        ours.append(row.float().numpy().copy())  # the step's buffer may be the next step's
        theirs.append(np.array(llm.eval([tokens[-1]])[-1], dtype=np.float32))
        tokens.append(int(np.argmax(theirs[-1])))
    return greedy.compare(tokens, theirs, ours)


def run_worker(backend: str, model: str, prompt_tokens: int, gen_tokens: int, threads: int, repeats: int,
               pairs: int = 0) -> dict:
    if backend == "paired":
        return _run_paired(model, prompt_tokens, threads, pairs, gen_tokens)
    runner = _run_engine if backend == "engine" else _run_llamacpp
    result = runner(model, prompt_tokens, gen_tokens, threads, repeats)
    result["rss_peak"] = _vm_hwm()
    result["backend"] = backend
    return result


def measure(model: str, *, prompt_tokens: int = 512, gen_tokens: int = 64, threads: int | None = None,
            repeats: int = 2, rounds: int = 2, pairs: int = 12, pair_tokens: int = 16, backends=BACKENDS,
            on_progress=None, cancel=None) -> dict:
    """Run the backends in turn, each in its own process, `rounds` times; return their results
    (timings of every round together) and the engine/llama.cpp ratios of the medians; then,
    with both measured and `pairs` > 0, both in one process decoding in alternation
    (``_run_paired``: `pairs` pairs of `pair_tokens`-token passes).

    ``on_progress`` (a hybridmoe.backend.session.ProgressCallback) hears which backend starts;
    ``cancel`` (a CancelToken) kills the running worker and raises ``Cancelled``."""
    import psutil

    from hybridmoe.backend.session import Progress

    threads = threads or psutil.cpu_count(logical=False) or 1
    # The plan's expected figures for what is about to run, made before it (a prediction).
    predicted = plan_expectation(model, prompt_tokens + gen_tokens + 8, prompt_tokens)
    results: dict[str, dict] = {}
    runs = [(r, b) for r in range(rounds) for b in backends]
    paired = pairs > 0 and set(BACKENDS) <= set(backends)
    for i, (r, backend) in enumerate(runs):
        if on_progress is not None:
            on_progress(Progress("bench", i, len(runs) + paired, unit="runs",
                                 message=f"measuring {backend}, round {r + 1}"))
        if "error" in results.get(backend, {}):
            continue
        run = worker_result(_worker_cmd(backend, model, prompt_tokens, gen_tokens, threads, repeats), cancel)
        if backend not in results or "error" in run:
            results[backend] = run
        else:  # timings accumulate; load figures are the first round's, peaks the highest
            kept = results[backend]
            for key in ("prefill", "decode", "decode_probe", "probe", "breakdown"):
                kept[key] = kept.get(key, []) + run.get(key, [])
            kept["rss_peak"] = max(kept["rss_peak"], run["rss_peak"])
    summary = summarize(model, prompt_tokens, gen_tokens, threads, repeats, rounds, results)
    summary["plan_expected"] = predicted
    engine = results.get("engine", {})
    record_engine_rate({**engine, "prompt_tokens": prompt_tokens}, "bench generate", predicted.get("engine"), threads)
    if paired and all("error" not in results[b] for b in BACKENDS):
        if on_progress is not None:
            on_progress(Progress("bench", len(runs), len(runs) + 1, unit="runs",
                                 message="both backends in one process, in alternation"))
        run = worker_result(_worker_cmd("paired", model, prompt_tokens, pair_tokens, threads, repeats)
                            + ["--pairs", str(pairs)], cancel)
        summary["paired"] = run
        if "error" not in run:
            ratios = run["ratios"]
            q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
            summary["paired"] = {**run, "median": median, "quartiles": [q1, q3]}
            # The engine's share of the probe at its paired rate: 4-12 passes a process, where
            # its own worker times one (a 31-token pass moved 58-69 tokens/s on a 2-core VM).
            nbytes = engine.get("per_token", {}).get("end_to_end", {}).get("bytes")
            if nbytes and run.get("probe"):
                summary["paired"]["engine_of_probe"] = (nbytes * statistics.median(run["engine"])
                                                        / statistics.median(run["probe"]))
    return summary


def plan_expectation(model: str, context: int, prompt_tokens: int) -> dict:
    """The plan's expected decode and prefill tokens/s for one CPU-only conversation of
    `context` tokens on this machine (one bandwidth reading for the process), per backend,
    with how each was obtained: what the table prints beside the measured figures."""
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    from hybridmoe.backend.errors import HybridMoeError

    try:
        inspected = inspect_model(model)
    except HybridMoeError:
        return {}  # a file the planner cannot read: the workers say what is wrong with it, in the table
    hardware = detect(measure_bandwidth=True)
    out = {}
    for backend in BACKENDS:
        plan = make(inspected.spec, inspected.inventory, hardware,
                    Workload(context=context, strategy="cpu-only", backend=backend,
                             prefill_chunk=min(prompt_tokens, 2048) or 1))
        out[backend] = {"decode": plan.decode_tokens_per_s_expected, "decode_how": plan.decode_expected_how,
                        "decode_bound": plan.decode_tokens_per_s_upper_bound,
                        "prefill": plan.prefill_tokens_per_s_expected, "prefill_how": plan.prefill_expected_how,
                        # What the measured rates are kept by (record_engine_rate).
                        "expert_format": plan.expert_format,
                        "expert_bytes_per_weight": inspected.inventory.expert_bits_per_weight / 8,
                        "prefill_cpu_flops_per_token": plan.prefill_cpu_flops_per_token}
    return out


def record_engine_rate(engine: dict, source: str, predicted: dict | None = None, threads: int = 1) -> None:
    """Keep what the engine reached on this machine (hardware.achieved), for later plans to
    expect: its decode read rate (its bytes a token at its median rate), or, for a format whose
    unpacking limits its decode (plan.expected.unpack_limited), the expert weights a core unpacked
    per second (the experts' part of the token, over `threads` cores); and its prompt rate (the
    plan's flops per prompt token, `predicted`'s, at the median prompt tokens/s)."""
    end_to_end = engine.get("per_token", {}).get("end_to_end", {})
    if "error" in engine or not end_to_end.get("gbps"):
        return
    from hybridmoe.backend.hardware import achieved, detect
    from hybridmoe.backend.plan.expected import MIN_PROMPT_TOKENS_TO_RECORD, unpack_limited

    here = detect(measure_bandwidth=False)
    predicted = predicted or {}
    fmt = predicted.get("expert_format")
    experts = engine["per_token"]["parts"].get("experts", {})
    if unpack_limited(fmt):
        if experts.get("seconds") and predicted.get("expert_bytes_per_weight"):
            per_core = experts["bytes"] / predicted["expert_bytes_per_weight"] / experts["seconds"] / threads
            achieved.record_rate(here, "expert_weights_per_s_per_core", expert_format=fmt, value=per_core,
                                 source=f"{source}, {fmt} experts {experts['bytes'] / 1e6:.0f} MB a token in "
                                        f"{experts['seconds'] * 1e3:.2f} ms on {threads} cores")
    else:
        achieved.record(here, bytes_per_token=end_to_end["bytes"], tokens_per_s=1 / end_to_end["seconds"],
                        # of_probe: each pass against the probes taken right around it
                        probe_bytes_per_s=end_to_end["bytes"] / end_to_end["seconds"] / end_to_end["of_probe"],
                        source=f"{source}, {end_to_end['bytes'] / 1e6:.0f} MB a token at "
                               f"{1 / end_to_end['seconds']:.1f} tokens/s")
    flops = predicted.get("prefill_cpu_flops_per_token")
    if flops and engine.get("prefill_median") and engine.get("prompt_tokens", 0) >= MIN_PROMPT_TOKENS_TO_RECORD:
        achieved.record_rate(here, "prefill_flops_per_s", expert_format=fmt, value=flops * engine["prefill_median"],
                             source=f"{source}, a {engine['prompt_tokens']}-token prompt at "
                                    f"{engine['prefill_median']:.1f} tokens/s")


def _worker_cmd(backend: str, model: str, prompt_tokens: int, gen_tokens: int, threads: int, repeats: int) -> list[str]:
    return [sys.executable, "-m", "hybridmoe.backend.bench.generate", "--worker", backend, model,
            "--prompt-tokens", str(prompt_tokens), "--gen-tokens", str(gen_tokens),
            "--threads", str(threads), "--repeats", str(repeats)]


def summarize(model: str, prompt_tokens: int, gen_tokens: int, threads: int, repeats: int, rounds: int,
              results: dict[str, dict]) -> dict:
    """The backends' runs (every round's timings together) -> medians, the engine's decode
    token part by part, and the engine / llama.cpp ratios."""
    from hybridmoe.backend.text.generation import common_prefix

    for r in results.values():
        if "error" not in r:
            r["prefill_median"] = statistics.median(r["prefill"])
            r["decode_median"] = statistics.median(r["decode"])
            if r.get("breakdown"):
                r["per_token"] = per_token(r)
    summary = {"model": model, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "threads": threads,
               "repeats": repeats, "rounds": rounds, "results": results}
    e, l = results.get("engine", {}), results.get("llamacpp", {})
    if "decode_median" in e and "decode_median" in l:
        summary["decode_ratio"] = e["decode_median"] / l["decode_median"]
        summary["prefill_ratio"] = e["prefill_median"] / l["prefill_median"]
        summary["same_greedy_tokens"] = e["tokens"] == l["tokens"]
        # After the first difference the two continue different texts: later matches mean nothing.
        summary["greedy_tokens_in_common"] = common_prefix(e["tokens"], l["tokens"])
        if "per_token" in e:
            # One sequence of the same file: llama.cpp reads the same weights and about the same
            # cache per token. Its share of the probe bounds what a faster engine can show: at
            # the wall, decode is at most 1 / that share times llama.cpp's.
            share = of_probe(l, e["per_token"]["end_to_end"]["bytes"])
            summary["llamacpp_of_probe"] = share
            summary["decode_ratio_at_wall"] = 1 / share
            # The two shares' ratio: the decode ratio with each pass set against the bandwidth
            # of its own moment.
            summary["decode_ratio_per_bandwidth"] = e["per_token"]["end_to_end"]["of_probe"] / share
    return summary


def of_probe(result: dict, nbytes: float) -> float:
    """The median over a backend's decode passes of `nbytes` a token at the pass's rate against
    the probes taken around it (``decode_probe``; without them, the median of all probes)."""
    probes = result.get("decode_probe") or [statistics.median(result["probe"])] * len(result["decode"])
    return statistics.median(nbytes * rate / probe for rate, probe in zip(result["decode"], probes))


def per_token(result: dict) -> dict:
    """The engine's decode token, part by part (medians over the passes): seconds, bytes read,
    GB/s and the share of the bandwidth probes' median; and the whole token end to end, its
    bytes over its time (1 / the median decode rate), its share of the probe pass by pass
    (``of_probe``)."""
    from hybridmoe.backend.engine.step_profile import PARTS

    probe = statistics.median(result["probe"])
    passes = result["breakdown"]
    parts = {}
    for part in PARTS:
        seen = [p[part] for p in passes if part in p]
        if not seen:
            continue
        seconds = statistics.median(s["seconds"] for s in seen)
        nbytes = statistics.median(s["bytes"] for s in seen)
        gbps = nbytes / seconds / 1e9 if seconds and nbytes else None
        parts[part] = {"seconds": seconds, "bytes": nbytes, "gbps": gbps,
                       "of_probe": gbps * 1e9 / probe if gbps else None}
    seconds = 1.0 / result["decode_median"]
    nbytes = sum(p["bytes"] for p in parts.values())
    return {"probe_gbps": probe / 1e9, "parts": parts,
            "end_to_end": {"seconds": seconds, "bytes": nbytes, "gbps": nbytes / seconds / 1e9,
                           "of_probe": of_probe(result, nbytes)}}


def worker_result(cmd: list[str], cancel) -> dict:
    """Run a benchmark worker: its JSON result (its last line of output), or {"error": what it
    died of}. A cancel kills the worker (a long benchmark must stop when asked)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=0.1)  # retrying after a timeout loses no output
            break
        except subprocess.TimeoutExpired:
            if cancel is not None and cancel.cancelled:
                proc.kill()
                proc.communicate()
                cancel.raise_if_cancelled("the benchmark")
    if proc.returncode != 0:
        return {"error": worker_error(stderr)}
    return json.loads(stdout.strip().splitlines()[-1])


def worker_error(stderr: str) -> str:
    """What a failed worker died of: its exception's line (the first unindented line after the
    last traceback header; native code may print more after it), else its last line."""
    lines = stderr.strip().splitlines()
    headers = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if headers:
        for line in lines[headers[-1] + 1 :]:
            if line and not line[0].isspace():
                return line
    return lines[-1] if lines else "failed"


def table(summary: dict) -> str:
    gib = 1 << 30
    lines = [f"{summary['model']}: {summary['prompt_tokens']}-token prompt, {summary['gen_tokens']} generated, "
             f"{summary['threads']} threads, median of {summary['repeats']} passes x {summary.get('rounds', 1)} rounds "
             "(backends in turn)",
             f"{'backend':10} {'load s':>7} {'RSS load':>9} {'RSS peak':>9} {'prefill tok/s':>14} {'decode tok/s':>13}"]
    for name, r in summary["results"].items():
        if "error" in r:
            lines.append(f"{name:10} error: {r['error']}")
            continue
        lines.append(f"{name:10} {r['load_s']:7.2f} {r['rss_after_load'] / gib:8.2f}G {r['rss_peak'] / gib:8.2f}G "
                     f"{r['prefill_median']:14.1f} {r['decode_median']:13.1f}")
    engine = summary["results"].get("engine", {})
    expected = summary.get("plan_expected") or {}
    for name, r in summary["results"].items():
        e = expected.get(name) or {}
        if "error" in r or not e:
            continue
        lines.append(f"{name:10} measured decode {r['decode_median']:.1f} tok/s, the plan expected "
                     f"{_rate(e['decode'])} ({(r['decode_median'] / e['decode'] - 1) if e['decode'] else 0:+.0%}; "
                     f"at most {_rate(e['decode_bound'])}); prefill {r['prefill_median']:.1f}, expected "
                     f"{_rate(e['prefill'])}")
    if expected.get("engine"):
        lines.append(f"the plan's expected decode, {expected['engine']['decode_how']}")  # (its how names the engine)
        lines.append(f"the plan's expected prefill, the engine: {expected['engine']['prefill_how']}")
    if "decode_path" in engine:  # which executor computed the engine's tokens, and why
        lines.append(f"the engine's {engine['decode_path']}")
    if "per_token" in engine:
        lines += ["", *breakdown_table(engine["per_token"], len(engine["breakdown"]), len(engine["probe"]))]
        if "plan_bytes_per_token" in engine:  # what `hybridmoe plan --strategy cpu-only` promised
            lines.append(f"the plan's figure: {engine['plan_bytes_per_token'] / 1e6:.1f} MB read per token (its cache "
                         f"at the full {engine['plan_context']} tokens)")
    forced = (summary.get("paired") or {}).get("greedy")
    if "decode_ratio" in summary:
        if forced:  # the free-running prefix ends at the first near tie; the forced comparison does not
            from hybridmoe.backend.bench import greedy

            agree = (f"teacher-forced: {greedy.in_words(forced)} the same, logits {forced['distance']:.3f} of their "
                     "spread apart")
        elif summary["same_greedy_tokens"]:
            agree = "the same"
        else:
            agree = f"the same for the first {summary['greedy_tokens_in_common']} of {len(engine.get('tokens', ()))}"
        if "decode_ratio_at_wall" in summary:
            lines.append(f"llama.cpp read {summary['llamacpp_of_probe']:.0%} of the probe on the same bytes per token: "
                         f"at the wall, decode would be {summary['decode_ratio_at_wall']:.2f}x llama.cpp's")
        matched = (f" ({summary['decode_ratio_per_bandwidth']:.2f}x pass by pass against the probes around each)"
                   if "decode_ratio_per_bandwidth" in summary else "")
        lines.append(f"engine / llama.cpp: prefill {summary['prefill_ratio']:.2f}x, decode {summary['decode_ratio']:.2f}x"
                     f"{matched}; greedy tokens {agree}")
    paired = summary.get("paired")
    if paired and "error" in paired:
        lines.append(f"in alternation in one process: error: {paired['error']}")
    elif paired:
        lines.append(f"in alternation in one process ({paired['pairs']} pairs of {paired['tokens']}-token passes at the "
                     f"same positions): decode {paired['median']:.2f}x (quartiles {paired['quartiles'][0]:.2f}-"
                     f"{paired['quartiles'][1]:.2f}; engine {statistics.median(paired['engine']):.1f}, llama.cpp "
                     f"{statistics.median(paired['llamacpp']):.1f} tok/s"
                     + (f", the engine at {paired['engine_of_probe']:.0%} of the probe" if "engine_of_probe" in paired
                        else "") + ")")
    return "\n".join(lines)


def _rate(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.1f}"


def breakdown_table(per: dict, passes: int, probes: int) -> list[str]:
    from hybridmoe.backend.engine.step_profile import PARTS

    total = sum(p["seconds"] for p in per["parts"].values())
    lines = [f"engine decode, one token part by part (medians of {passes} passes with timers, run after the ones "
             "the decode rate is of;",
             f"the timers' own cost is in 'between calls'); host read probe {per['probe_gbps']:.1f} GB/s "
             f"(median of {probes})",
             f"{'part':52} {'ms':>7} {'share':>6} {'MB read':>8} {'GB/s':>6} {'of probe':>8}"]
    for name, p in per["parts"].items():
        rate = f"{p['gbps']:6.1f} {p['of_probe']:8.0%}" if p["gbps"] else f"{'':6} {'':8}"
        lines.append(f"{PARTS[name]:52} {p['seconds'] * 1e3:7.2f} {p['seconds'] / total:6.1%} "
                     f"{p['bytes'] / 1e6:8.1f} {rate}")
    e = per["end_to_end"]
    lines.append(f"end to end: {e['bytes'] / 1e6:.1f} MB read per token in {e['seconds'] * 1e3:.2f} ms = "
                 f"{e['gbps']:.1f} GB/s; {e['of_probe']:.0%} of the probe (median over the passes, each against "
                 "the probes taken just before and after it)")
    return lines


# The sweep's three measurements of each type: decode after a 64-token prompt, prefill of 512
# tokens, decode after a 2048-token prompt.
SWEEP_RUNS = (("decode_64", 64, 32), ("prefill_512", 512, 2), ("decode_2048", 2048, 32))


def sweep(model: str, types: list[str], *, workdir: str | Path | None = None, threads: int | None = None,
          pairs: int = 6, on_progress=None, cancel=None) -> dict:
    """``measure`` on `model` retyped to each of `types` (a GGUF type for every routed expert
    tensor, or a mix of ``retype.MIXES``; backend/bench/retype.py), one file at a time (written
    into `workdir`, default beside the model, and removed after): one row per type of the
    engine / llama.cpp ratios of SWEEP_RUNS, the engine's share of the bandwidth probe, and its
    greedy choices against llama.cpp's, teacher-forced after the decode_64 run's prompt (its
    paired worker's; backend/bench/greedy.py)."""
    from hybridmoe.backend.bench import retype

    workdir = Path(workdir or Path(model).parent)
    rows = []
    for i, fmt in enumerate(types):
        if on_progress is not None:
            from hybridmoe.backend.session import Progress

            on_progress(Progress("bench", i, len(types), unit="types", message=f"{fmt}: writing the file"))
        dst = workdir / f"{Path(model).stem}-{fmt}.gguf"
        files = retype.retype(model, dst, **({"mix": fmt} if fmt in retype.MIXES else {"experts": fmt}))
        try:
            row: dict = {"type": fmt, "bytes": sum(f.stat().st_size for f in files)}
            for key, prompt, gen in SWEEP_RUNS:
                summary = measure(str(files[0]), prompt_tokens=prompt, gen_tokens=gen, threads=threads, repeats=1,
                                  rounds=1, pairs=pairs if gen > 2 else 0, cancel=cancel)
                row[key] = summary
        finally:
            for f in files:
                f.unlink(missing_ok=True)
        rows.append(row)
    return {"model": model, "types": rows}


def sweep_table(result: dict) -> str:
    from hybridmoe.backend.bench import greedy

    lines = [f"{result['model']} retyped (routed experts, or the named mix): engine / llama.cpp, same file, same run",
             f"{'type':11} {'GB':>5} {'decode@64':>10} {'of probe':>8} {'decode@2048':>12} {'prefill 512':>11}  "
             "greedy, teacher-forced"]

    def ratio(summary: dict, key: str) -> str:
        paired = summary.get("paired") or {}
        if "median" in paired:
            return f"{paired['median']:.2f}x"
        return f"{summary[key]:.2f}x" if key in summary else "error"

    for row in result["types"]:
        d64, p512, d2k = row["decode_64"], row["prefill_512"], row["decode_2048"]
        engine = d64["results"].get("engine", {})
        share = (d64.get("paired", {}).get("engine_of_probe")
                 or engine.get("per_token", {}).get("end_to_end", {}).get("of_probe"))
        forced = d64.get("paired", {}).get("greedy", {})
        same = greedy.in_words(forced) if "same" in forced else forced.get("error", "-")
        lines.append(f"{row['type']:11} {row['bytes'] / 1e9:5.2f} {ratio(d64, 'decode_ratio'):>10} "
                     f"{(f'{share:.0%}' if share else '-'):>8} {ratio(d2k, 'decode_ratio'):>12} "
                     f"{ratio(p512, 'prefill_ratio'):>11}  {same}")
    lines.append("decode: the median ratio of passes in alternation in one process; prefill: medians of separate "
                 "processes; of probe: the engine's bytes per token at its decode rate (in alternation) against the "
                 f"read probe; greedy: llama.cpp's {GREEDY_STEPS} greedy tokens after a {SWEEP_RUNS[0][1]}-token "
                 "prompt, fed to the engine, at how many steps it chooses the same (a difference at a llama.cpp "
                 f"margin under {greedy.NEAR_TIE:g} is a near tie)")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=(*BACKENDS, "paired"), help=argparse.SUPPRESS)
    p.add_argument("model")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--threads", type=int)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args.model, args.prompt_tokens, args.gen_tokens,
                                    args.threads or 1, args.repeats, args.pairs)))
        return 0
    summary = measure(args.model, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                      threads=args.threads, repeats=args.repeats, rounds=args.rounds, pairs=args.pairs)
    print(json.dumps(summary, indent=1) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
