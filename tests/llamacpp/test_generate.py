"""Generation through llama.cpp: the same tokens as the embedded engine, streaming, cancel."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from hybridmoe.backend.text.sampling import SamplingParams
from hybridmoe.backend.llamacpp import LlamaCppBackend
from hybridmoe.backend.session import CancelToken, Done, Message, TextPiece
from tests.llamacpp.conftest import FAMILIES, make_plan

CHAT = [Message("system", "You are terse."), Message("user", "Hello world! The quick brown fox")]
GREEDY = SamplingParams(temperature=0, max_tokens=20)


def run(session, messages=CHAT, sampling=GREEDY, cancel=None) -> tuple[list[TextPiece], Done]:
    events = list(session.generate(messages, sampling, cancel))
    assert isinstance(events[-1], Done) and all(isinstance(e, TextPiece) for e in events[:-1])
    return events[:-1], events[-1]


@pytest.fixture(scope="module")
def sessions(ggufs):
    """One llama.cpp session per (family, quant), loaded once for this module."""
    open_sessions = {}

    def get(family: str, quant: str = "f32"):
        key = (family, quant)
        if key not in open_sessions:
            path = ggufs(family, quant)
            # float32 end to end, as the engine computes a float32 model: f32 caches, and no
            # flash attention (llama.cpp's CPU kernel for it works in f16; logits then differ
            # by ~1e-2 instead of ~1e-5).
            plan = make_plan(path, gpu_moe_layers=1, cache_type_k="f32", cache_type_v="f32", flash_attn=False)
            open_sessions[key] = (LlamaCppBackend().load(path, plan), plan, path)
        return open_sessions[key]

    yield get
    for session, _, _ in open_sessions.values():
        session.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_the_engine(family, sessions):
    """Same GGUF, same plan, same prompt ids: the same greedy tokens and text. Both compute in
    float32 here (see conftest), so any difference is a real one, not rounding."""
    from hybridmoe.backend.engine.session import EngineBackend

    ours, plan, path = sessions(family)
    try:
        engine = EngineBackend().load(path, plan)
    except Exception as exc:  # noqa: BLE001 - a family the engine cannot load yet is skipped, saying why
        pytest.skip(f"the engine cannot load the {family} GGUF: {exc}")
    # The prompt is tokenized once, by llama.cpp (checked against HF below); the engine's own
    # GGUF tokenizer is the engine's business and must not decide this comparison.
    ids = ours.prompt_ids(CHAT)
    engine.prompt_ids = lambda messages: ids
    try:
        _, expected = run(engine)
    finally:
        engine.close()
    pieces, done = run(ours)
    assert done.token_ids == expected.token_ids
    assert done.text == expected.text == "".join(p.text for p in pieces)
    assert done.reason == expected.reason
    assert done.stats.backend == "llamacpp" and done.stats.prompt_tokens == len(ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_is_rendered_and_tokenized_like_transformers(family, sessions, checkpoint_dirs):
    """The GGUF's chat template through our sandboxed ChatTemplate, then llama.cpp's tokenizer:
    the ids the HF tokenizer gives the same rendered text (plus the model's BOS)."""
    ours, _, _ = sessions(family)
    text = ours.template.render([{"role": m.role, "content": m.content} for m in CHAT])
    hf = Tokenizer.from_file(str(checkpoint_dirs(family) / "tokenizer.json"))
    expected = hf.encode(text, add_special_tokens=False).ids
    if ours.vocab.add_bos and expected[:1] != [ours.vocab.bos_id]:
        expected.insert(0, ours.vocab.bos_id)
    assert ours.prompt_ids(CHAT) == expected
    assert not ours.template.is_fallback


def test_streaming_pieces_add_up_and_stop_strings_cut(sessions):
    ours, _, _ = sessions("qwen3_moe")
    pieces, done = run(ours)
    assert len(pieces) >= 2 and done.reason == "length" and done.stats.generated_tokens == 20
    assert "".join(p.text for p in pieces) == done.text
    # A piece names the token that completed it (text held back for a stop string or a split
    # character carries no token of its own): an in-order subsequence of the generated ids.
    remaining = iter(done.token_ids)
    assert all(any(t == g for g in remaining) for p in pieces for t in p.token_ids)
    s = done.stats
    assert s.time_to_first_token_s > 0 and s.prefill_tokens_per_s > 0 and s.decode_tokens_per_s > 0
    stop = done.text[len(done.text) // 2 :][:3]
    _, stopped = run(ours, sampling=SamplingParams(temperature=0, max_tokens=20, stop=(stop,)))
    assert stopped.reason == "stop" and stop not in stopped.text and done.text.startswith(stopped.text)


def test_cancel_between_tokens(sessions):
    ours, _, _ = sessions("qwen3_moe")
    cancel = CancelToken()
    seen = []
    for event in ours.generate(CHAT, GREEDY, cancel):
        if isinstance(event, TextPiece):
            seen.append(event)
            if len(seen) == 3:
                cancel.cancel()
        else:
            done = event
    assert done.reason == "cancelled"
    assert len(seen) == 3 and done.stats.generated_tokens == 3


class _CancelAfter(CancelToken):
    """Reads as cancelled from the n-th look on: llama.cpp's abort callback looks between the
    nodes of its compute graph, so this stops a prompt in the middle of llama_decode."""

    def __init__(self, looks: int):
        super().__init__()
        self.looks = looks

    @property
    def cancelled(self) -> bool:
        self.looks -= 1
        return self.looks < 0


def test_cancel_inside_the_prompt_leaves_a_usable_session(sessions):
    ours, _, _ = sessions("deepseek_v3")
    _, before = run(ours)
    ours._cached = []  # as if this were the first turn: the whole prompt must run again
    _, cancelled = run(ours, cancel=_CancelAfter(5))
    assert cancelled.reason == "cancelled" and cancelled.token_ids == ()
    _, after = run(ours)
    assert after.token_ids == before.token_ids


def test_a_follow_up_turn_reuses_the_cache_and_matches_a_fresh_session(sessions, ggufs):
    ours, plan, path = sessions("mixtral")
    _, first = run(ours)
    follow_up = [*CHAT, Message("assistant", first.text), Message("user", "And then?")]
    _, second = run(ours, follow_up)
    assert second.stats.prompt_tokens > first.stats.prompt_tokens
    fresh = LlamaCppBackend().load(path, plan)
    try:
        _, expected = run(fresh, follow_up)
    finally:
        fresh.close()
    assert second.token_ids == expected.token_ids
    # only the new part of the conversation was computed: prefill tokens/s is measured on it
    assert second.stats.prefill_tokens_per_s is not None


def test_seeded_sampling_is_reproducible_and_matches_the_engine(sessions):
    """The engine's Sampler on llama.cpp's logits: same seed, same draws, on either backend."""
    from hybridmoe.backend.engine.session import EngineBackend

    ours, plan, path = sessions("qwen3_moe")
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.1,
                              seed=1234, max_tokens=16)
    _, a = run(ours, sampling=sampling)
    _, b = run(ours, sampling=sampling)
    assert a.token_ids == b.token_ids
    engine = EngineBackend().load(path, plan)
    ids = ours.prompt_ids(CHAT)
    engine.prompt_ids = lambda messages: ids
    try:
        _, e = run(engine, sampling=sampling)
    finally:
        engine.close()
    assert e.token_ids == a.token_ids


def test_the_context_limit_is_a_clear_error(sessions):
    from hybridmoe.backend.errors import ModelError

    ours, _, _ = sessions("qwen3_moe")
    with pytest.raises(ModelError, match=r"the prompt is \d+ tokens, the context holds 256"):
        run(ours, [Message("user", "fox " * 400)])


def test_load_reports_progress_and_can_be_cancelled(ggufs):
    from hybridmoe.backend.session import Cancelled

    path = ggufs("qwen3_moe")
    plan = make_plan(path)
    events = []
    LlamaCppBackend().load(path, plan, on_progress=events.append).close()
    assert events and events[-1].stage == "load" and events[-1].done == events[-1].total == 100
    cancel = CancelToken()
    cancel.cancel()
    with pytest.raises(Cancelled, match="loading the model was cancelled"):
        LlamaCppBackend().load(path, plan, cancel=cancel)


def test_min_tokens_is_a_lower_bound_and_a_long_prompt_is_refused_untokenized(sessions, monkeypatch):
    from hybridmoe.backend.errors import ModelError
    from hybridmoe.backend.llamacpp.vocab import Vocab

    ours, _, _ = sessions("qwen3_moe")
    for text in ("fox " * 400, "Hello, world! 你好 😀", " " * 999, "x" * 999):
        assert ours.vocab.min_tokens(text) <= len(ours.vocab.encode(text))
    encoded = []
    monkeypatch.setattr(Vocab, "encode", lambda self, text: encoded.append(len(text)) or [])
    with pytest.raises(ModelError, match=r"the prompt is at least [\d,]+ tokens \([\d,]+ characters\), the context holds 256"):
        run(ours, [Message("user", "ab " * 100_000)])
    assert encoded == []  # refused on its length alone
