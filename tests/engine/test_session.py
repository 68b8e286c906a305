"""The engine behind the Backend/Session protocol: streaming, stop strings, cancel, limits, stats."""

from __future__ import annotations

import json
import threading

import pytest

from hybridmoe.backend.text.sampling import SamplingParams
from hybridmoe.backend.engine.session import EngineBackend
from hybridmoe.backend.errors import ModelError, UsageError
from hybridmoe.backend.hardware.presets import preset
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from hybridmoe.backend.session import CancelToken, Done, Message, TextPiece

CHAT = [Message("system", "Be brief."), Message("user", "Hello there, how are you?")]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


def plan_for(path, context=256, **workload):
    model = inspect_model(path)
    return make(model.spec, model.inventory, preset("cpu-only"), Workload(context=context, **workload))


@pytest.fixture(scope="module")
def session(tiny_chat_model):
    s = EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model))
    yield s
    s.close()


def run(session, messages=CHAT, sampling=GREEDY, cancel=None):
    events = list(session.generate(messages, sampling, cancel))
    assert isinstance(events[-1], Done) and all(isinstance(e, TextPiece) for e in events[:-1])
    return events[:-1], events[-1]


def test_pieces_add_up_to_the_answer_and_stats_are_reported(session):
    pieces, done = run(session)
    assert "".join(p.text for p in pieces) == done.text
    assert done.reason == "length" and len(done.token_ids) == 24
    s = done.stats
    assert s.prompt_tokens == len(session.prompt_ids(CHAT))
    assert s.generated_tokens == 24
    assert s.time_to_first_token_s > 0 and s.prefill_tokens_per_s > 0 and s.decode_tokens_per_s > 0
    assert s.peak_memory_bytes["host"] > 0
    assert s.backend == "engine"


def test_greedy_is_deterministic_and_the_cached_prefix_changes_nothing(session, tiny_chat_model):
    _, first = run(session)
    _, again = run(session)  # the whole prompt is in the cache now: only its last token reruns
    fresh = EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model))
    _, cold = run(fresh)
    assert first.token_ids == again.token_ids == cold.token_ids


def test_a_follow_up_turn_matches_a_fresh_session(session, tiny_chat_model):
    _, first = run(session)
    follow_up = [*CHAT, Message("assistant", first.text), Message("user", "And then?")]
    _, warm = run(session, follow_up)
    fresh = EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model))
    _, cold = run(fresh, follow_up)
    assert warm.token_ids == cold.token_ids


def test_a_stop_string_ends_generation_and_is_not_emitted(session):
    _, full = run(session)
    cut = full.text[4:8]
    assert cut, "the random model must produce some text"
    _, done = run(session, sampling=SamplingParams(temperature=0, max_tokens=24, stop=(cut,)))
    assert done.reason == "stop"
    assert done.text == full.text[: full.text.index(cut)]


def test_cancel_stops_between_tokens_and_keeps_what_was_generated(session):
    cancel = CancelToken()
    pieces = []
    for event in session.generate(CHAT, SamplingParams(temperature=0, max_tokens=200), cancel):
        if isinstance(event, TextPiece):
            pieces.append(event)
            if len(pieces) == 3:
                cancel.cancel()
        else:
            done = event
    assert done.reason == "cancelled"
    assert 3 <= len(done.token_ids) < 200
    assert done.text == "".join(p.text for p in pieces)


def test_a_prompt_longer_than_the_context_is_a_clear_error(tiny_chat_model):
    small = EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model, context=16))
    with pytest.raises(ModelError, match="the prompt is .* tokens, the context holds 16"):
        run(small, [Message("user", "word " * 50)])


def test_a_plan_for_another_model_is_refused(tiny_chat_model):
    from hybridmoe.backend.hub.catalogue import load

    other = inspect_model(load().find("qwen3-30b-a3b").config_path)  # the config the catalogue ships
    plan = make(other.spec, other.inventory, preset("cpu-only"), Workload(context=256))
    with pytest.raises(UsageError, match="plan was made for"):
        EngineBackend().load(tiny_chat_model, plan)


def test_loading_reports_progress_and_can_be_cancelled(tiny_chat_model):
    from hybridmoe.backend.session import Cancelled

    seen = []
    EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model), on_progress=seen.append)
    assert seen and seen[-1].done == seen[-1].total and seen[-1].unit == "layers"
    cancel = CancelToken()
    cancel.cancel()
    with pytest.raises(Cancelled):
        EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model), cancel=cancel)


def test_expert_statistics_feed_the_frequency_planner(session, tiny_chat_model, tmp_path):
    run(session)
    path = tmp_path / "stats.json"
    session.save_expert_stats(path)
    data = json.loads(path.read_text())
    assert data["format"] == "hybridmoe-expert-stats/1" and data["tokens"] > 0
    assert all(sum(counts) > 0 for counts in data["layers"].values())
    plan = plan_for(tiny_chat_model, strategy="frequency", stats_file=str(path))
    assert set(plan.gpu_experts) == set(inspect_model(tiny_chat_model).spec.moe_layers)


def _held_in_first_layer(model, started: threading.Event, release: threading.Event) -> list[int]:
    """Every decoder layer's forward records its index and waits for `release` (so the first
    one called holds the step). Returns the record."""
    ran = []

    def holding(forward, i):
        def held(x, segments):
            ran.append(i)
            started.set()
            release.wait(30)
            return forward(x, segments)
        return held

    for i, layer in enumerate(model.layers):
        layer.forward = holding(layer.forward, i)
    return ran


def test_closing_ends_a_running_prompt_at_its_next_layer(tiny_chat_model):
    """A prompt slice of a large model runs for many seconds: closing the session does not
    wait for all of it, and the generation learns why it ended."""
    s = EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model))
    started, release = threading.Event(), threading.Event()
    ran = _held_in_first_layer(s.model, started, release)
    asked, unload, outcome = threading.Event(), s.model.unload, []
    s.model.unload = lambda: (unload(), asked.set())

    def chat():
        try:
            run(s)
        except ModelError as error:
            outcome.append(error)

    chatting = threading.Thread(target=chat)
    chatting.start()
    assert started.wait(30)
    closing = threading.Thread(target=s.close)
    closing.start()
    asked.wait(30)  # close() has asked the model to stop
    release.set()
    closing.join(30)
    chatting.join(30)
    assert not closing.is_alive() and not chatting.is_alive()
    assert ran == [0]  # the running layer finished; the other layers never started
    assert len(outcome) == 1 and "unloaded" in str(outcome[0])


# A session nobody closed, its interpreter exiting while a prompt runs (each layer 1.5 s
# inside torch): the exit waits for the running layer, and nothing aborts the process.
_EXIT_DURING_A_PROMPT = """
import sys, threading, time
import torch
from hybridmoe.backend.engine.session import EngineBackend
from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.session import Message
from hybridmoe.backend.text.sampling import SamplingParams
from tests.engine.test_session import plan_for

session = EngineBackend().load(sys.argv[1], plan_for(sys.argv[1]))
started = threading.Event()

def spinning(forward):
    def slow(x, segments):
        started.set()
        t, end = torch.ones(1 << 16), time.monotonic() + 1.5
        while time.monotonic() < end:
            t.add_(1)  # the GIL is let go and taken back in each call
        return forward(x, segments)
    return slow

for layer in session.model.layers:
    layer.forward = spinning(layer.forward)

def chat():
    try:
        list(session.generate([Message("user", "hello")], SamplingParams(temperature=0, max_tokens=4)))
    except ModelError:
        pass

threading.Thread(target=chat, daemon=True).start()
started.wait(60)
time.sleep(0.3)
print("exiting", flush=True)
"""


def test_exiting_during_a_prompt_does_not_abort_the_process(tiny_chat_model):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _EXIT_DURING_A_PROMPT, str(tiny_chat_model)], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "exiting", out.stderr[-4000:]
    assert out.returncode == 0, f"exit code {out.returncode}: {out.stderr[-4000:]}"
    assert "terminate called" not in out.stderr


def test_cancelling_ends_a_running_prompt_at_its_next_layer(tiny_chat_model):
    """Esc or Ctrl-C during a long prompt: its slice ends at the layer that runs, the answer
    ends "cancelled", and the session answers the next prompt as a fresh one does."""
    s = EngineBackend().load(tiny_chat_model, plan_for(tiny_chat_model))
    _, expected = run(s)
    s.batcher.forget()  # the next prompt is computed in full
    started, release = threading.Event(), threading.Event()
    ran = _held_in_first_layer(s.model, started, release)
    cancel, outcome = CancelToken(), []
    chatting = threading.Thread(target=lambda: outcome.append(run(s, cancel=cancel)[1]))
    chatting.start()
    assert started.wait(30)
    cancel.cancel()
    release.set()
    chatting.join(30)
    assert ran == [0]  # the running layer finished; the other layers never started
    assert outcome[0].reason == "cancelled" and outcome[0].token_ids == ()
    _, again = run(s)
    assert again.token_ids == expected.token_ids
    s.close()
