"""The engine against transformers on the same tiny checkpoints, for every family."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import FAMILY_NAMES, engine, relative_error, tokens

MLA_FAMILIES = ("deepseek_v3", "deepseek_v2")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_full_forward_matches_transformers_fp32(family, checkpoints, references):
    path = checkpoints(family)
    ids = tokens(24)
    with torch.no_grad():
        ref = references(path)(ids).logits
    ours = engine(path)(ids)
    assert ours.shape == ref.shape
    assert relative_error(ours, ref) < 1e-4


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_decode_with_kv_cache_matches_full_forward(family, checkpoints, references):
    """Prefill, then a chunk of several tokens at once, then one token per call (MLA in its
    absorbed form) gives the logits of one full forward, ours and transformers'."""
    path = checkpoints(family)
    ids = tokens(24)
    with torch.no_grad():
        ref = references(path)(ids).logits
    # sliding_rewind=2: GPT-OSS' sliding layers (window 8) keep a ring of 10 slots, which
    # the 24 tokens wrap around more than once.
    model = engine(path, sliding_rewind=2)
    full = model(ids)
    model.set_mla_absorb(True)
    steps = [model(ids[:, :6], 0), model(ids[:, 6:11], 6)]
    steps += [model(ids[:, t : t + 1], t) for t in range(11, 24)]
    decoded = torch.cat(steps, dim=1)
    assert relative_error(decoded, ref) < 1e-4
    assert relative_error(decoded, full) < 1e-4


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_mla_absorbed_and_expanded_forms_agree(family, checkpoints):
    model = engine(checkpoints(family))
    ids = tokens(20, seed=3)
    model.set_mla_absorb(False)
    expanded = model(ids)
    model.set_mla_absorb(True)
    absorbed = model(ids)
    assert relative_error(absorbed, expanded) < 1e-5


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_bf16_decode_is_as_accurate_as_transformers(family, checkpoints, references):
    """Decoding a bf16 checkpoint step by step is at least as close to the fp32 truth as
    transformers' own bf16 generate(), and never picks another token where the truth is sure.

    Not bit-equality with transformers' bf16 tokens: on a CPU the engine attends in fp32
    (PyTorch's bf16 attention kernels are ~8x slower there) and its projections accumulate
    in fp32 in the native kernels, so it rounds differently, and a random tiny model has
    near-ties that any rounding change flips. Measured here: the engine's error is within a
    few percent of transformers' for six families and several times smaller for Mixtral
    and GLM-4.5, where transformers' bf16 attention even picks a token the truth rejects.
    Teacher-forced on transformers' greedy continuation, so all three see the same inputs.
    """
    path = checkpoints(family, torch.bfloat16)
    prompt = tokens(12, seed=5)
    ref = references(path, torch.bfloat16)
    with torch.no_grad():
        out = ref.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0,
                           output_logits=True, return_dict_in_generate=True)
        seq = out.sequences
        truth = references(path, torch.float32)(seq).logits[0, 11:-1].float()
    theirs = torch.stack(out.logits)[:, 0].float()
    model = engine(path)
    assert model.dtype == torch.bfloat16
    model.set_mla_absorb(False)
    steps = [model(prompt, 0, last_only=True)[0, -1]]
    for i in range(12, 12 + 31):
        steps.append(model(seq[:, i : i + 1], i)[0, -1])
    ours = torch.stack(steps).float()
    assert relative_error(ours, truth) <= 1.1 * relative_error(theirs, truth) + 0.01
    top2 = truth.topk(2).values
    sure = (top2[:, 0] - top2[:, 1]) > 0.1
    assert torch.equal(ours.argmax(-1)[sure], truth.argmax(-1)[sure])


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_bf16_absorbed_decode_is_as_accurate_as_expanded(family, checkpoints):
    """In bf16 the absorbed form rounds differently from the expanded one (transformers'),
    but not worse: both measured against float32 arithmetic on the same bf16 weights."""
    path = checkpoints(family, torch.bfloat16)
    ids = tokens(24, seed=5)
    exact = engine(path, dtype=torch.float32)(ids)
    errors = {}
    for absorb in (False, True):
        model = engine(path)
        model.set_mla_absorb(absorb)
        decoded = torch.cat([model(ids[:, :8], 0)] + [model(ids[:, t : t + 1], t) for t in range(8, 24)], dim=1)
        errors[absorb] = relative_error(decoded, exact)
    assert errors[True] <= 2 * errors[False] + 1e-2, errors


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "gpt_oss"])
def test_rewinding_the_cache_replays_a_different_continuation(family, checkpoints):
    """A call at an earlier start_pos overwrites what followed it (chat edits, regeneration);
    GPT-OSS' sliding layers (window 8) keep 6 positions more than their window for this."""
    path = checkpoints(family)
    model = engine(path, sliding_rewind=6)
    first, second = tokens(20, seed=7), tokens(20, seed=8)
    model(first, 0)
    spliced = torch.cat((first[:, :14], second[:, 14:]), dim=1)
    rewound = model(spliced[:, 14:], 14)
    fresh = engine(path)(spliced)[:, 14:]
    assert relative_error(rewound, fresh) < 1e-5


def test_rewinding_past_a_sliding_ring_is_refused(checkpoints):
    from hybridmoe.backend.engine.kv_cache import CacheRewindError

    # Window 8 + rewind 2: the sliding layers keep the blocks (64 positions) that hold the
    # last 10 positions, and release older ones.
    model = engine(checkpoints("gpt_oss"), sliding_rewind=2, max_context=256)
    model(tokens(200), 0)
    model(tokens(2), 190)  # within reach: the window before 190 is still held
    with pytest.raises(CacheRewindError):
        model(tokens(2), 40)


def test_context_overflow_is_a_clear_error(checkpoints):
    from hybridmoe.backend.engine.kv_cache import ContextFullError

    model = engine(checkpoints("qwen3_moe"), max_context=16)
    model(tokens(12), 0)
    with pytest.raises(ContextFullError, match="16"):
        model(tokens(8), 12)
