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
