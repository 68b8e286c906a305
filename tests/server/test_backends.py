"""Raw completions (no chat template) on both backends, and the server on llama.cpp."""

from __future__ import annotations

import pytest

from hybridmoe.app.server.shared_session import SharedSession
from hybridmoe.backend.text.sampling import SamplingParams
from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.session import Done
from tests.llamacpp.conftest import make_plan
from tests.server.conftest import CHAT, MODEL_ID, as_openai, client_for

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def last(events) -> Done:
    return list(events)[-1]


def rendered(session) -> str:
    return session.template.render(as_openai(CHAT), add_generation_prompt=True)


@pytest.fixture(scope="module")
def llamacpp_session(ggufs):
    from hybridmoe.backend.llamacpp import LlamaCppBackend

    path = ggufs("qwen3_moe")
    session = LlamaCppBackend().load(path, make_plan(path))
    yield session
    session.close()


def test_the_engine_completes_a_raw_prompt_as_it_would_the_chat_it_renders(shared):
    engine = shared.session
    chat = last(engine.generate(CHAT, GREEDY))
    raw = last(engine.complete(rendered(engine), GREEDY))
    assert raw.token_ids == chat.token_ids and raw.stats.prompt_tokens == chat.stats.prompt_tokens
    with pytest.raises(UsageError, match="the prompt is empty"):
        last(engine.complete("", GREEDY))


def test_llamacpp_completes_a_raw_prompt_as_it_would_the_chat_it_renders(llamacpp_session):
    chat = last(llamacpp_session.generate(CHAT, GREEDY))
    raw = last(llamacpp_session.complete(rendered(llamacpp_session), GREEDY))
    assert raw.token_ids == chat.token_ids and raw.stats.prompt_tokens == chat.stats.prompt_tokens
    with pytest.raises(UsageError, match="the prompt is empty"):
        last(llamacpp_session.complete("", GREEDY))


def test_the_server_serves_a_llamacpp_session_too(llamacpp_session, start_server):
    expected = last(llamacpp_session.generate(CHAT, GREEDY))
    client = client_for(start_server(SharedSession(llamacpp_session)))
    answer = client.chat.completions.create(model=MODEL_ID, messages=as_openai(CHAT), max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == expected.text
    assert answer.usage.prompt_tokens == expected.stats.prompt_tokens
    chunks = client.chat.completions.create(model=MODEL_ID, messages=as_openai(CHAT), max_tokens=12, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
