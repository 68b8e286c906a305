"""`hybridmoe serve --parallel N`: more than the plan's KV cache holds, or more than the
backend runs at once, is refused with one message and exit code 2; the startup line says
how many requests are answered at once."""

from __future__ import annotations

import re
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridmoe.app.cli import main
from tests.server.conftest import CONTEXT, post, serve_process, until_serving


def saved_plan(path, tmp_path, users: int, backend: str = "auto"):
    from hybridmoe.backend.hardware.presets import preset
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    model = inspect_model(path)
    plan = make(model.spec, model.inventory, preset("cpu-only"), Workload(context=CONTEXT, users=users, backend=backend))
    return plan.save(tmp_path / f"plan-{users}-{backend}.toml")


@pytest.fixture
def loads(monkeypatch):
    """The sessions loaded (the checks must come before a load, which takes minutes for a large model)."""
    import hybridmoe.backend.backends

    loaded = []
    original = hybridmoe.backend.backends.load_session
    monkeypatch.setattr(hybridmoe.backend.backends, "load_session",
                        lambda *args, **kwargs: loaded.append(args) or original(*args, **kwargs))
    return loaded


def test_more_than_the_plans_conversations_is_refused_before_loading(tiny_chat_model, tmp_path, capsys, loads):
    plan = saved_plan(tiny_chat_model, tmp_path, users=2)
    code = main(["serve", "-m", str(tiny_chat_model), "--plan", str(plan), "--parallel", "4", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("hybridmoe: error: the plan's KV cache holds 2 conversations; --parallel 4 needs a plan for 4" in err)
    assert f"`hybridmoe plan {tiny_chat_model} --users 4 --context {CONTEXT} --save FILE`" in err
    assert "--parallel 2 or fewer" in err and "Traceback" not in err
    assert loads == []


def test_llamacpp_asked_for_with_parallel_is_refused_before_loading(tiny_chat_model, capsys, loads):
    code = main(["serve", "-m", str(tiny_chat_model), "--backend", "llamacpp", "--parallel", "2", "--port", "0",
                 "--context", str(CONTEXT)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "llama.cpp answers one request at a time here; --parallel 2 needs the embedded engine" in err
    assert "Leave out --parallel" in err and "Traceback" not in err
    assert loads == []


def test_llamacpp_chosen_by_the_plan_is_refused_once_loaded_and_closed(ggufs, tmp_path, capsys, loads, monkeypatch):
    """`auto` follows a plan made for llama.cpp (or falls back to it): only the loaded session
    tells, so the check comes after the load, and the session is closed."""
    from hybridmoe.backend.llamacpp.session import LlamaCppSession

    closed = []
    original_close = LlamaCppSession.close
    monkeypatch.setattr(LlamaCppSession, "close", lambda self: closed.append(self) or original_close(self))
    path = ggufs("qwen3_moe")
    plan = saved_plan(path, tmp_path, users=2, backend="llamacpp")
    code = main(["serve", "-m", str(path), "--plan", str(plan), "--parallel", "2", "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("llama.cpp, which serves this model, answers one request at a time here; --parallel 2 needs the "
            "embedded engine") in err
    assert len(loads) == 1 and len(closed) == 1 and "Traceback" not in err


def test_serve_parallel_plans_for_that_many_and_says_so(tiny_chat_model, tmp_path):
    """Without --plan, the plan made at start holds --parallel conversations, and the engine
    answers that many at once."""
    process, lines = serve_process(tiny_chat_model, tmp_path, "--context", str(CONTEXT), "--max-tokens-limit", "32",
                                   "--parallel", "2")
    seen = []
    try:
        seen = until_serving(process, lines)
        assert "(OpenAI API), up to 2 requests at once. Ctrl-C stops." in seen[-1]
        url = re.search(r"at (http://\S+)/v1 ", seen[-1]).group(1)
        body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 5, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: post(f"{url}/v1/chat/completions", body), range(2)))
        assert [status for status, _, _ in answers] == [200, 200]
        assert answers[0][2]["choices"] == answers[1][2]["choices"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
