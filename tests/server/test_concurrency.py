"""Several clients at once on one session: each gets the answer it would get alone, a client
that leaves stops its generation, and beyond the queue's bound the server says when to retry."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridmoe.app.server.shared_session import QueueFull, SharedSession
from hybridmoe.backend.session import CancelToken, Done, Message, Stats, TextPiece
from tests.server.conftest import MODEL_ID, TOKENS_LIMIT, client_for, direct, post

QUESTIONS = ["Hello there, how are you?", "What is a mixture of experts?", "Count to five.", "Name a colour."]


def until(condition, timeout=30.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_concurrent_clients_each_get_their_own_answer(server, shared):
    alone = {q: direct(shared, [Message("user", q)], max_tokens=8).text for q in QUESTIONS}
    client = client_for(server)

    def ask(question, stream):
        messages = [{"role": "user", "content": question}]
        if stream:
            chunks = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8, temperature=0,
                                                    stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=8,
                                              temperature=0).choices[0].message.content

    completed_before = shared.counts().completed
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(ask, QUESTIONS, [i % 2 == 0 for i in range(len(QUESTIONS))]))
    assert answers == [alone[q] for q in QUESTIONS]
    # A client can have its whole answer a moment before the queue books its job as done.
    until(lambda: shared.counts().completed == completed_before + len(QUESTIONS), what="every job completed")
    assert shared.counts().running == 0


def test_a_client_leaving_mid_stream_stops_its_generation(server, shared):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Go on and on."}], "stream": True,
            "max_tokens": TOKENS_LIMIT, "temperature": 0}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    received = 0
    while received < 3:  # the role chunk and two pieces of text
        if response.fp.readline().startswith(b"data: "):
            received += 1
    connection.sock.shutdown(2)  # the client goes away mid-answer
    connection.close()

    until(lambda: server.activity.recent(), what="the request to be recorded")
    gone = server.activity.recent()[-1]
    assert gone.reason == "cancelled"
    assert 2 <= gone.completion_tokens < TOKENS_LIMIT  # the engine noticed within a few tokens
    assert server.activity.in_progress == 0 and shared.counts().running == 0
    # and the session is free for the next client at once
    status, _, answer = post(f"{server.url}/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
    assert status == 200 and answer["usage"]["completion_tokens"] == 4


def test_a_client_leaving_before_a_whole_answer_stops_its_generation(server, shared):
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"messages": [{"role": "user", "content": "Take your time."}], "max_tokens": TOKENS_LIMIT}
    finished_before = server.activity.finished_count
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    until(lambda: shared.counts().running == 1, what="the generation to start")
    connection.sock.shutdown(2)
    connection.close()
    until(lambda: server.activity.finished_count > finished_before, what="the request to be recorded")
    gone = server.activity.recent()[-1]
    assert gone.reason == "cancelled" and gone.completion_tokens < TOKENS_LIMIT


class BlockingSession:
    """A session whose generations wait for a gate: the queue's timing in the test's hands.
    (Only this edge is faked; the engine cannot be paused on cue.)"""

    max_parallel = 1

    def __init__(self):
        self.gate = threading.Event()
        self.started: list[str] = []

    def generate(self, messages, sampling, cancel=None):
        self.started.append(messages[-1].content)
        while not self.gate.wait(0.01):
            if cancel is not None and cancel.cancelled:
                break
        reason = "cancelled" if cancel is not None and cancel.cancelled else "stop"
        yield TextPiece("ok")
        yield Done(reason, "ok", (1,), Stats(3, 1, 0.0, None, None))

    def complete(self, prompt, sampling, cancel=None):
        return self.generate([Message("user", prompt)], sampling, cancel)

    def close(self):
        pass


def test_beyond_the_bounded_queue_requests_get_429_with_retry_after(start_server):
    blocking = BlockingSession()
    server = start_server(SharedSession(blocking), max_queue=1)
    body = {"messages": [{"role": "user", "content": "wait"}], "max_tokens": 4}
    url = f"{server.url}/v1/chat/completions"
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(post, url, body)
        until(lambda: blocking.started, what="the first request to run")
        # a waiting client that leaves gives up its place at once
        leaving = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        leaving.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        until(lambda: server.shared.counts().waiting == 1, what="a request to wait")
        leaving.sock.shutdown(2)
        leaving.close()
        until(lambda: server.shared.counts().waiting == 0, what="the leaving request to give up its place")

        waiting = pool.submit(post, url, body)
        until(lambda: server.shared.counts().waiting == 1, what="the second request to wait")
        status, headers, refused = post(url, body)
        assert status == 429
        assert int(headers["retry-after"]) >= 1
        assert refused["error"]["code"] == "rate_limit_exceeded" and "busy" in refused["error"]["message"]
        from openai import RateLimitError

        with pytest.raises(RateLimitError):
            client_for(server).chat.completions.create(model=MODEL_ID, messages=body["messages"])
        blocking.gate.set()
        assert running.result()[0] == 200 and waiting.result()[0] == 200
    assert server.shared.counts().completed == 2
    recorded = server.activity.recent()
    assert sorted((r.status, r.reason) for r in recorded if r.status == 200) == [
        (200, "cancelled"), (200, "stop"), (200, "stop")]
    assert [r.status for r in recorded].count(429) == 2


def test_the_queue_serves_in_arrival_order_and_a_cancelled_waiter_leaves_it():
    blocking = BlockingSession()
    shared = SharedSession(blocking)
    answers: dict[str, Done] = {}

    def ask(text, cancel=None):
        answers[text] = list(shared.generate([Message("user", text)], None, cancel))[-1]

    threads = []
    leaving = CancelToken()
    for n, text in enumerate(["first", "second", "leaves", "third"]):
        threads.append(threading.Thread(target=ask, args=(text, leaving if text == "leaves" else None)))
        threads[-1].start()
        until(lambda: shared.counts().running + shared.counts().waiting == n + 1, what=f"{text} to queue")
    leaving.cancel()
    until(lambda: "leaves" in answers, what="the cancelled waiter to leave")
    assert answers["leaves"].reason == "cancelled" and shared.counts().waiting == 2
    blocking.gate.set()
    for thread in threads:
        thread.join(10)
    assert blocking.started == ["first", "second", "third"]
    assert shared.counts() == type(shared.counts())(waiting=0, running=0, completed=3)


class _Clock:
    """The shared session's clock, moved by the test: durations it measures are the test's."""

    now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_retry_after_grows_with_the_queue_and_the_recent_durations(monkeypatch):
    from hybridmoe.app.server import shared_session

    clock = _Clock()
    monkeypatch.setattr(shared_session, "time", clock)
    blocking = BlockingSession()
    shared = SharedSession(blocking)
    blocking.gate.set()
    with shared.turn():
        clock.now += 0.3  # a known duration for the estimate
    blocking.gate.clear()
    holder = threading.Thread(target=lambda: list(shared.generate([Message("user", "hold")], None)))
    holder.start()
    until(lambda: shared.counts().running == 1, what="the turn to start")
    waiters = [threading.Thread(target=lambda: list(shared.generate([Message("user", "wait")], None)))
               for _ in range(3)]
    for w in waiters:
        w.start()
    until(lambda: shared.counts().waiting == 3, what="three waiting")
    with pytest.raises(QueueFull) as refused:
        with shared.turn(max_waiting=3):
            pass
    assert refused.value.retry_after_s == 2  # 4 ahead x 0.3 s, rounded up
    blocking.gate.set()
    for t in [holder, *waiters]:
        t.join(10)


def test_a_closed_session_refuses_new_turns():
    shared = SharedSession(BlockingSession())
    shared.close()
    from hybridmoe.backend.errors import ModelError

    with pytest.raises(ModelError, match="unloaded"):
        with shared.turn():
            pass


def test_stopping_the_server_ends_the_answers_in_progress(start_server):
    blocking = BlockingSession()  # never opens its gate: only a cancel ends its generation
    server = start_server(SharedSession(blocking))
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"messages": [{"role": "user", "content": "forever"}], "stream": True}
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    until(lambda: blocking.started, what="the generation to start")
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    response = connection.getresponse()
    events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
    stopper.join(60)  # only bounds a failing test: a stop that waited for the answer would hang
    assert not stopper.is_alive()
    assert json.loads(events[-1].removeprefix("data: "))["error"]["message"] == "the server is stopping"
    assert not server.running


def test_closing_while_a_turn_runs_closes_the_session_when_it_ends():
    closed = []
    blocking = BlockingSession()
    blocking.close = lambda: closed.append(True)
    shared = SharedSession(blocking)
    holder = threading.Thread(target=lambda: list(shared.generate([Message("user", "hold")], None)))
    holder.start()
    until(lambda: shared.counts().running == 1, what="the turn to start")
    shared.close()  # returns at once
    assert closed == [] and shared.closed
    blocking.gate.set()
    holder.join(10)
    assert closed == [True]


def test_a_running_turn_holds_the_process_turn_and_waiters_do_not():
    """Behind the TUI the shared session also takes the process's turn for model work, once
    its queue turn has come: a bandwidth probe meanwhile is told the model is busy, and a
    chat answer waiting in the queue holds nothing (so the two locks can never deadlock)."""
    from hybridmoe.app.services import Services

    services = Services()
    blocking = BlockingSession()
    shared = SharedSession(blocking, hold=lambda cancel: services.model_turn("an answer", cancel=cancel))
    first = threading.Thread(target=lambda: list(shared.generate([Message("user", "first")], None)))
    second = threading.Thread(target=lambda: list(shared.generate([Message("user", "second")], None)))
    first.start()
    until(lambda: blocking.started == ["first"], what="the first answer to run")
    second.start()
    until(lambda: shared.counts().waiting == 1, what="the second answer to wait")
    with services.model_turn("measuring the memory bandwidth", wait=False) as busy_with:
        assert busy_with == "an answer"
    blocking.gate.set()
    first.join(10)
    second.join(10)
    with services.model_turn("measuring the memory bandwidth", wait=False) as busy_with:
        assert busy_with == ""  # both answers ended: the turn is free again
