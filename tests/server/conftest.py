"""The API server on the real engine and the tiny real chat model (tests/conftest.py), on an
ephemeral port of 127.0.0.1, talked to with the official openai client.

One engine session serves the whole package (loading it is the slow part); each test starts
the servers it needs (milliseconds) with the limits it wants.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from hybridmoe.app.server.http import ServerOptions
from hybridmoe.app.server.runner import ApiServer
from hybridmoe.app.server.shared_session import SharedSession
from hybridmoe.backend.text.sampling import SamplingParams
from hybridmoe.backend.session import Done, Message
from tests.llamacpp.conftest import checkpoint_dirs, ggufs  # noqa: F401 - tiny GGUFs for the llama.cpp tests

CHAT = [Message("system", "Be brief."), Message("user", "Hello there, how are you?")]
MODEL_ID = "tiny-qwen3-moe"
CONTEXT = 256
TOKENS_LIMIT = 200


def plan_for(path, context=CONTEXT):
    from hybridmoe.backend.hardware.presets import preset
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    model = inspect_model(path)
    return make(model.spec, model.inventory, preset("cpu-only"), Workload(context=context))


@pytest.fixture(scope="package")
def shared(tiny_chat_model):
    from hybridmoe.backend.engine.session import EngineBackend

    session = SharedSession(EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model)))
    yield session
    session.close()


@pytest.fixture
def start_server(shared):
    """start_server(**options) -> a running ApiServer on the shared session (stopped after the test)."""
    servers = []

    def start(session=None, host="127.0.0.1", **options):
        options = {"model_id": MODEL_ID, "max_tokens_limit": TOKENS_LIMIT, **options}
        server = ApiServer(session or shared, ServerOptions(**options), host, 0)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server):
    return start_server()


def client_for(server, api_key="unused", **kwargs):
    from openai import OpenAI

    # No retries: a test sees each answer, 429s included, as the server gave it.
    return OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)


@pytest.fixture
def client(server):
    return client_for(server)


def direct(shared, messages=CHAT, prompt=None, **sampling) -> Done:
    """What the session itself answers, without the server: the reference for the server's answers."""
    params = SamplingParams(**{"temperature": 0, "max_tokens": 16, **sampling})
    events = shared.complete(prompt, params) if prompt is not None else shared.generate(messages, params)
    return list(events)[-1]


def as_openai(messages) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in messages]


def post(url: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of a POST, error statuses included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def serve_process(model, tmp_path, *args) -> tuple[subprocess.Popen, queue.Queue]:
    """`hybridmoe serve -m MODEL --port 0 ARGS` in a process of its own with its own config
    and data folders; its stderr lines arrive on the queue."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.update({var: str(tmp_path / var.lower()) for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME",
                                                                "XDG_CACHE_HOME")})
    process = subprocess.Popen([sys.executable, "-m", "hybridmoe.app.cli", "serve", "-m", str(model), "--port", "0",
                                *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    return process, lines


def until_serving(process: subprocess.Popen, lines: queue.Queue, timeout: float = 120) -> list[str]:
    """The server's stderr lines up to the one saying where it serves (within `timeout`)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not any("Serving" in line for line in seen):
        assert process.poll() is None, "".join(seen)
        assert time.monotonic() < deadline, "".join(seen)
        try:
            seen.append(lines.get(timeout=1))
        except queue.Empty:
            pass
    return seen
