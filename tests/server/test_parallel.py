"""Several generations at once on one session (issue 17): up to ``parallel`` run together,
the others wait in the same fair queue, and the TUI's process-wide turn for model work is
shared by the answers but never by a benchmark or a bandwidth measurement.

The queue's timing is driven by a session whose generations wait for a gate (the engine
cannot be paused on cue); the HTTP server, the queue and the turns are real. The last test
serves two streaming clients at once from the real engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridmoe.app.server.shared_session import QueueFull, SharedSession
from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.session import CancelToken, Done, Message, Stats, TextPiece
from tests.server.conftest import MODEL_ID, client_for, get, post
from tests.server.test_concurrency import until

BODY = {"messages": [{"role": "user", "content": "wait"}], "max_tokens": 4}


class GatedSession:
    """Runs ``max_parallel`` generations at once; each waits for the gate, and the session
    records how many were inside it together."""

    def __init__(self, max_parallel: int):
        self.max_parallel = max_parallel
        self.gate = threading.Event()
        self.started: list[str] = []
        self.inside = 0
        self.most_inside = 0
        self.closed = False
        self._lock = threading.Lock()

    def generate(self, messages, sampling, cancel=None):
        with self._lock:
            self.started.append(messages[-1].content)
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            while not self.gate.wait(0.01):
                if cancel is not None and cancel.cancelled:
                    break
            yield TextPiece("ok")
            reason = "cancelled" if cancel is not None and cancel.cancelled else "stop"
            yield Done(reason, "ok", (1,), Stats(3, 1, 0.0, None, None))
        finally:
            with self._lock:
                self.inside -= 1

    def complete(self, prompt, sampling, cancel=None):
        return self.generate([Message("user", prompt)], sampling, cancel)

    def close(self):
        self.closed = True


def ask(shared, text, cancel=None) -> Done:
    return list(shared.generate([Message("user", text)], None, cancel))[-1]


# ---- the queue -----------------------------------------------------------------------------------


def test_parallel_defaults_to_what_the_session_runs_at_once_and_no_more_is_allowed():
    assert SharedSession(GatedSession(3)).parallel == 3
    assert SharedSession(GatedSession(3), parallel=2).parallel == 2
    assert SharedSession(GatedSession(1)).parallel == 1  # llama.cpp's one at a time
    for wrong in (0, 4):
        with pytest.raises(ValueError, match=f"parallel must be 1 to 3.*not {wrong}"):
            SharedSession(GatedSession(3), parallel=wrong)


def test_up_to_parallel_generations_run_together_in_arrival_order_and_the_rest_wait():
    session = GatedSession(2)
    shared = SharedSession(session)
    answers: dict[str, Done] = {}
    leaving = CancelToken()
    threads = []
    for n, text in enumerate(["first", "second", "third", "leaves", "fourth"]):
        cancel = leaving if text == "leaves" else None
        threads.append(threading.Thread(target=lambda t=text, c=cancel: answers.__setitem__(t, ask(shared, t, c))))
        threads[-1].start()
        until(lambda: shared.counts().running + shared.counts().waiting == n + 1, what=f"{text} to queue")
    assert shared.counts().running == 2 and shared.counts().waiting == 3
    assert session.started == ["first", "second"] and session.most_inside == 2
    leaving.cancel()  # a waiter that gives up leaves the queue, and nothing reaches the session
    until(lambda: "leaves" in answers, what="the cancelled waiter to leave")
    assert answers["leaves"].reason == "cancelled" and shared.counts().waiting == 2
    session.gate.set()
    for thread in threads:
        thread.join(10)
    assert session.started == ["first", "second", "third", "fourth"]
    assert session.most_inside == 2  # never more than the session runs at once
    assert shared.counts() == type(shared.counts())(waiting=0, running=0, completed=4)


def test_parallel_below_the_sessions_own_runs_that_many():
    session = GatedSession(4)
    shared = SharedSession(session, parallel=1)
    threads = [threading.Thread(target=ask, args=(shared, text)) for text in ("one", "two")]
    for thread in threads:
        thread.start()
    until(lambda: shared.counts().waiting == 1, what="the second to wait")
    assert shared.counts().running == 1 and session.started == ["one"]
    session.gate.set()
    for thread in threads:
        thread.join(10)
    assert session.most_inside == 1


def test_the_retry_estimate_counts_the_places():
    session = GatedSession(2)
    shared = SharedSession(session)
    session.gate.set()
    with shared.turn():
        time.sleep(0.4)  # a known duration for the estimate
    session.gate.clear()
    threads = [threading.Thread(target=ask, args=(shared, f"q{n}")) for n in range(4)]
    for n, thread in enumerate(threads):
        thread.start()
        until(lambda: shared.counts().running + shared.counts().waiting == n + 1, what=f"q{n} to queue")
    with pytest.raises(QueueFull) as refused:
        with shared.turn(max_waiting=2):
            pass
    # 2 running and 2 waiting at 0.4 s each, two at a time (more on a busy machine): rounded up
    assert 1 <= refused.value.retry_after_s <= 2
    with pytest.raises(QueueFull):  # nobody may jump a queue, even with no bound but zero
        with shared.turn(max_waiting=0):
            pass
    session.gate.set()
    for thread in threads:
        thread.join(10)
    with shared.turn(max_waiting=0):  # with a place free and nobody waiting, no bound refuses
        pass


def test_closing_while_several_run_closes_the_session_when_the_last_ends():
    session = GatedSession(2)
    shared = SharedSession(session)
    stop_one = CancelToken()
    threads = [threading.Thread(target=ask, args=(shared, "one", stop_one)),
               threading.Thread(target=ask, args=(shared, "two"))]
    for thread in threads:
        thread.start()
    until(lambda: shared.counts().running == 2, what="both to run")
    shared.close()  # returns at once
    assert shared.closed and not session.closed
    with pytest.raises(ModelError, match="unloaded"):
        with shared.turn():
            pass
    stop_one.cancel()
    threads[0].join(10)
    assert shared.counts().running == 1 and not session.closed  # the other one still uses it
    session.gate.set()
    threads[1].join(10)
    assert session.closed


# ---- over HTTP ---------------------------------------------------------------------------------------


def test_the_server_answers_parallel_requests_at_once_and_queues_the_rest(start_server):
    session = GatedSession(2)
    server = start_server(SharedSession(session), max_queue=1)
    url = f"{server.url}/v1/chat/completions"
    with ThreadPoolExecutor(3) as pool:
        answered = [pool.submit(post, url, {**BODY, "messages": [{"role": "user", "content": f"r{n}"}]})
                    for n in range(2)]
        until(lambda: server.shared.counts().running == 2, what="two requests to run")
        waiting = pool.submit(post, url, BODY)
        until(lambda: server.shared.counts().waiting == 1, what="the third to wait")
        assert len(session.started) == 2  # the third did not reach the session
        status, headers, refused = post(url, BODY)  # both places taken, the queue full: 429
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert refused["error"]["code"] == "rate_limit_exceeded"
        assert get(f"{server.url}/health")[1] == {
            "status": "ok", "model": MODEL_ID, "waiting": 1, "running": 2, "completed": 0}
        session.gate.set()
        assert [future.result()[0] for future in [*answered, waiting]] == [200, 200, 200]
    assert session.most_inside == 2
    assert server.shared.counts().completed == 3


# ---- the process's turn for model work ---------------------------------------------------------------


def test_answers_share_the_process_turn_and_a_benchmark_waits_for_all_of_them():
    """Behind the TUI each running answer holds the process's turn, shared: two answers run
    together, a bandwidth probe is told the model is busy, a benchmark waits until both
    have ended, and an answer that comes after the benchmark began waiting runs after it
    (a stream of requests cannot keep the benchmark waiting for ever), with no deadlock."""
    from hybridmoe.app.services import Services

    services = Services()
    session = GatedSession(3)
    shared = SharedSession(session, hold=lambda cancel: services.model_turn("an answer", cancel=cancel,
                                                                           shared=True))
    answers = [threading.Thread(target=ask, args=(shared, text)) for text in ("a", "b")]
    for thread in answers:
        thread.start()
    until(lambda: session.most_inside == 2, what="both answers to run together")
    with services.model_turn("measuring the memory bandwidth", wait=False) as busy_with:
        assert busy_with == "an answer"

    heard: list[str] = []
    seen_by_benchmark: list[tuple[int, list[str]]] = []

    def benchmark():
        with services.model_turn("a benchmark", on_wait=heard.append):
            seen_by_benchmark.append((session.inside, list(session.started)))

    bench = threading.Thread(target=benchmark)
    bench.start()
    until(lambda: heard == ["an answer"], what="the benchmark to wait")
    late = threading.Thread(target=ask, args=(shared, "late"))
    late.start()
    # The late answer has its place in the queue, but the benchmark goes first.
    until(lambda: shared.counts().running == 3, what="the late answer's place")
    time.sleep(0.2)
    assert sorted(session.started) == ["a", "b"] and seen_by_benchmark == []
    session.gate.set()
    for thread in [*answers, bench, late]:
        thread.join(10)
        assert not thread.is_alive()
    inside, started = seen_by_benchmark[0]
    assert inside == 0 and sorted(started) == ["a", "b"]  # alone, and before the late answer
    assert session.started[2:] == ["late"]
    with services.model_turn("measuring the memory bandwidth", wait=False) as busy_with:
        assert busy_with == ""  # all of them ended: the turn is free again


# ---- the real engine ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_for_two(tiny_chat_model):
    """The tiny model on the engine, planned for two conversations at once."""
    from hybridmoe.backend.engine.session import EngineBackend
    from hybridmoe.backend.hardware.presets import preset
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    model = inspect_model(tiny_chat_model)
    plan = make(model.spec, model.inventory, preset("cpu-only"), Workload(context=256, users=2))
    session = EngineBackend().load(tiny_chat_model, plan)
    yield session
    session.close()


def test_two_streaming_clients_of_the_engine_run_at_once_and_get_their_solo_answers(engine_for_two, start_server):
    from hybridmoe.backend.text.sampling import SamplingParams

    questions = ["Tell me a long story about the sea.", "List every colour you know, slowly."]
    greedy = SamplingParams(temperature=0, max_tokens=48)
    alone = {q: list(engine_for_two.generate([Message("user", q)], greedy))[-1].text for q in questions}
    shared = SharedSession(engine_for_two)
    assert shared.parallel == 2  # the plan's users
    server = start_server(shared)
    client = client_for(server)
    most_running = 0
    finished = threading.Event()

    def watch():
        nonlocal most_running
        while not finished.is_set():
            most_running = max(most_running, shared.counts().running)
            time.sleep(0.0005)

    def stream(question):
        chunks = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": question}],
                                                max_tokens=48, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(stream, questions))
    finally:
        finished.set()
        watcher.join(10)
    assert answers == [alone[q] for q in questions]
    assert most_running == 2
