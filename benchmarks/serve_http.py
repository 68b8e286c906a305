#!/usr/bin/env python
"""N clients of the OpenAI-compatible server streaming at once: their answers against each
one's answer alone, and the aggregate speed.

    python benchmarks/serve_http.py MODEL.gguf [--clients 4] [--tokens 64] [--threads 2]

Starts `hybridmoe serve MODEL --parallel N` (its plan made for N conversations), asks each
client's question alone first (one request at a time, greedy, `ignore_eos` so that every
answer is `--tokens` long), then all N at once, streaming. Prints, per client, whether the
streamed answer is the solo one, and the aggregate tokens/s of the N streams (streamed
pieces, one per token here, after each stream's first, over the time from the first first
token to the last stream's end) beside one stream's. The questions' prompts are in the cache
from the solo round, so the times to first token are those of cached prompts. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

QUESTIONS = [
    "Tell me about the fox and the dog in a few words.",
    "Which numbers come after one, two and three?",
    "Write a short poem about the sea at night.",
    "What is a mixture of experts, in one sentence?",
    "Name three colours of the rainbow.",
    "How do bees make honey?",
    "Say hello in three languages.",
    "Why is the sky blue?",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ask(url: str, question: str, tokens: int, *, stream: bool) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": tokens, "ignore_eos": True, "stream": stream}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    first = None
    pieces = []
    with urllib.request.urlopen(request, timeout=600) as response:
        if not stream:
            answer = json.load(response)
            return {"text": answer["choices"][0]["message"]["content"], "sent": sent, "first": None,
                    "end": time.perf_counter(), "pieces": answer["usage"]["completion_tokens"]}
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter()
                pieces.append(delta)
    return {"text": "".join(pieces), "sent": sent, "first": first, "end": time.perf_counter(), "pieces": len(pieces)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    port = free_port()
    env = {**os.environ, "HYBRIDMOE_CPU_THREADS": str(args.threads)}
    server = subprocess.Popen([sys.executable, "-m", "hybridmoe.app.cli", "serve", "--model", args.model, "--port", str(port),
                               "--parallel", str(args.clients), "--backend", "engine"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    print(server.stdout.read(), file=sys.stderr)
                    return 1
                time.sleep(0.5)
        questions = QUESTIONS[: args.clients]
        ask(url, "warm up", 4, stream=False)
        solo = [ask(url, q, args.tokens, stream=True) for q in questions]
        results: list[dict | None] = [None] * len(questions)
        barrier = threading.Barrier(len(questions))

        def client(i):
            barrier.wait()
            results[i] = ask(url, questions[i], args.tokens, stream=True)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        one = statistics.median((s["pieces"] - 1) / (s["end"] - s["first"]) for s in solo)
        start, end = min(r["first"] for r in results), max(r["end"] for r in results)
        together = sum(r["pieces"] - 1 for r in results) / (end - start)
        same = [r["text"] == s["text"] for r, s in zip(results, solo)]
        print(f"{args.model}: {args.clients} clients streaming at once, {args.tokens} tokens each, "
              f"{args.threads} threads")
        for i, (r, ok) in enumerate(zip(results, same)):
            print(f"  client {i}: time to first token {r['first'] - r['sent']:.2f} s, "
                  f"{'its solo answer' if ok else 'DIFFERS from its solo answer'}")
        print(f"one stream alone: {one:.1f} tokens/s (median); {args.clients} at once: {together:.1f} tokens/s "
              f"together ({together / one:.2f}x)")
        return 0 if all(same) else 1
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
