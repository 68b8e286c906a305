"""Whatever a client sends, the server answers in the OpenAI error shape and keeps serving."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import CONTEXT, MODEL_ID, client_for, get, post

HELLO = [{"role": "user", "content": "Hello"}]


def error_of(server, body, path="/v1/chat/completions", headers=None):
    status, _, answer = post(f"{server.url}{path}", body, headers)
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    return status, answer["error"]


@pytest.mark.parametrize("body, param, words", [
    (b'{"messages": [', None, "not valid JSON"),
    (b"\xff\xfe", None, "not UTF-8"),
    (b"[1, 2]", None, "must be a JSON object"),
    ({"messages": "Hello"}, "messages", "non-empty array"),
    ({"messages": []}, "messages", "non-empty array"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "one of system, user, assistant"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or an array of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "only text parts"),
    ({"messages": HELLO, "max_tokens": "ten"}, "max_tokens", "whole number"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"messages": HELLO, "max_tokens": 201}, "max_tokens", "at most 200"),
    ({"messages": HELLO, "max_completion_tokens": 10_000}, "max_completion_tokens", "at most 200"),
    ({"messages": HELLO, "temperature": "hot"}, "temperature", "must be a number"),
    ({"messages": HELLO, "temperature": 3}, "temperature", "at most 2"),
    ({"messages": HELLO, "top_p": 0}, "top_p", "above 0"),
    ({"messages": HELLO, "seed": 1.5}, "seed", "whole number"),
    ({"messages": HELLO, "stream": "yes"}, "stream", "true or false"),
    ({"messages": HELLO, "stop": 7}, "stop", "string or an array of strings"),
    ({"messages": HELLO, "n": 2}, "n", "one answer per request"),
    ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools", "not supported"),
    ({"messages": HELLO, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"messages": HELLO, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", "true or false"),
])
def test_malformed_requests_get_400_naming_the_field(server, body, param, words):
    status, error = error_of(server, body)
    assert status == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": "Hi", "echo": True}, "echo", "not supported"),
    ({"prompt": "Hi", "max_tokens": -1}, "max_tokens", "at least 1"),
])
def test_malformed_completion_requests_get_400(server, body, param, words):
    status, error = error_of(server, body, "/v1/completions")
    assert status == 400 and error["param"] == param and words in error["message"]


def test_an_oversized_body_is_refused_and_the_server_goes_on(start_server):
    server = start_server(max_body_bytes=16 * 1024)
    body = json.dumps({"messages": [{"role": "user", "content": "x" * 20_000}]}).encode()
    status, error = error_of(server, body)
    assert status == 413 and "16,384 bytes" in error["message"]
    status, _, answer = post(f"{server.url}/v1/chat/completions", {"messages": HELLO, "max_tokens": 2})
    assert status == 200


def test_a_prompt_longer_than_the_context_is_a_400_saying_so(server):
    status, error = error_of(server, {"messages": [{"role": "user", "content": "word " * CONTEXT}], "max_tokens": 4})
    assert status == 400 and f"the context holds {CONTEXT}" in error["message"]


def test_unknown_paths_and_methods_answer_in_the_same_shape(server):
    status, answer = get(f"{server.url}/v1/nothing-here")
    assert status == 404 and "no such endpoint" in answer["error"]["message"]
    status, answer = get(f"{server.url}/v1/chat/completions")
    assert status == 405
    status, answer = get(f"{server.url}/v1/models/another-model")
    assert status == 404 and answer["error"]["code"] == "model_not_found"


def test_the_openai_client_raises_its_bad_request_error(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="at most 200"):
        client.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=1000)


def test_an_api_key_is_required_when_set_and_the_server_is_reachable_from_outside(start_server):
    from openai import AuthenticationError

    server = start_server(host="0.0.0.0", api_key="right-key")
    assert server.url.startswith("http://127.0.0.1:")  # reachable here through loopback too
    for key in (None, "wrong-key"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        status, error = error_of(server, {"messages": HELLO, "max_tokens": 2}, headers=headers)
        assert status == 401 and error["code"] == "invalid_api_key"
    with pytest.raises(AuthenticationError):
        client_for(server, api_key="wrong-key").models.list()
    right = client_for(server, api_key="right-key")
    answer = right.chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=2)
    assert answer.usage.completion_tokens == 2
    assert get(f"{server.url}/health")[0] == 200  # liveness checks need no key
