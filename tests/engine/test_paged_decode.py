"""The GPU decode attention kernels (``paged_decode``: grouped-query and latent) compute what
the reference attention computes, and write the cache the reference reads.

On CUDA the engine takes them for decode rows, and there this test runs them compiled; elsewhere
Triton's interpreter runs them on CPU tensors, in a process of its own (the interpreter is chosen
when Triton is imported). Each model decodes with the kernels and, beside it, the same model
without them; the kernels' steps alternate with reference steps, so that what one path writes
into the cache the other reads.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.convert.conftest import checkpoints  # noqa: F401 - fixture: tiny checkpoints
from tests.engine.conftest import run_kernel_check

CHECK = textwrap.dedent("""
    import json, sys
    DEVICE = sys.argv[2]
    import torch
    from hybridmoe.backend.engine import paged_decode
    from hybridmoe.backend.engine.model import build_model
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.models import inspect_model

    on = {"kernels": False, "taken": 0}

    def decode_rows(x, segments):  # every condition of the kernels' but the device's
        taken = on["kernels"] and all(s.n == 1 and s.start < paged_decode.MAX_KEYS for s in segments)
        on["taken"] += taken
        return taken

    paged_decode._decode_rows = decode_rows
    kernel_attend, kernel_latent, layer_errors = paged_decode.attend, paged_decode.attend_latent, []

    def relative(got, want):
        return float((got.float() - want.float()).abs().max() / want.float().abs().max())

    def checked(kernel, stores, reference):
        # The kernels' output and cache writes against the reference's on the same inputs:
        # `stores` the cache tensors the kernels write (keys first), `reference()` the
        # reference's output, computed on the cache as it was before the kernels wrote it.
        held = [t.clone() for t in stores]
        got = kernel()
        wrote = [t.clone() for t in stores]
        for t, h in zip(stores, held):
            t.copy_(h)
        want = reference()
        values_err = float((wrote[1].float() - stores[1].float()).abs().max()) if len(stores) > 1 else 0.0
        layer_errors.append([relative(got, want), relative(wrote[0], stores[0]), values_err])
        for t, w in zip(stores, wrote):
            t.copy_(w)
        return got

    def layer_of(cache):
        return next(m for m in models[0].modules() if getattr(m, "cache", None) is cache)

    def checked_attend(q, k, v, segments, cache, rotary, q_norm, k_norm, scale):
        def reference():
            qn, kn = (q_norm(q), k_norm(k)) if q_norm is not None else (q, k)
            return torch.cat([layer_of(cache)._attend(qn[s.rows], kn[s.rows], v[s.rows], s) for s in segments])

        return checked(lambda: kernel_attend(q, k, v, segments, cache, rotary, q_norm, k_norm, scale),
                       [cache.k, cache.v], reference)

    def checked_latent(q, latent, rope_key, segments, cache, rotary, kv_b, nope_dim, scale):
        def reference():
            return torch.cat([layer_of(cache)._attend(q[s.rows], latent[s.rows], rope_key[s.rows], s)
                              for s in segments])

        return checked(lambda: kernel_latent(q, latent, rope_key, segments, cache, rotary, kv_b, nope_dim, scale),
                       [cache.kv], reference)

    paged_decode.attend = checked_attend
    paged_decode.attend_latent = checked_latent
    out = []
    for case in json.loads(sys.argv[1]):
        spec = inspect_model(case["path"]).spec
        dtype = getattr(torch, case["dtype"])
        models = [build_model(spec, open_weights(case["path"]), device=DEVICE, dtype=dtype, max_context=160,
                              sequences=3) for _ in range(2)]
        for m in models:
            m.native_decode = False  # the layer-by-layer path, whose attention the kernels replace
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in (61, 5, 70)]
        seqs = [[m.cache.new_sequence() for _ in prompts] for m in models]
        worst, taken0 = 0.0, on["taken"]
        layer_errors.clear()
        for m, ss in zip(models, seqs):
            for s, p in zip(ss, prompts):
                m(torch.tensor(p, device=DEVICE), 0, seq=s, prompt=True)
        tokens = [p[-1] for p in prompts]
        # one sequence alone across a block boundary, then all three in one step
        for step in range(8):
            rows = [0] if step < 5 else [0, 1, 2]
            calls = [[(ss[i], [tokens[i]], len(prompts[i]) + step) for i in rows] for ss in seqs]
            for i in range(len(prompts)):
                if i not in rows:  # keeps positions in step: the idle ones take the token alone
                    for m, ss in zip(models, seqs):
                        m.forward_batch([(ss[i], [tokens[i]], len(prompts[i]) + step)])
            on["kernels"] = step % 2 == 0  # the kernels' steps between reference ones
            got = models[0].forward_batch(calls[0])
            on["kernels"] = False
            want = models[1].forward_batch(calls[1])
            for a, b in zip(got, want):
                worst = max(worst, float((a - b).abs().max() / b.abs().max()))
            tokens = [int(w.argmax()) for w in want] if len(rows) == 3 else [int(want[0].argmax())] + tokens[1:]
        out.append({**case, "err": worst, "taken": on["taken"] - taken0,
                    "layer_err": [max(e[i] for e in layer_errors) if layer_errors else None for i in range(3)]})
    print(json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_decode_attention_kernels_compute_what_the_reference_computes(checkpoints, tmp_path):  # noqa: F811
    cases = [
        {"family": "qwen3_moe", "dtype": "float32"},  # q/k norm per head
        {"family": "qwen3_moe", "dtype": "bfloat16"},
        {"family": "glm4_moe", "dtype": "float32"},  # partial rotary, q/k/v biases
        {"family": "mixtral", "dtype": "bfloat16"},  # no q/k norm
        {"family": "olmoe", "dtype": "float32"},  # q/k norm over the whole projection
        {"family": "deepseek_v3", "dtype": "float32"},  # latent attention, rotary pairs
        {"family": "deepseek_v3", "dtype": "bfloat16"},
        {"family": "gpt_oss", "dtype": "float32"},  # sliding and sink layers: the reference path
    ]
    for case in cases:
        case["path"] = str(checkpoints(case["family"]).path)
    for row in run_kernel_check(CHECK, cases, tmp_path, timeout=900):
        if row["family"] == "gpt_oss":
            assert row["taken"] == 0, row
            continue
        assert row["taken"] > 0, row
        attention_err, keys_err, values_err = row["layer_err"]
        assert values_err == 0, row
        if row["dtype"] == "float32":
            assert row["err"] < 1e-5 and attention_err < 1e-5 and keys_err < 1e-6, row
        else:
            # bf16: keys and attention output within a few roundings of the reference's (Triton's
            # interpreter rounds to bf16 by truncation, the cards to nearest; the float32 sums
            # run in another order). The logits are not compared: one expert choice flipped by
            # such a rounding moves a random tiny model's logits by tenths.
            assert keys_err < 3e-2 and attention_err < 5e-2, row


def test_a_device_the_kernels_fail_on_takes_the_reference(checkpoints, monkeypatch, caplog):  # noqa: F811
    """Where the kernels cannot run (standing in here: CPU tensors, which compiled Triton
    kernels cannot read), the step computes what the reference computes, the device is
    remembered (no second try) and the reason is logged once."""
    import torch

    from hybridmoe.backend.engine import paged_decode
    from tests.engine.conftest import engine

    models = [engine(checkpoints("qwen3_moe").path, device="cpu") for _ in range(2)]
    for m in models:
        m.native_decode = False
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    want = [models[1](prompt, 0, last_only=True)] + [models[1](torch.tensor([[t]]), 5 + i) for i, t in enumerate((9, 2))]

    monkeypatch.setattr(paged_decode, "_failed", {})
    monkeypatch.setattr(paged_decode, "applies", lambda x, *a: x.device not in paged_decode._failed)
    tries, launch = [], paged_decode.attend
    monkeypatch.setattr(paged_decode, "attend", lambda *args, **kw: tries.append(1) or launch(*args, **kw))
    with caplog.at_level("WARNING", logger=paged_decode.__name__):
        got = [models[0](prompt, 0, last_only=True)] + [models[0](torch.tensor([[t]]), 5 + i)
                                                         for i, t in enumerate((9, 2))]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert list(paged_decode._failed) == [torch.device("cpu")] and len(tries) == 1
    assert len([r for r in caplog.records if "GPU decode attention kernels unavailable" in r.getMessage()]) == 1
