"""Valid-but-hostile requests and server options: each is a 400 (or a quiet close) or a usage
error naming what is wrong, never a 500 with a traceback in the log."""

from __future__ import annotations

import logging
import re
import socket
import time

import pytest

from hybridmoe.app.cli import main
from hybridmoe.app.server.runner import check_exposure, check_host
from hybridmoe.backend.errors import UsageError
from tests.server.conftest import get, post

LONE_SURROGATE = b'"a\\ud800b"'  # JSON's escape of half a UTF-16 pair: valid JSON, not Unicode text


@pytest.fixture
def server_log(caplog):
    """Every record the server, uvicorn and starlette log while the test runs."""
    caplog.set_level(logging.INFO)
    return caplog


def assert_no_traceback(log) -> None:
    assert not [r for r in log.records if r.exc_info or r.levelno >= logging.ERROR], log.text
    assert "Traceback" not in log.text and "internal error" not in log.text


def assert_error(status: int, answer: dict, expected_status: int, words: str, param: str | None = None) -> None:
    assert status == expected_status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "invalid_request_error" and words in answer["error"]["message"]
    if param is not None:
        assert answer["error"]["param"] == param


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + LONE_SURROGATE + b"}]}",
     "messages[0].content"),
    ("/v1/chat/completions", b'{"stream": true, "messages": [{"role": "user", "content": ' + LONE_SURROGATE + b"}]}",
     "messages[0].content"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": ' + LONE_SURROGATE + b"}]}]}",
     "messages[0].content[0].text"),
    ("/v1/completions", b'{"prompt": ' + LONE_SURROGATE + b"}", "prompt"),
    ("/v1/completions", b'{"stream": true, "prompt": ' + LONE_SURROGATE + b"}", "prompt"),
    ("/v1/completions", b'{"prompt": "Hi", "stop": ["x", "\\udfff"]}', "stop[1]"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, server_log, path, body, param):
    status, _, answer = post(f"{server.url}{path}", body)
    assert_error(status, answer, 400, "lone UTF-16 surrogate", param)
    assert "\\ud800" in answer["error"]["message"] or "\\udfff" in answer["error"]["message"]
    assert_no_traceback(server_log)
    # A surrogate pair, escaped whole, is one character, and welcome.
    status, _, _ = post(f"{server.url}/v1/completions", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert status == 200


def test_json_nested_100000_deep_is_a_400(server, server_log):
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, _, answer = post(f"{server.url}/v1/chat/completions", deep)
    assert_error(status, answer, 400, "nested too deeply")
    # As deep as the parser takes without recursing too far: refused as the wrong shape.
    status, _, answer = post(f"{server.url}/v1/chat/completions", b'{"messages": ' + b"[" * 500 + b"]" * 500 + b"}")
    assert_error(status, answer, 400, "role", "messages[0]")
    assert_no_traceback(server_log)


def test_a_body_shorter_than_its_content_length_is_no_internal_error(server, server_log):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 1000\r\n\r\n" + b'{"messages": [')
        connection.shutdown(socket.SHUT_WR)  # the client goes away with 985 bytes unsent
        answer = b""
        while chunk := connection.recv(65536):
            answer += chunk
    # Either nothing (the connection is gone) or a 400; never a 500.
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer
    deadline = time.monotonic() + 10
    while not server.activity.recent(1) and time.monotonic() < deadline:
        time.sleep(0.05)
    (record,) = server.activity.recent(1)
    assert record.status == 400 and "closed the connection" in record.reason
    assert_no_traceback(server_log)
    assert get(f"{server.url}/health")[0] == 200  # and the server goes on


@pytest.mark.parametrize("host", ["not a host!", "", "-leading.example", "a..b", "300.1.2.3", "x" * 64 + ".example",
                                  "http://127.0.0.1", "127.0.0.1:8000"])
def test_a_host_that_is_no_address_is_refused_as_such(host, capsys, monkeypatch):
    monkeypatch.delenv("HYBRIDMOE_API_KEY", raising=False)
    with pytest.raises(UsageError, match="not an IP address or host name"):
        check_host(host)
    with pytest.raises(UsageError, match="not an IP address or host name"):
        check_exposure(host, "a-key", how_to_set_key="")
    assert main(["serve", "-m", "/no/such/model", f"--host={host}"]) == 2
    err = capsys.readouterr().err
    assert f"not an IP address or host name: {host!r}" in err and "API key" not in err and "Traceback" not in err


def test_a_host_name_that_does_not_resolve_is_unknown_not_public(capsys, monkeypatch):
    monkeypatch.delenv("HYBRIDMOE_API_KEY", raising=False)
    assert main(["serve", "-m", "/no/such/model", "--host", "no-such-host.invalid"]) == 2  # .invalid: RFC 2606
    err = capsys.readouterr().err
    assert "cannot listen on no-such-host.invalid" in err and "the host is unknown" in err and "API key" not in err


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "0.0.0.0", "::", "fe80::1%1"])
def test_addresses_and_names_pass_the_host_check(host):
    check_host(host)


def test_a_prompt_of_megabytes_is_refused_before_it_is_tokenized(server, monkeypatch):
    """Three chat requests of 3.9 MB (under the body limit) to a 256-token context took 16-24 s
    each to be refused, the prompt tokenized whole (2.6 M ids) first, and held the memory: now
    the text's length alone refuses them, and nothing that long reaches the tokenizer."""
    from concurrent.futures import ThreadPoolExecutor

    from hybridmoe.backend.text.tokenizer import Tokenizer

    tokenized = []
    encode_prompt = Tokenizer.encode_prompt
    monkeypatch.setattr(Tokenizer, "encode_prompt", lambda self, text: tokenized.append(len(text)) or encode_prompt(self, text))
    body = {"messages": [{"role": "user", "content": "ab " * 1_300_000}], "max_tokens": 4}
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: post(f"{server.url}/v1/chat/completions", body), range(3)))
    for status, _, error in answers:
        assert status == 400, error
        assert re.match(r"the prompt is at least [\d,]+ tokens \(3,900,\d+ characters\), the context holds 256",
                        error["error"]["message"]), error
    assert all(n < 100_000 for n in tokenized), tokenized
    status, _, answer = post(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                    "max_tokens": 2})
    assert status == 200, answer  # and the server goes on answering
