"""`hybridmoe serve` as a user runs it: the checks before loading, and a whole run in a
subprocess (start, answer a request, Ctrl-C)."""

from __future__ import annotations

import re
import signal
import socket
import time

import pytest

from hybridmoe.app.cli import main
from hybridmoe.app.server.runner import bind_socket, check_exposure, is_loopback
from hybridmoe.backend.errors import HybridMoeError, UsageError
from tests.server.conftest import get, post, serve_process, until_serving


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("192.168.1.5", False),
                                            ("::", False), ("myhost.example", False)])
def test_which_hosts_only_this_machine_reaches(host, loopback):
    assert is_loopback(host) is loopback


def test_a_public_address_needs_an_api_key(capsys, monkeypatch):
    monkeypatch.delenv("HYBRIDMOE_API_KEY", raising=False)
    assert main(["serve", "-m", "/no/such/model", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "the host 0.0.0.0 lets other machines reach the server, but no API key is set" in err
    assert "--api-key" in err and "HYBRIDMOE_API_KEY" in err
    check_exposure("0.0.0.0", "a-key", how_to_set_key="")  # with a key it may
    check_exposure("127.0.0.1", None, how_to_set_key="")  # and loopback needs none
    # the key from the environment counts: the run gets as far as the model
    monkeypatch.setenv("HYBRIDMOE_API_KEY", "from-the-environment")
    assert main(["serve", "-m", "/no/such/model", "--host", "0.0.0.0"]) == 1
    assert "/no/such/model does not exist" in capsys.readouterr().err


def test_a_port_in_use_is_one_clear_error_before_loading(tiny_chat_model, capsys, monkeypatch):
    import hybridmoe.backend.backends

    loads = []
    monkeypatch.setattr(hybridmoe.backend.backends, "load_session", lambda *args, **kwargs: loads.append(args))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(HybridMoeError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            bind_socket("127.0.0.1", port)
        assert main(["serve", "-m", str(tiny_chat_model), "--port", str(port), "--context", "256"]) == 1
    err = capsys.readouterr().err
    assert f"hybridmoe: error: cannot listen on 127.0.0.1:{port}: the port is in use" in err
    assert "--port" in err and "Traceback" not in err
    assert loads == []  # refused before the model loads (minutes, for a large one)
    with pytest.raises(UsageError, match="not one of this machine's"):
        bind_socket("192.0.2.1", 0)  # TEST-NET-1: documentation only, on no machine


def test_serve_answers_requests_and_stops_cleanly_on_ctrl_c(tiny_chat_model, tmp_path):
    process, lines = serve_process(tiny_chat_model, tmp_path, "--context", "256", "--max-tokens-limit", "32")
    seen = []
    try:
        seen = until_serving(process, lines)
        url = re.search(r"at (http://\S+)/v1 ", seen[-1]).group(1)
        assert url.startswith("http://127.0.0.1:")
        assert get(f"{url}/health")[1]["status"] == "ok"
        # Greedy: a sampled answer (the API's default temperature is 1) may end at EOS before 5 tokens.
        status, _, answer = post(f"{url}/v1/chat/completions",
                                 {"model": "any", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5,
                                  "temperature": 0})
        assert status == 200 and answer["usage"]["completion_tokens"] == 5
        assert answer["model"] == tiny_chat_model.name
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
    time.sleep(0.1)
    while not lines.empty():
        seen.append(lines.get())
    log = "".join(seen)
    assert "/v1/chat/completions 200 length" in log and "5 tokens" in log
    assert "server stopped after 1 requests" in log and "Traceback" not in log
    assert process.stdout.read() == ""  # stdout stays clean
