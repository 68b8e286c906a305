"""The official openai client against `hybridmoe serve`'s API on the real engine: the same
answers as the session gives directly, streamed or whole, with the usage counted."""

from __future__ import annotations

from tests.server.conftest import CHAT, MODEL_ID, as_openai, direct, get, post


def test_a_chat_completion_is_the_sessions_answer_with_its_usage(client, shared):
    expected = direct(shared, max_tokens=12)
    response = client.chat.completions.create(model=MODEL_ID, messages=as_openai(CHAT), max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"  # the tiny random model never ends its turn within 12 tokens
    assert response.model == MODEL_ID and response.object == "chat.completion"
    assert response.usage.prompt_tokens == expected.stats.prompt_tokens
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == expected.stats.prompt_tokens + 12


def test_a_streamed_chat_completion_adds_up_to_the_same_answer(client, shared):
    expected = direct(shared, max_tokens=12)
    stream = client.chat.completions.create(model=MODEL_ID, messages=as_openai(CHAT), max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage  # the last chunk: usage only
    assert chunks[-1].choices == [] and usage.completion_tokens == 12
    assert usage.prompt_tokens == expected.stats.prompt_tokens


def test_stop_strings_cut_the_answer(client, shared):
    full = direct(shared, max_tokens=16).text
    stop = full[6:9]
    response = client.chat.completions.create(model=MODEL_ID, messages=as_openai(CHAT), max_tokens=16, temperature=0,
                                              stop=[stop, "a stop string that never comes"])
    assert response.choices[0].message.content == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_a_seed_reproduces_a_sampled_answer(client):
    def sampled(seed):
        return client.chat.completions.create(model=MODEL_ID, messages=as_openai(CHAT), max_tokens=10,
                                              temperature=1.0, top_p=0.9, seed=seed).choices[0].message.content

    assert sampled(7) == sampled(7)


def test_text_parts_are_joined_into_the_message(client, shared):
    parts = [{"type": "text", "text": "Hello there,"}, {"type": "text", "text": "how are you?"}]
    messages = [CHAT[0], type(CHAT[1])("user", "Hello there,\nhow are you?")]
    expected = direct(shared, messages, max_tokens=8)
    response = client.chat.completions.create(
        model=MODEL_ID, max_tokens=8, temperature=0,
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}])
    assert response.choices[0].message.content == expected.text


def test_a_raw_completion_continues_the_prompt_as_it_is(client, shared):
    expected = direct(shared, prompt="Once upon a time", max_tokens=10)
    response = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert response.choices[0].text == expected.text and response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == expected.stats.prompt_tokens
    streamed = client.completions.create(model=MODEL_ID, prompt="Once upon a time", max_tokens=10, temperature=0,
                                         stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    status, health = get(f"{server.url}/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == MODEL_ID
    assert {"waiting", "running", "completed"} <= health.keys()


def test_a_follow_up_turn_computes_only_its_new_tokens(client, shared, monkeypatch):
    """The session keeps the last prompt's cache, and the queue leaves it alone: the next turn
    of the same conversation starts computing where the shared prefix ends."""
    first = client.chat.completions.create(model=MODEL_ID, messages=as_openai(CHAT), max_tokens=8, temperature=0)
    follow_up = [*as_openai(CHAT), {"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    from hybridmoe.backend.engine.batching import Generation

    computed = []
    prefill = Generation.prefill

    def counting(self, cancel):
        logits, n = prefill(self, cancel)
        computed.append(n)
        return logits, n

    monkeypatch.setattr(Generation, "prefill", counting)
    second = client.chat.completions.create(model=MODEL_ID, messages=follow_up, max_tokens=8, temperature=0)
    # the first turn's prompt was not computed again, only what the follow-up adds
    assert 0 < computed[0] <= second.usage.prompt_tokens - first.usage.prompt_tokens



def test_ignore_eos_reaches_the_sampling_parameters(server):
    """As llama.cpp's and vLLM's servers take it: answers of exactly max_tokens, end tokens or
    not (what a benchmark needs; the token loop's handling is tested in tests/bench)."""
    from hybridmoe.app.server.openai_api import chat_request

    body = {"messages": as_openai(CHAT), "max_tokens": 8}
    assert chat_request({**body, "ignore_eos": True}, 64).sampling.ignore_eos is True
    assert chat_request(body, 64).sampling.ignore_eos is False
    status, _, error = post(f"{server.url}/v1/chat/completions", {**body, "model": MODEL_ID, "ignore_eos": "yes"})
    assert status == 400 and "ignore_eos" in error["error"]["message"]
