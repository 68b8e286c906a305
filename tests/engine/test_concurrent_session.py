"""Several conversations at once through one engine session: each gets its solo answer,
a conversation's next turn computes only its new tokens, a shared system prompt is held
once, idle conversations are evicted (least recently used) and recomputed when they return,
and cancelling one generation never disturbs the others."""

from __future__ import annotations

import threading

import pytest

from hybridmoe.backend.engine.batching import Generation
from hybridmoe.backend.engine.session import EngineBackend
from hybridmoe.backend.session import CancelToken, Done, Message, TextPiece
from hybridmoe.backend.text.sampling import SamplingParams
from tests.convert.conftest import checkpoints, converted  # noqa: F401 - fixtures: tiny GGUFs
from tests.engine.test_session import plan_for

GREEDY = SamplingParams(temperature=0, max_tokens=20)
SYSTEM = Message("system", "You are a patient assistant who answers in short sentences. " * 6)
CONVERSATIONS = [
    [SYSTEM, Message("user", "Hello there, how are you?")],
    [SYSTEM, Message("user", "The quick brown fox jumps over the lazy dog.")],
    [Message("user", "def add(a, b): return a + b")],
    [Message("user", "Mixture-of-Experts models route each token to a few experts.")],
]


def load(path, users: int, context: int = 512):
    return EngineBackend().load(path, plan_for(path, context=context, users=users))


def answer(session, messages, cancel=None) -> Done:
    events = list(session.generate(messages, GREEDY, cancel))
    assert isinstance(events[-1], Done)
    return events[-1]


def at_once(session, conversations, cancels=None) -> list[Done]:
    """Each conversation's generation in its own thread, started together."""
    results: list[Done | BaseException | None] = [None] * len(conversations)
    barrier = threading.Barrier(len(conversations))

    def run(i):
        barrier.wait()
        try:
            results[i] = answer(session, conversations[i], None if cancels is None else cancels[i])
        except BaseException as error:  # reported by the main thread
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture
def reuse(monkeypatch) -> list[tuple[int, int]]:
    """(prompt tokens, positions the cache already held) of each generation from now on."""
    seen = []
    prefill = Generation.prefill

    def recording(self, cancel):
        seen.append((len(self.ids), self.reused))
        return prefill(self, cancel)

    monkeypatch.setattr(Generation, "prefill", recording)
    return seen


@pytest.mark.parametrize(("family", "quant"), [("qwen3_moe", "q8_0"), ("qwen3_moe", "q4_0"), ("deepseek_v3", "q8_0"),
                                               ("gpt_oss", "q8_0")])
def test_conversations_at_once_get_their_solo_answers(family, quant, converted):  # noqa: F811
    path = converted(family, quant)
    alone = load(path, users=1)
    try:
        solo = [answer(alone, c).token_ids for c in CONVERSATIONS]
    finally:
        alone.close()
    session = load(path, users=len(CONVERSATIONS))
    try:
        assert session.max_parallel == len(CONVERSATIONS)
        together = at_once(session, CONVERSATIONS)
        # Steps ran several conversations at once (not one after the other).
        assert session.batcher.rows > session.batcher.steps
    finally:
        session.close()
    assert [d.token_ids for d in together] == solo


def test_cancelling_one_generation_leaves_the_others_untouched(converted):  # noqa: F811
    path = converted("qwen3_moe", "q8_0")
    session = load(path, users=3)
    try:
        solo = [answer(session, c).token_ids for c in CONVERSATIONS[:3]]
        session.batcher.forget()

        class AfterPieces(CancelToken):
            """Cancelled once the generation has streamed a few pieces."""

            def __init__(self):
                super().__init__()
                self.looks = 0

            @property
            def cancelled(self) -> bool:
                self.looks += 1
                return self.looks > 8

        cancels = [None, AfterPieces(), None]
        done = at_once(session, CONVERSATIONS[:3], cancels)
    finally:
        session.close()
    assert done[1].reason == "cancelled"
    assert done[0].token_ids == solo[0] and done[2].token_ids == solo[2]


def test_a_next_turn_computes_only_its_new_tokens(converted, reuse):  # noqa: F811
    session = load(converted("qwen3_moe", "q8_0"), users=2)
    try:
        first = answer(session, CONVERSATIONS[0])
        follow_up = [*CONVERSATIONS[0], Message("assistant", first.text), Message("user", "And then?")]
        answer(session, follow_up)
    finally:
        session.close()
    (prompt_1, _), (prompt_2, reused_2) = reuse
    # The whole first prompt was cached, and of the answer what tokenizes again the same (a
    # random model's text often does not); only the rest and the new message run.
    assert prompt_1 <= reused_2 < prompt_2


def test_a_shared_system_prompt_is_computed_and_held_once(converted, reuse):  # noqa: F811
    session = load(converted("qwen3_moe", "q8_0"), users=2)
    try:
        answer(session, CONVERSATIONS[0])
        free_after_one = session.model.cache.groups[0].pool.free
        answer(session, CONVERSATIONS[1])
        free_after_two = session.model.cache.groups[0].pool.free
        assert session.batcher.idle_sequences() == 2  # both conversations stay cached
    finally:
        session.close()
    (_, _), (prompt_2, reused_2) = reuse
    system_tokens = len(session.tokenizer.encode_prompt(SYSTEM.content)) if session.tokenizer else 0
    assert reused_2 >= system_tokens - 8
    # The second conversation's new blocks are those after the shared prefix's whole blocks.
    shared_blocks = reused_2 // 64
    own_blocks = -(-(prompt_2 + GREEDY.max_tokens) // 64) - shared_blocks
    assert free_after_one - free_after_two <= own_blocks


def test_idle_conversations_are_evicted_and_recomputed_when_they_return(converted, reuse):  # noqa: F811
    # One conversation of 160 tokens: the cache holds 3 blocks of 64, A takes 2, so B's turn
    # evicts A.
    session = load(converted("qwen3_moe", "q8_0"), users=1, context=160)
    long_a = [Message("user", "Tell me about the fox. " * 4)]
    long_b = [Message("user", "Tell me about the dog. " * 4)]
    try:
        first_a = answer(session, long_a)
        answer(session, long_b)
        again_a = answer(session, long_a)
    finally:
        session.close()
    assert again_a.token_ids == first_a.token_ids
    (prompt_a, _), (prompt_b, _), (_, reused_again) = reuse
    assert 64 < prompt_a + GREEDY.max_tokens <= 128 and 64 < prompt_b + GREEDY.max_tokens <= 128
    # A's own blocks were evicted: only the start it shares with B ("Tell me about the") was
    # still cached, in B's sequence; the rest was computed again.
    assert reused_again < 32


def test_more_generations_than_conversations_wait_for_a_slot(converted):  # noqa: F811
    path = converted("qwen3_moe", "q8_0")
    session = load(path, users=1)
    try:
        solo = [answer(session, c).token_ids for c in CONVERSATIONS[:2]]
        together = at_once(session, CONVERSATIONS[:2])
        assert session.batcher.rows == session.batcher.steps  # never two in one step
    finally:
        session.close()
    assert [d.token_ids for d in together] == solo


def test_pieces_stream_while_others_generate(converted):  # noqa: F811
    """Streaming is per generation: each consumer sees its own pieces as they come."""
    session = load(converted("qwen3_moe", "q8_0"), users=2)
    try:
        first = session.generate(CONVERSATIONS[2], GREEDY)
        second = session.generate(CONVERSATIONS[3], GREEDY)
        a, b = next(first), next(second)
        assert isinstance(a, (TextPiece, Done)) and isinstance(b, (TextPiece, Done))
        rest = list(first) + list(second)
        assert sum(isinstance(e, Done) for e in rest) == 2
    finally:
        session.close()
