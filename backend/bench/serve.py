"""Serving several conversations at once: the engine and llama.cpp on the same GGUF.

For each backend, in a fresh process of its own (as the generate benchmark does: its own peak
resident memory, its own thread pool), the model is loaded once with room for the largest
number of streams, then for each N in ``streams``:

- N streams generate at once, greedily, from N different prompts of the same length (words
  that are one token each, drawn with a fixed seed), each exactly ``gen_tokens`` tokens
  (end-of-turn tokens do not stop them). The engine gets N threads calling
  ``Session.complete`` together; llama.cpp gets what its server does with N slots: one
  ``llama_decode`` batch per step holding one token of each sequence (prompts prefilled
  together first).
- Reported: aggregate tokens/s (every token generated after each stream's first, over the
  time from the first stream's first token to the last stream's end), per-stream decode
  tokens/s and time to first token (medians), peak RSS; beside them the plan's upper bounds
  for N conversations (per user and together, the union formula of docs/sizing.md).

Then two conversations of about ``turns`` tokens take turns: A's prompt, B's prompt, A's
next turn (A's prompt, its answer and 20 new words), B's next turn. Reported: each next
turn's time to first token, and that of a conversation of the same length prefilled from
scratch; their ratio is what keeping each conversation's cache saves.

A benchmark, not a test: numbers depend on the machine and what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

from hybridmoe.backend.bench.generate import _vm_hwm, worker_result

BACKENDS = ("engine", "llamacpp")
NEW_WORDS_PER_TURN = 20
# Seeds of the prompts: stream i of the run of N streams draws with STREAM_SEED + 100 N + i, the
# turn-taking conversations with their own: no prompt shares a prefix with one run before it,
# which a cache could reuse.
STREAM_SEED = 1000
WARM_UP_SEED = 0
TURN_SEEDS = {"A": 1, "B": 2, "scratch": 3}
MAX_WORDS = 4096  # one-token words to draw prompts from: plenty, and quick to find in a 150K vocabulary


# ---- prompts --------------------------------------------------------------------------------


def one_token_words(tokenizer) -> list[str]:
    """Words with a leading space that ``tokenizer`` encodes as one token each. The
    pre-tokenizers of byte-level BPE vocabularies split text before each " word", so a prompt
    made of n of them is n tokens long, whatever the words."""
    words = []
    for token_id in range(tokenizer.vocab_size):
        if token_id in tokenizer.special_ids:
            continue
        text = tokenizer.decode([token_id])
        word = text[1:]
        if (len(word) >= 2 and text[0] == " " and word.isascii() and word.isalpha()
                and tokenizer.encode(text) == [token_id]):
            words.append(text)
            if len(words) == MAX_WORDS:
                break
    if len(words) < 16:
        from hybridmoe.backend.errors import ModelError

        raise ModelError("the model's vocabulary has too few whole words to build benchmark prompts from "
                         f"(found {len(words)})", "Benchmark a model with a byte-level BPE vocabulary.")
    return words


def words_text(words: Sequence[str], n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(words) for _ in range(n))


def stream_prompt(words: Sequence[str], n_streams: int, stream: int, prompt_tokens: int, repeat: int = 0) -> str:
    return words_text(words, prompt_tokens, STREAM_SEED + 100 * n_streams + stream + 10_000 * repeat)


def median_run(runs: list[dict]) -> dict:
    """Repeated runs of N streams as one: the median of each figure (these machines are
    noisy), the other entries of the first."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float) and all(r.get(key) is not None for r in runs):
            out[key] = statistics.median(r[key] for r in runs)
    out["repeats"] = len(runs)
    return out


def context_per_conversation(prompt_tokens: int, gen_tokens: int, turns: int) -> int:
    """Tokens one conversation may hold: a stream's prompt and answer, or a turn-taking
    conversation's first prompt, two answers and new words (re-tokenized answers can come out
    a little longer than generated: a margin)."""
    turn_taking = turns + 2 * (gen_tokens + NEW_WORDS_PER_TURN) if turns else 0
    return max(prompt_tokens + gen_tokens, turn_taking) + gen_tokens + 64


# ---- what both backends report --------------------------------------------------------------


def summarize_streams(streams: list[dict]) -> dict:
    """One run of N streams: each stream's ``submitted``, ``first_token_at``, ``end_at`` (clock
    seconds) and ``generated`` tokens, reduced to the figures the report shows.

    Together tok/s is the rate while all N decode: llama.cpp's streams decode in lock step from
    their first tokens to the end, so it is all their tokens after the first over that time;
    the engine's streams start as their prompts are done, so with ``token_times`` (when each
    token came) it is the tokens that came while every stream was decoding, over that window
    (the whole run's rate if they never all decoded at once)."""
    start = min(s["first_token_at"] for s in streams)
    end = max(s["end_at"] for s in streams)
    after_first = sum(s["generated"] - 1 for s in streams)
    if all(s.get("token_times") for s in streams):
        together_from, together_to = max(s["first_token_at"] for s in streams), min(s["end_at"] for s in streams)
        in_window = sum(1 for s in streams for t in s["token_times"] if together_from < t <= together_to)
        if in_window:  # else they never all decoded at once: the whole run's rate
            start, end, after_first = together_from, together_to, in_window
    per_stream = [(s["generated"] - 1) / (s["end_at"] - s["first_token_at"])
                  for s in streams if s["generated"] > 1 and s["end_at"] > s["first_token_at"]]
    return {
        "streams": len(streams),
        "generated_tokens": [s["generated"] for s in streams],
        "aggregate_tokens_per_s": after_first / (end - start) if end > start and after_first else None,
        "per_stream_tokens_per_s": statistics.median(per_stream) if per_stream else None,
        "time_to_first_token_s": statistics.median(s["first_token_at"] - s["submitted"] for s in streams),
        "wall_s": end - min(s["submitted"] for s in streams),
    }


def turn_taking(turn: Callable[[str, str, int], dict], words: Sequence[str], turns: int, gen_tokens: int) -> dict:
    """``turn(conversation, text, max_tokens)`` runs one turn of a conversation ("A", "B") and
    returns its ``text`` (the answer), ``time_to_first_token_s`` and ``prompt_tokens``."""
    texts = {c: words_text(words, turns, TURN_SEEDS[c]) for c in ("A", "B")}
    answers = {c: turn(c, texts[c], gen_tokens)["text"] for c in ("A", "B")}
    next_turns = {}
    for i, c in enumerate(("A", "B")):
        texts[c] += answers[c] + words_text(words, NEW_WORDS_PER_TURN, TURN_SEEDS[c] + 100 + i)
        next_turns[c] = turn(c, texts[c], gen_tokens)
    longest = max(t["prompt_tokens"] for t in next_turns.values())
    scratch = turn("scratch", words_text(words, longest, TURN_SEEDS["scratch"]), 1)
    next_ttft = statistics.median(t["time_to_first_token_s"] for t in next_turns.values())
    return {
        "conversation_tokens": longest,
        "next_turn_time_to_first_token_s": {c: t["time_to_first_token_s"] for c, t in next_turns.items()},
        "scratch_time_to_first_token_s": scratch["time_to_first_token_s"],
        "scratch_over_next_turn": scratch["time_to_first_token_s"] / next_ttft if next_ttft > 0 else None,
    }


# ---- the engine -----------------------------------------------------------------------------


def _engine_parallel(session) -> int:
    """How many generations the engine session runs together (its ``max_parallel``, as the
    server reads it). A session that does not say decodes one sequence and keeps one cache:
    concurrent calls would interleave on it, so the benchmark takes them in turns (and the
    figures show it)."""
    return int(getattr(session, "max_parallel", 1))


def _run_engine(model: str, streams: Sequence[int], prompt_tokens: int, gen_tokens: int, threads: int,
                turns: int, repeats: int) -> dict:
    import torch

    from hybridmoe.backend.engine.session import EngineBackend
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make
    from hybridmoe.backend.session import Done
    from hybridmoe.backend.text.sampling import SamplingParams

    torch.set_num_threads(threads)
    os.environ.setdefault("HYBRIDMOE_CPU_THREADS", str(threads))
    inspected = inspect_model(model)
    context = context_per_conversation(prompt_tokens, gen_tokens, turns)
    plan = make(inspected.spec, inspected.inventory, detect(measure_bandwidth=False),
                Workload(context=context, users=max(streams), strategy="cpu-only"))
    started = time.perf_counter()
    session = EngineBackend().load(inspected, plan)
    load_s = time.perf_counter() - started
    rss_load = _vm_hwm()
    words = one_token_words(session.tokenizer)

    def generate(text: str, max_tokens: int, turn_lock=nullcontext()) -> dict:
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        submitted = time.perf_counter()
        first = done = None
        token_times = []
        with turn_lock:
            for event in session.complete(text, sampling):
                now = time.perf_counter()
                first = first or now
                if isinstance(event, Done):
                    done = event
                else:
                    token_times += [now] * len(event.token_ids)
        return {"submitted": submitted, "first_token_at": first, "end_at": time.perf_counter(),
                "generated": len(done.token_ids), "text": done.text, "prompt_tokens": done.stats.prompt_tokens,
                "time_to_first_token_s": first - submitted, "token_times": token_times}

    generate(words_text(words, prompt_tokens, WARM_UP_SEED), 4)  # untimed: page faults on the mapped weights
    repeated: dict[int, list] = {n: [] for n in streams}
    for r in range(repeats):  # the numbers of streams take turns: a drifting machine slows each alike
        for n in streams:
            lock = threading.Lock() if _engine_parallel(session) < n else nullcontext()
            prompts = [stream_prompt(words, n, i, prompt_tokens, r) for i in range(n)]
            repeated[n].append(summarize_streams(_in_threads([lambda p=p: generate(p, gen_tokens, lock)
                                                              for p in prompts])))
    runs = [median_run(repeated[n]) for n in streams]
    turns_result = turn_taking(lambda _, text, k: generate(text, k), words, turns, gen_tokens) if turns else None
    from hybridmoe.backend.engine import native_kernels

    return {"load_s": load_s, "rss_after_load": rss_load, "runs": runs, "turns": turns_result,
            "parallel": _engine_parallel(session), "kernels": native_kernels.isa()}


def _in_threads(calls: list[Callable[[], dict]]) -> list[dict]:
    """Run the calls at once, one thread each; their results in order (the first error re-raised)."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread below
            results[i] = err

    workers = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


# ---- llama.cpp ------------------------------------------------------------------------------


class _LlamaSequences:
    """Several sequences in one llama.cpp context, driven as its server drives its slots: one
    ``llama_decode`` batch carries tokens of any number of sequences, greedy argmax per sequence."""

    def __init__(self, llm, n_seq: int):
        from hybridmoe.backend.llamacpp.library import llama

        self.b = llama()
        self.llm = llm
        self.capacity = llm.n_batch
        self.batch = self.b.llama_batch_init(self.capacity, 0, 1)
        self.memory = self.b.llama_get_memory(llm.ctx)
        self.cached: dict[int, list[int]] = {seq: [] for seq in range(n_seq)}  # ids whose keys/values are held

    def clear(self) -> None:
        self.b.llama_memory_clear(self.memory, True)
        self.cached = {seq: [] for seq in self.cached}

    def decode(self, entries: Sequence[tuple[int, int, bool]]) -> list[int]:
        """Run ``(sequence, token, wants_logits)`` entries, each at its sequence's next
        position; the greedy next token of each entry that wants logits, in order."""
        import numpy as np

        from hybridmoe.backend.errors import ModelError

        b, batch, vocab = self.b, self.batch, self.llm.n_vocab()
        chosen = []
        for start in range(0, len(entries), self.capacity):
            chunk = entries[start : start + self.capacity]
            for i, (seq, token, wants) in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = len(self.cached[seq])
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = wants
                self.cached[seq].append(token)
            batch.n_tokens = len(chunk)
            rc = b.llama_decode(self.llm.ctx, batch)
            if rc != 0:
                raise ModelError(f"llama.cpp failed to evaluate {len(chunk)} tokens (llama_decode returned {rc})")
            for i, (_, _, wants) in enumerate(chunk):
                if wants:
                    logits = np.ctypeslib.as_array(b.llama_get_logits_ith(self.llm.ctx, i), shape=(vocab,))
                    chosen.append(int(np.argmax(logits)))
        return chosen

    def prefill(self, prompts: dict[int, list[int]]) -> dict[int, int]:
        """Each sequence's prompt after the prefix its cache holds, all in the same batches
        (at least the last token runs, to give logits); the first token of each."""
        from hybridmoe.backend.text.generation import common_prefix

        entries = []
        for seq, ids in prompts.items():
            keep = min(common_prefix(self.cached[seq], ids), len(ids) - 1)
            self.b.llama_memory_seq_rm(self.memory, seq, keep, -1)
            del self.cached[seq][keep:]
            entries += [(seq, token, i == len(ids) - 1) for i, token in enumerate(ids[keep:], keep)]
        return dict(zip(prompts, self.decode(entries), strict=True))

    def generate(self, prompts: dict[int, list[int]], gen_tokens: int) -> tuple[dict[int, list[int]], float]:
        """Greedy continuations of ``gen_tokens`` for every sequence, decoded together; and when
        the first tokens came."""
        tokens = self.prefill(prompts)
        first_token_at = time.perf_counter()
        out = {seq: [token] for seq, token in tokens.items()}
        for _ in range(gen_tokens - 1):
            tokens = dict(zip(tokens, self.decode([(seq, t, True) for seq, t in tokens.items()]), strict=True))
            for seq, token in tokens.items():
                out[seq].append(token)
        return out, first_token_at

    def close(self) -> None:
        self.b.llama_batch_free(self.batch)


def _run_llamacpp(model: str, streams: Sequence[int], prompt_tokens: int, gen_tokens: int, threads: int,
                  turns: int, repeats: int) -> dict:
    from importlib.metadata import version

    from hybridmoe.backend.llamacpp.model import RawModel
    from hybridmoe.backend.text.tokenizer import load_tokenizer

    # The engine's tokenizer for both backends: the same words, the same prompt ids.
    tokenizer = load_tokenizer(model)
    words = one_token_words(tokenizer)
    n_seq = max(*streams, 2 if turns else 1)
    context = context_per_conversation(prompt_tokens, gen_tokens, turns)
    started = time.perf_counter()
    llm = RawModel(model, n_ctx=n_seq * context, n_batch=2048, n_threads=threads, n_seq_max=n_seq)
    load_s = time.perf_counter() - started
    rss_load = _vm_hwm()
    sequences = _LlamaSequences(llm, n_seq)
    sequences.generate({0: tokenizer.encode_prompt(words_text(words, prompt_tokens, WARM_UP_SEED))}, 4)  # untimed
    repeated: dict[int, list] = {n: [] for n in streams}
    for r in range(repeats):
        for n in streams:
            sequences.clear()
            prompts = {i: tokenizer.encode_prompt(stream_prompt(words, n, i, prompt_tokens, r)) for i in range(n)}
            submitted = time.perf_counter()
            out, first_token_at = sequences.generate(prompts, gen_tokens)
            end_at = time.perf_counter()
            repeated[n].append(summarize_streams([{"submitted": submitted, "first_token_at": first_token_at,
                                                   "end_at": end_at, "generated": len(tokens)}
                                                  for tokens in out.values()]))
    runs = [median_run(repeated[n]) for n in streams]

    seq_of = {"A": 0, "B": 1, "scratch": 0}

    def turn(conversation: str, text: str, max_tokens: int) -> dict:
        seq = seq_of[conversation]
        if conversation == "scratch":  # a conversation never seen: nothing of it is cached
            sequences.b.llama_memory_seq_rm(sequences.memory, seq, 0, -1)
            sequences.cached[seq] = []
        ids = tokenizer.encode_prompt(text)
        submitted = time.perf_counter()
        out, first_token_at = sequences.generate({seq: ids}, max_tokens)
        return {"text": tokenizer.decode(out[seq]), "prompt_tokens": len(ids),
                "time_to_first_token_s": first_token_at - submitted}

    turns_result = None
    if turns:
        sequences.clear()
        turns_result = turn_taking(turn, words, turns, gen_tokens)
    sequences.close()
    llm.close()
    return {"load_s": load_s, "rss_after_load": rss_load, "runs": runs, "turns": turns_result,
            "parallel": n_seq, "version": version("llama-cpp-python")}


# ---- the parent: workers, plan, report ------------------------------------------------------


def run_worker(backend: str, model: str, streams: Sequence[int], prompt_tokens: int, gen_tokens: int,
               threads: int, turns: int, repeats: int = 1) -> dict:
    runner = _run_engine if backend == "engine" else _run_llamacpp
    result = runner(model, streams, prompt_tokens, gen_tokens, threads, turns, repeats)
    result["rss_peak"] = _vm_hwm()
    result["backend"] = backend
    return result


def predictions(model: str, streams: Sequence[int], context: int, backend: str = "engine") -> dict[int, dict]:
    """The plan's expected figures and upper bounds for N conversations of ``context`` tokens
    on this machine, CPU-only (the backends run CPU-only here), for `backend`: per user and all
    together, tokens/s. (The plan counts each conversation's whole cache as read at every step:
    the streams' own context is the fair one to give it.)"""
    from hybridmoe.backend.hardware import detect
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    inspected = inspect_model(model)
    hardware = detect(measure_bandwidth=True)
    out: dict = {}
    for n in streams:
        plan = make(inspected.spec, inspected.inventory, hardware,
                    Workload(context=context, users=n, strategy="cpu-only", backend=backend))
        out[n] = {"per_user_tokens_per_s": plan.decode_tokens_per_s_per_user,
                  "aggregate_tokens_per_s": plan.decode_tokens_per_s_aggregate,
                  "expected_per_user_tokens_per_s": plan.decode_tokens_per_s_per_user_expected,
                  "expected_aggregate_tokens_per_s": plan.decode_tokens_per_s_aggregate_expected,
                  "expected_how": plan.decode_expected_how_per_user,
                  "host_bytes_per_token": plan.host_bytes_per_token,
                  "expert_format": plan.expert_format,
                  "probe_bytes_per_s": hardware.memory.bandwidth_measured_bytes_per_s,
                  "experts_touched_per_layer": plan.experts_touched_per_layer}
    return out


def measure(model: str, *, streams: Sequence[int] = (1, 2, 4, 8), prompt_tokens: int = 128, gen_tokens: int = 64,
            threads: int = 2, backends: Sequence[str] = BACKENDS, turns: int = 2000, repeats: int = 3,
            cancel=None) -> dict:
    """Each backend in its own process, one after the other; the results (each run of N
    streams `repeats` times, with new prompts, medians), the plan's predictions and the
    ratios (engine over llama.cpp at each N; N streams over one)."""
    streams = sorted(set(streams))
    context = context_per_conversation(prompt_tokens, gen_tokens, turns)
    summary = {"model": model, "streams": streams, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
               "threads": threads, "turns": turns, "repeats": repeats, "context": context,
               "predicted": predictions(model, streams, prompt_tokens + gen_tokens), "results": {}}
    if "llamacpp" in backends:
        summary["predicted_llamacpp"] = predictions(model, streams, prompt_tokens + gen_tokens, "llamacpp")
    for backend in backends:
        cmd = [sys.executable, "-m", "hybridmoe.backend.bench.serve", "--worker", backend, model,
               "--streams", ",".join(map(str, streams)), "--prompt", str(prompt_tokens), "--tokens", str(gen_tokens),
               "--threads", str(threads), "--turns", str(turns), "--repeats", str(repeats)]
        summary["results"][backend] = worker_result(cmd, cancel)
    summary["ratios"] = ratios(summary)
    record_engine_rate(summary)
    return summary


def record_engine_rate(summary: dict) -> None:
    """Keep the engine's one-stream decode read rate (the plan's bytes a token at the measured
    rate) for this machine (hardware.achieved): later plans expect it. Not for a format whose
    unpacking, not its reads, limits its decode (plan.expected.unpack_limited)."""
    from hybridmoe.backend.plan.expected import unpack_limited

    runs = summary["results"].get("engine", {}).get("runs", [])
    one = next((r for r in runs if r["streams"] == 1 and r["aggregate_tokens_per_s"]), None)
    predicted = summary["predicted"].get(1) or {}
    if one is None or not predicted.get("host_bytes_per_token") or unpack_limited(predicted.get("expert_format")):
        return
    from hybridmoe.backend.hardware import achieved, detect

    rate = one["aggregate_tokens_per_s"]
    achieved.record(detect(measure_bandwidth=False), bytes_per_token=predicted["host_bytes_per_token"],
                    tokens_per_s=rate, probe_bytes_per_s=predicted.get("probe_bytes_per_s"), source=f"bench serve, {predicted['host_bytes_per_token'] / 1e6:.0f} MB a token at {rate:.1f} tokens/s")


def ratios(summary: dict) -> dict:
    def aggregates(backend: str) -> dict[int, float]:
        runs = summary["results"].get(backend, {}).get("runs", [])
        return {r["streams"]: r["aggregate_tokens_per_s"] for r in runs if r["aggregate_tokens_per_s"]}

    out: dict = {"engine_over_llamacpp": {}, "over_one_stream": {}}
    engine, llamacpp = aggregates("engine"), aggregates("llamacpp")
    for n in summary["streams"]:
        if n in engine and n in llamacpp:
            out["engine_over_llamacpp"][n] = engine[n] / llamacpp[n]
    for backend in summary["results"]:
        agg = aggregates(backend)
        if 1 in agg:
            out["over_one_stream"][backend] = {n: agg[n] / agg[1] for n in summary["streams"] if n in agg and n > 1}
    return out


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(summary: dict) -> str:
    gib = 1 << 30
    lines = [f"{summary['model']}: {summary['prompt_tokens']}-token prompts, {summary['gen_tokens']} tokens per "
             f"stream, {summary['threads']} threads, medians of {summary.get('repeats', 1)} runs; (expected) = the "
             "plan's expected figure for N conversations, CPU-only, (at most) its upper bound",
             f"{'backend':10} {'N':>2} {'together tok/s':>15} {'(expected)':>10} {'(at most)':>9} {'per stream':>11} "
             f"{'(expected)':>10} {'(at most)':>9} {'TTFT s':>7} {'RSS peak':>9}"]
    for name, result in summary["results"].items():
        if "error" in result:
            lines.append(f"{name:10} error: {result['error']}")
            continue
        for run in result["runs"]:
            n = run["streams"]
            figures = summary.get("predicted_llamacpp", {}) if name == "llamacpp" else summary["predicted"]
            predicted = figures.get(n) or figures.get(str(n)) or {}
            lines.append(f"{name:10} {n:>2} {_fmt(run['aggregate_tokens_per_s']):>15} "
                         f"{_fmt(predicted.get('expected_aggregate_tokens_per_s')):>10} "
                         f"{_fmt(predicted.get('aggregate_tokens_per_s')):>9} {_fmt(run['per_stream_tokens_per_s']):>11} "
                         f"{_fmt(predicted.get('expected_per_user_tokens_per_s')):>10} "
                         f"{_fmt(predicted.get('per_user_tokens_per_s')):>9} {_fmt(run['time_to_first_token_s'], '.2f'):>7} "
                         f"{result['rss_peak'] / gib:8.2f}G")
        if name == "engine" and result.get("parallel", 1) < max(summary["streams"]):
            lines.append(f"{'':10} (the engine session decodes {result.get('parallel', 1)} conversation(s) at a time: "
                         "the streams took turns)")
    if summary["turns"]:
        lines.append(f"two conversations of ~{summary['turns']} tokens taking turns: time to first token of each "
                     f"next turn (A, B) against a {_turn_length(summary)}-token conversation from scratch")
        for name, result in summary["results"].items():
            t = result.get("turns")
            if t:
                nxt = t["next_turn_time_to_first_token_s"]
                lines.append(f"{name:10} next turn A {nxt['A']:.2f} s, B {nxt['B']:.2f} s; from scratch "
                             f"{t['scratch_time_to_first_token_s']:.2f} s: {_fmt(t['scratch_over_next_turn'])}x faster")
    r = summary["ratios"]
    if r["engine_over_llamacpp"]:
        lines.append("engine / llama.cpp, together tok/s: " + ", ".join(
            f"{n} stream{'s' if int(n) > 1 else ''} {v:.2f}x" for n, v in r["engine_over_llamacpp"].items()))
    for name, by_n in r["over_one_stream"].items():
        if by_n:
            lines.append(f"{name}: N streams / 1 stream, together tok/s: " + ", ".join(
                f"{n}: {v:.2f}x" for n, v in by_n.items()))
    return "\n".join(lines)


def _turn_length(summary: dict) -> str:
    lengths = [r["turns"]["conversation_tokens"] for r in summary["results"].values() if r.get("turns")]
    return str(max(lengths)) if lengths else "?"


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    """The worker's entry (``--worker``); a person runs ``hybridmoe bench serve``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", choices=BACKENDS, required=True)
    p.add_argument("model")
    p.add_argument("--streams", type=_int_list, required=True)
    p.add_argument("--prompt", type=int, required=True)
    p.add_argument("--tokens", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--turns", type=int, required=True)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    print(json.dumps(run_worker(args.worker, args.model, args.streams, args.prompt, args.tokens, args.threads,
                                args.turns, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
