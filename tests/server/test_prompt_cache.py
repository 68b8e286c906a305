"""Through the API server, a request whose prompt the model's cache already holds gets the
answer, and its prompt the logits, of a fresh prefill (issue 15, item 4), on quantized GGUF
files: the same chat request twice, and interleaved with other requests.

The tolerance and why the cached path used to differ: tests/engine/test_prompt_cache.py.
"""

from __future__ import annotations

import pytest

from hybridmoe.app.server.shared_session import SharedSession
from tests.convert.conftest import checkpoints, converted  # noqa: F401 - fixtures: tiny GGUFs
from tests.engine.test_prompt_cache import (
    CHAT,
    OTHER,
    QUANTS,
    assert_same_logits,
    fresh_answer,
    load,
    recorded_prefill_logits,
)
from tests.server.conftest import as_openai, post


@pytest.mark.parametrize("quant", QUANTS)
def test_repeated_and_interleaved_requests_get_the_fresh_answers(start_server, converted, quant):  # noqa: F811
    path = converted("qwen3_moe", quant)
    expected = {id(m): fresh_answer(path, m) for m in (CHAT, OTHER)}
    shared = SharedSession(load(path))
    order = [CHAT, CHAT, OTHER, CHAT, OTHER, OTHER]
    try:
        server = start_server(shared)
        with recorded_prefill_logits() as logits:
            for messages in order:
                status, _, body = post(f"{server.url}/v1/chat/completions", {
                    "messages": as_openai(messages), "temperature": 0, "max_tokens": 12})
                assert status == 200, body
                assert body["choices"][0]["message"]["content"] == expected[id(messages)][1].text
    finally:
        shared.close()
    assert len(logits) == len(order)
    for messages, cached in zip(order, logits):
        assert_same_logits(cached, expected[id(messages)][0])


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_follow_up_turn_gets_the_same_answer_whatever_the_server_cached(start_server, tiny_chat_model, parallel):
    """#48 item 3 through the API: turn 1, turn 2, six unrelated requests, turn 2 again, with
    one and two conversations' caches: turn 2's answer both times is a fresh session's (the
    tolerance of the logits: tests/engine/test_prompt_cache.py)."""
    from tests.engine.test_prompt_cache import engine_session

    def ask(server, messages) -> str:
        status, _, body = post(f"{server.url}/v1/chat/completions", {
            "messages": as_openai(messages), "temperature": 0, "max_tokens": 40})
        assert status == 200, body
        return body["choices"][0]["message"]["content"]

    from hybridmoe.backend.session import Message

    turn1 = [Message("user", "What runs on the CPU?")]
    shared = SharedSession(engine_session(tiny_chat_model, parallel))
    try:
        server = start_server(shared)
        turn2 = [*turn1, Message("assistant", ask(server, turn1)), Message("user", "and the GPU?")]
        first = ask(server, turn2)
        for i in range(6):
            ask(server, [Message("user", f"Unrelated question {i}: why is the sky blue?")])
        again = ask(server, turn2)
    finally:
        shared.close()
    fresh = SharedSession(engine_session(tiny_chat_model, parallel))
    try:
        expected = ask(start_server(fresh), turn2)
    finally:
        fresh.close()
    assert first == again == expected
