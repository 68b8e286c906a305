"""Sampler against crafted logits and transformers' logits processors; StopStringMatcher."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hybridmoe.backend.text.sampling import Sampler, SamplingParams, StopStringMatcher
from hybridmoe.backend.errors import UsageError


def logits_for(probs: list[float]) -> torch.Tensor:
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def survivors(params: SamplingParams, logits: torch.Tensor, previous=()) -> list[int]:
    return torch.nonzero(torch.isfinite(Sampler(params).adjusted_logits(logits, previous))).flatten().tolist()


# -- greedy and masks --------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=gen)
        assert Sampler(SamplingParams(temperature=0)).sample(logits) == int(torch.argmax(logits))
    assert Sampler(SamplingParams(temperature=0)).sample(logits[None, :]) == int(torch.argmax(logits))  # [1, vocab]
    # bf16 logits (what a model hands over) work too.
    assert Sampler(SamplingParams(temperature=0)).sample(logits.to(torch.bfloat16)) == int(torch.argmax(logits.to(torch.bfloat16)))
    # Ties go to the first, NaN wins, as torch.argmax has it.
    for values in ([1.0, 3.0, 3.0, 2.0], [1.0, float("nan"), 5.0, float("nan")], [float("-inf")] * 3):
        x = torch.tensor(values)
        assert Sampler(SamplingParams(temperature=0)).sample(x) == int(torch.argmax(x))
    # With a repetition penalty the greedy pick is the penalised argmax, and the logits stay as they were.
    logits = torch.tensor([1.0, 2.0, 1.9])
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=1.2)).sample(logits, [1]) == 2
    assert logits.tolist() == pytest.approx([1.0, 2.0, 1.9])


def test_top_k_keeps_k_best_and_ties() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0, 0.0])
    assert survivors(SamplingParams(top_k=3), logits) == [1, 2, 3]
    assert survivors(SamplingParams(top_k=100), logits) == list(range(6))
    tied = torch.tensor([3.0, 1.0, 3.0, 2.0, 3.0])
    assert survivors(SamplingParams(top_k=2), tied) == [0, 2, 4]  # all tied with the 2nd survive


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = logits_for([0.5, 0.3, 0.15, 0.05])
    assert survivors(SamplingParams(top_p=0.8), logits) == [0, 1]  # 0.5 + 0.3 >= 0.8
    assert survivors(SamplingParams(top_p=0.81), logits) == [0, 1, 2]
    assert survivors(SamplingParams(top_p=0.01), logits) == [0]  # the best always survives
    probs = Sampler(SamplingParams(top_p=0.8)).probabilities(logits)
    assert torch.allclose(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_min_p_scales_with_top_probability() -> None:
    logits = logits_for([0.5, 0.3, 0.15, 0.05])
    assert survivors(SamplingParams(min_p=0.2), logits) == [0, 1, 2]  # threshold 0.1 drops 0.05
    assert survivors(SamplingParams(min_p=0.5), logits) == [0, 1]  # threshold 0.25
    assert survivors(SamplingParams(min_p=1.0), logits) == [0]


def test_temperature_sharpens_and_flattens() -> None:
    logits = logits_for([0.6, 0.3, 0.1])
    cold = Sampler(SamplingParams(temperature=0.5)).probabilities(logits)
    hot = Sampler(SamplingParams(temperature=2.0)).probabilities(logits)
    expected_cold = torch.tensor([0.36, 0.09, 0.01]) / 0.46
    assert torch.allclose(cold, expected_cold, atol=1e-6)
    assert hot[0] < 0.6 and hot[2] > 0.1


def test_repetition_penalty_numbers() -> None:
    # HF/CTRL: positive logits divided, negative multiplied, each distinct id once.
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = Sampler(SamplingParams(temperature=0, repetition_penalty=2.0)).adjusted_logits(logits, [0, 1, 1, 1, 99])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]  # id 99 is past the vocabulary and ignored
    # It can change the greedy choice.
    assert Sampler(SamplingParams(temperature=0)).sample(logits, [0]) == 0
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=2.5)).sample(logits, [0]) == 2
    assert Sampler(SamplingParams(temperature=0, repetition_penalty=5.0)).sample(logits, torch.tensor([0, 2])) == 3  # [0.4, -2, 0.2, 0.5]
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # the caller's tensor is untouched


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.3),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
        SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=0.8),
    ],
)
def test_matches_transformers_processors(params: SamplingParams) -> None:
    transformers = pytest.importorskip("transformers")
    lp = transformers.generation.logits_process
    chain = [lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty), lp.TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        chain.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        chain.append(lp.TopPLogitsWarper(params.top_p))
    if params.min_p:
        chain.append(lp.MinPLogitsWarper(params.min_p))
    processors = lp.LogitsProcessorList(chain)
    gen = torch.Generator().manual_seed(7)
    for _ in range(10):
        logits = torch.randn(500, generator=gen) * 3
        previous = torch.randint(0, 500, (60,), generator=gen)
        expected = processors(previous[None, :], logits[None, :].clone())[0]
        got = Sampler(params).adjusted_logits(logits, previous.tolist())
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        finite = torch.isfinite(expected)
        assert torch.allclose(got[finite], expected[finite], atol=1e-5)


# -- randomness -------------------------------------------------------------------------------------


def test_seed_reproduces_and_is_independent_of_global_rng() -> None:
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run() -> list[int]:
        sampler = Sampler(params)
        torch.manual_seed(torch.randint(0, 1000, ()).item())  # disturb the global RNG
        return [sampler.sample(logits) for _ in range(50)]

    first = run()
    assert run() == first
    assert len(set(first)) > 5  # it is sampling, not stuck
    other = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=43))
    assert [other.sample(logits) for _ in range(50)] != first


def test_unseeded_sampler_reports_its_seed() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    a = Sampler(SamplingParams())
    draws = [a.sample(logits) for _ in range(20)]
    b = Sampler(SamplingParams(seed=a.seed))
    assert [b.sample(logits) for _ in range(20)] == draws


def test_draws_follow_the_distribution() -> None:
    probs = [0.5, 0.25, 0.15, 0.1]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    logits = logits_for(probs)
    n = 4000
    counts = torch.bincount(torch.tensor([sampler.sample(logits) for _ in range(n)]), minlength=4)
    for count, p in zip(counts.tolist(), probs):
        assert abs(count / n - p) < 4 * math.sqrt(p * (1 - p) / n)
    # Filtered tokens are never drawn.
    sampler = Sampler(SamplingParams(top_k=2, seed=6))
    assert {sampler.sample(logits) for _ in range(300)} == {0, 1}


# -- parameters -------------------------------------------------------------------------------------


def test_params_validate_and_store_stop_as_tuple() -> None:
    params = SamplingParams(stop=["\nUser:", "###"])
    assert params.stop == ("\nUser:", "###") and hash(params)
    assert SamplingParams(stop="END").stop == ("END",)
    for bad in (
        {"temperature": -1},
        {"temperature": float("nan")},
        {"top_k": -2},
        {"top_p": 0},
        {"top_p": 1.5},
        {"min_p": 2},
        {"repetition_penalty": 0},
        {"max_tokens": 0},
        {"stop": [""]},
    ):
        with pytest.raises(UsageError, match="invalid sampling settings"):
            SamplingParams(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 3  # type: ignore[misc]


def test_from_generation_config() -> None:
    qwen3 = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [1, 2]}
    assert SamplingParams.from_generation_config(qwen3) == SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    assert SamplingParams.from_generation_config({"do_sample": False, "temperature": 0.6}).greedy
    assert SamplingParams.from_generation_config(qwen3, temperature=0.0, seed=1, top_p=None) == SamplingParams(temperature=0.0, top_k=20, top_p=0.95, seed=1)


# -- stop strings -----------------------------------------------------------------------------------


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


def test_stop_string_split_across_pieces() -> None:
    m = StopStringMatcher(["\nUser:"])
    assert m.feed("Hello") == "Hello"
    assert m.feed(" world\nUs") == " world"  # "\nUs" could start the stop string
    assert not m.stopped
    assert m.feed("er: more") == ""
    assert m.stopped and m.matched == "\nUser:"
    assert m.feed("ignored") == "" and m.flush() == ""


def test_false_alarm_is_released() -> None:
    m = StopStringMatcher(["</answer>"])
    assert m.feed("a </an") == "a "
    assert m.feed("gle>") == "</angle>"
    assert feed_all(StopStringMatcher(["</answer>"]), ["x </", "ans"]) == "x </ans"  # flushed at the end


def test_earliest_stop_wins_and_one_char_pieces() -> None:
    text = "one two STOP three END four"
    m = StopStringMatcher(["END", "STOP"])
    out = "".join(m.feed(c) for c in text)
    assert out == "one two " and m.matched == "STOP"
    assert feed_all(StopStringMatcher(["ab", "abc"]), ["xab", "c"]) == "x"


def test_stop_at_start_overlapping_prefixes_and_no_stops() -> None:
    assert feed_all(StopStringMatcher(["###"]), ["###", "rest"]) == ""
    m = StopStringMatcher(["aab"])
    assert m.feed("aaaa") == "aa"  # keeps "aa", the longest end that starts "aab"
    assert m.feed("b!") == "" and m.stopped  # "aaaab!" stops at index 2: "aa" in all
    assert feed_all(StopStringMatcher([]), ["a", "b"]) == "ab"
