"""Several sequences in one forward pass get what each gets alone, for every family.

A batched decode step runs one token of each sequence as rows of one call: projections and
experts over all rows, attention per sequence over its own blocks of the cache. Prompts of
different lengths (one inside the first block, others across several) make the sequences'
block tables differ; GPT-OSS' sliding layers release blocks as the window moves on.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.engine.cpu_decode import DecodeStep
from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model
from tests.convert.conftest import FAMILIES, checkpoints, converted  # noqa: F401 - fixtures: tiny checkpoints and GGUFs
from tests.engine.conftest import tokens

PROMPTS = (5, 70, 131)  # tokens: within one block of 64, across two, across three
STEPS = 12
CHUNK = 48


def model_for(path, sequences: int = len(PROMPTS)):
    spec = inspect_model(path).spec
    # sliding_rewind=4: GPT-OSS' sliding layers (window 8) release blocks within these prompts.
    return build_model(spec, open_weights(path), max_context=256, sequences=sequences, sliding_rewind=4)


def prefill(model, seq, ids: list[int]) -> None:
    """The prompt but its last token, in chunks (as a session runs it)."""
    for pos in range(0, len(ids) - 1, CHUNK):
        model(torch.tensor(ids[pos : min(pos + CHUNK, len(ids) - 1)]), pos, last_only=True, seq=seq, prompt=True)


def alone(model, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (and each step's logits) of one sequence decoding by itself."""
    seq = model.cache.new_sequence()
    prefill(model, seq, ids)
    out, logits, token, pos = [], [], ids[-1], len(ids) - 1
    for _ in range(STEPS):
        row = model.forward_batch([(seq, [token], pos)])[0]
        logits.append(row)
        token, pos = int(row.argmax()), pos + 1
        out.append(token)
    model.cache.drop(seq)
    return out, logits


def together(model, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    seqs = [model.cache.new_sequence() for _ in prompts]
    for seq, ids in zip(seqs, prompts):
        prefill(model, seq, ids)
    last = [ids[-1] for ids in prompts]
    pos = [len(ids) - 1 for ids in prompts]
    out = [[] for _ in prompts]
    logits = [[] for _ in prompts]
    for _ in range(STEPS):
        rows = model.forward_batch([(s, [t], p) for s, t, p in zip(seqs, last, pos)])
        for i, row in enumerate(rows):
            logits[i].append(row)
            last[i], pos[i] = int(row.argmax()), pos[i] + 1
            out[i].append(last[i])
    return out, logits


@pytest.fixture(scope="module", params=["bf16-checkpoint", "q8_0-gguf", "q4_k_m-gguf"])
def source(request):
    return request.param


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_sequence_of_a_batch_gets_its_solo_tokens(family, source, checkpoints, converted):  # noqa: F811
    path = checkpoints(family).path if source == "bf16-checkpoint" else converted(family, source.split("-")[0])
    model = model_for(path)
    prompts = [tokens(n, seed=n).reshape(-1).tolist() for n in PROMPTS]
    solo = [alone(model, ids) for ids in prompts]
    batched_tokens, batched_logits = together(model, prompts)
    for (solo_tokens, solo_logits), got_tokens, got_logits in zip(solo, batched_tokens, batched_logits):
        assert got_tokens == solo_tokens
        for a, b in zip(got_logits, solo_logits):
            # Rows are computed independently (per-row activation quantization, per-row
            # accumulation, attention per sequence): the same numbers, not merely close.
            assert torch.equal(a, b), float((a - b).abs().max())


# Where the one-call native chain (cpu_decode._Chain) covers every layer of the tiny models:
# GLM-4.5's (a dense first layer, q|k|v bias, partial rotary, sigmoid group routing, a shared
# expert), Qwen2-MoE's (q|k|v bias, a sigmoid-gated shared expert) and DeepSeek-V3's (latent
# attention with a q LoRA, eight groups of experts) among them; under q4_k_m too, where the tiny
# models' rows, too short for K-quant blocks, are written in Q5_0, which the kernels read.
# OLMoE's q/k norm spans all heads, GPT-OSS has sliding windows and sinks.
CHAIN_CASES = {(family, source) for family in ("qwen3_moe", "mixtral", "glm4_moe", "qwen2_moe", "deepseek_v3")
               for source in ("bf16-checkpoint", "q8_0-gguf", "q4_k_m-gguf")}


def chain_against_calls(model) -> None:
    """The chain's tokens and logits for a batch of sequences of different lengths are those of
    the layer-by-layer native calls, bit for bit."""
    step = model._native_decode(len(PROMPTS))
    chain = step.chain
    prompts = [tokens(n, seed=n).reshape(-1).tolist() for n in PROMPTS]
    chained = together(model, prompts)
    step.chain = None
    try:
        calls = together(model, prompts)
    finally:
        step.chain = chain
    assert chained[0] == calls[0]
    for got, expected in zip(chained[1], calls[1]):
        for a, b in zip(got, expected):
            assert torch.equal(a, b), float((a - b).abs().max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_native_chain_gives_the_bits_of_the_calls(family, source, checkpoints, converted):  # noqa: F811
    """A decode step through every layer in one native call computes what the layer-by-layer
    native calls compute, for a batch of sequences of different lengths."""
    path = checkpoints(family).path if source == "bf16-checkpoint" else converted(family, source.split("-")[0])
    model = model_for(path)
    step = model._native_decode(len(PROMPTS))
    assert (step is not None and step.chain is not None) == ((family, source) in CHAIN_CASES), (family, source)
    if (family, source) in CHAIN_CASES:
        chain_against_calls(model)


def test_the_native_chain_takes_latent_attention_without_a_q_lora(tmp_path):
    """DeepSeek-V2-Lite's shape: q straight from the hidden state (no q_a, q_b)."""
    from tests.convert.conftest import build_checkpoint

    model = model_for(build_checkpoint(tmp_path, "deepseek_v3", overrides=dict(q_lora_rank=None)).path)
    assert model._native_decode(len(PROMPTS)).chain is not None
    chain_against_calls(model)


def test_the_native_chain_counts_the_experts_only_while_recording(checkpoints):  # noqa: F811
    model = model_for(checkpoints("qwen3_moe").path)
    ids = tokens(PROMPTS[0], seed=3).reshape(-1).tolist()
    model.stats.enabled = False
    alone(model, ids)
    assert model._decode_step.chain is not None
    assert all(not c.any() for c in model.stats.counts.values())
    model.stats.enabled = True
    model.stats.reset()
    alone(model, ids)  # the prompt's rows (all but the last token) and the decode steps
    k = model._decode_step.chain.k
    assert all(int(c.sum()) == (len(ids) - 1 + STEPS) * k for c in model.stats.counts.values())


def test_the_native_chain_refuses_what_does_not_fit(checkpoints):  # noqa: F811
    """The one-call chain checks its arguments (one message, nothing computed) rather than
    reading past a buffer."""
    model = model_for(checkpoints("qwen3_moe").path)
    step = DecodeStep.build(model, 2)
    assert step is not None and step.chain is not None
    native, layers = step.chain.native, len(step.layers)
    hidden, k = step.x.a.shape[1], step.chain.k
    x = np.zeros((2, hidden), np.float32)
    ids = np.zeros((layers, 2, k), np.int64)
    with pytest.raises(ValueError, match="one row per sequence"):
        native.run(x, np.zeros((1, 4), np.int64), np.zeros(2, np.int64), ids, None)
    with pytest.raises(ValueError, match="position out of range"):
        native.run(x, np.zeros((2, 1), np.int64), np.array([0, 10_000], np.int64), ids, None)
    with pytest.raises(ValueError, match="block table entry out of range"):
        native.run(x, np.full((2, 1), 1 << 20, np.int64), np.zeros(2, np.int64), ids, None)
    counts, cells = model.stats.table(range(layers))
    with pytest.raises(ValueError, match="outside the counts table"):
        native.run(x, np.zeros((2, 1), np.int64), np.zeros(2, np.int64), ids, None, counts[:-1], cells)
    with pytest.raises(ValueError, match="go together"):
        native.run(x, np.zeros((2, 1), np.int64), np.zeros(2, np.int64), ids, None, counts, None)
    assert not x.any() and not counts.any()  # refused before anything was computed
    with pytest.raises(ValueError, match="rows out of range"):
        native.run(np.zeros((3, hidden), np.float32), np.zeros((3, 1), np.int64), np.zeros(3, np.int64),
                   np.zeros((layers, 3, k), np.int64), None)


@pytest.mark.parametrize("quant", ["bf16-checkpoint", "q8_0", "q4_0", "q4_k_m"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_prompt_gives_the_same_logits_however_it_is_chunked(family, quant, checkpoints, converted):  # noqa: F811
    """What lets a conversation continue from the cache with exactly the logits a fresh
    prefill gives: its new tokens run as a chunk of their own, cut where the cache ended."""
    path = checkpoints(family).path if quant == "bf16-checkpoint" else converted(family, quant)
    model = model_for(path, sequences=1)
    ids = tokens(100, seed=3).reshape(-1).tolist()

    def last_logits(cuts):
        seq = model.cache.new_sequence()
        for a, b in zip((0, *cuts), (*cuts, len(ids) - 1)):
            model(torch.tensor(ids[a:b]), a, last_only=True, seq=seq, prompt=True)
        out = model.forward_batch([(seq, [ids[-1]], len(ids) - 1)])[0]
        model.cache.drop(seq)
        return out

    whole = last_logits(())
    for cuts in ((48,), (7, 48, 96), (97,), (64, 65)):
        if model.dtype == torch.float32 and quant != "bf16-checkpoint":
            # A GGUF on the CPU computes in float32 (model._default_dtype). A prompt's attention
            # runs through PyTorch's many-query kernels (SDPA, or eager_attention's products
            # with sinks), whose float32 sums are grouped by the chunk's rows and keys: the
            # logits agree to a few units in the last place (measured: at most 4, 3.8e-6 of 14),
            # which bf16 outputs had rounded away. A cut in the wrong place moves them by 0.1.
            torch.testing.assert_close(last_logits(cuts), whole, rtol=0, atol=1e-5 * float(whole.abs().max()))
        else:
            assert torch.equal(last_logits(cuts), whole), cuts


def test_a_prompts_last_rows_take_the_heads_few_token_path(converted, monkeypatch):  # noqa: F811
    """The head sees one row per sequence of a prompt, as in a decode step: the few-token path
    at any count, as there (a prompt's many-token path dequantized the whole head, in Q4_K_M
    files a Q6_K matrix of vocabulary x hidden, for those rows)."""
    model = model_for(converted("qwen3_moe", "q4_k_m"), sequences=1)
    seen = []
    head = model.lm_head.forward
    monkeypatch.setattr(model.lm_head, "forward",
                        lambda x, **kw: seen.append(native_kernels.dense_threshold()) or head(x, **kw))
    (logits,) = model.forward_batch([(model.cache.new_sequence(), tokens(9, seed=1).reshape(-1).tolist(), 0)],
                                    prompt=True)
    assert seen == [native_kernels.dense_threshold("decode")]
    # The head's float32 sums, as a decode step's logits are.
    assert model.dtype == torch.float32 and logits.dtype == torch.float32
