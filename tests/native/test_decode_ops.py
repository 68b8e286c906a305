"""The small native decode steps (native/src/decode_ops.cpp) against the engine's PyTorch modules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.backend.engine import native_kernels
from hybridmoe.backend.models.hf_config import RopeParams
from hybridmoe.backend.engine.layers import RMSNorm
from hybridmoe.backend.engine.rope import Rotary
from hybridmoe.backend.engine.routing import SigmoidGroupedTopK, SoftmaxTopK, TopKSoftmax

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")

_native = native_kernels._native


@pytest.mark.parametrize("shape", [(1, 2048), (3, 128), (5, 7)])
def test_rms_norm_matches_the_module(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x, w = 3 * torch.randn(*shape, generator=g), torch.rand(shape[-1], generator=g) + 0.5
    out = torch.empty_like(x)
    _native.rms_norm(x, w, 1e-6, out)
    torch.testing.assert_close(out, RMSNorm(w, 1e-6)(x), rtol=2e-6, atol=1e-6)
    _native.rms_norm(x, w, 1e-6, x)  # in place
    torch.testing.assert_close(x, out)


@pytest.mark.parametrize("n", [7168, 2048, 5])
def test_rms_norm_is_llama_cpps_arithmetic(n):
    """Each square in float32, their sum in float64, the mean back in float32, then x times
    1 / sqrt(mean + eps), times the weight (ggml's rms_norm and mul): the same bits, which the
    next block's Q8 codes round on."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(4, n, generator=g) * torch.logspace(-3, 2, n)).numpy()  # a wide spread of magnitudes
    w = (torch.rand(n, generator=g) + 0.5).numpy()
    squares = (x * x).astype(np.float64)
    mean = (squares.sum(-1, keepdims=True) / n).astype(np.float32)
    inv = np.float32(1) / np.sqrt(mean + np.float32(1e-6))
    expected = (x * inv) * w
    out = np.empty_like(x)
    _native.rms_norm(x, w, 1e-6, out)
    assert np.array_equal(out, expected)
    _native.rms_norm(x, None, 1e-6, out)  # unweighted
    assert np.array_equal(out, x * inv)
    # The module on the CPU computes with it, as the decode step does.
    assert torch.equal(RMSNorm(torch.from_numpy(w), 1e-6)(torch.from_numpy(x)), torch.from_numpy(expected))


def test_rms_norm_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="as long as w"):
        _native.rms_norm(torch.zeros(1, 8), torch.ones(4), 1e-6, torch.zeros(1, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_embed_rows_is_the_embedding_in_float32(dtype):
    table = torch.randn(50, 24, generator=torch.Generator().manual_seed(3)).to(dtype)
    tokens = [7, 0, 49, 7]
    out = np.full((5, 24), np.nan, dtype=np.float32)  # room for more rows than the step has
    view = table.view(torch.uint16).numpy() if dtype == torch.bfloat16 else table.numpy()  # NumPy has no bf16
    _native.embed_rows(view, tokens, out)
    assert torch.equal(torch.from_numpy(out[:4]), table[tokens].float())  # exact: widening only
    assert np.isnan(out[4]).all()


def test_embed_rows_refuses_a_token_outside_the_vocabulary():
    table, out = np.zeros((10, 4), np.float32), np.zeros((1, 4), np.float32)
    for bad in (10, -1):
        with pytest.raises(IndexError, match=f"token id {bad} is outside the vocabulary"):
            _native.embed_rows(table, [bad], out)
    with pytest.raises(ValueError, match="a row of the table's width"):
        _native.embed_rows(table, [1, 2], out)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        _native.embed_rows(np.zeros((10, 4), np.int32), [1], out)


# (query heads, KV heads, head size, rotary dims, layout): Qwen3 (full rotary, q/k norm),
# GLM-4.5 (half the head rotates), DeepSeek's interleaved pairs.
CASES = [(8, 2, 32, 32, "halves", True), (4, 2, 16, 8, "halves", True), (4, 4, 24, 24, "pairs", False)]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_rope_store_matches_norm_rotary_and_cache_write(case, cache_dtype):
    hq, hkv, d, rd, layout, qk_norm = case
    g = torch.Generator().manual_seed(d)
    rotary = Rotary(RopeParams("default", 10000.0, 1.0, {}), rd, 64, 64, layout=layout)
    q_w, k_w = (torch.rand(d, generator=g) + 0.5 for _ in range(2))
    qkv = torch.randn(1, hq * d + 2 * hkv * d, generator=g)
    k_cache, v_cache = torch.zeros(hkv, 64, d, dtype=cache_dtype), torch.zeros(hkv, 64, d, dtype=cache_dtype)
    pos = 37
    q_out = torch.empty(hq, d)
    _native.rope_store(qkv, hq, hkv, q_w if qk_norm else None, k_w if qk_norm else None, 1e-6, rotary.cos,
                       rotary.sin, layout == "pairs", k_cache, v_cache, pos, q_out)

    q, k, v = qkv[0].split((hq * d, hkv * d, hkv * d))
    q, k, v = q.view(1, hq, 1, d), k.view(1, hkv, 1, d), v.view(hkv, d)
    if qk_norm:
        q, k = RMSNorm(q_w, 1e-6)(q), RMSNorm(k_w, 1e-6)(k)
    cos, sin = rotary.tables(pos, 1, torch.float32)
    q, k = rotary.apply(q, cos, sin), rotary.apply(k, cos, sin)
    torch.testing.assert_close(q_out, q.view(hq, d), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k_cache[:, pos], k.view(hkv, d).to(cache_dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v_cache[:, pos], v.to(cache_dtype), rtol=0, atol=0)
    others = torch.ones(64, dtype=torch.bool)
    others[pos] = False
    assert not k_cache[:, others].any() and not v_cache[:, others].any()  # nothing else written


def test_a_float16_cache_holds_what_torchs_conversion_gives():
    """The decode step writes the cache natively, a prompt through PyTorch: the two must round
    alike, to nearest even, at the edges too (the largest half and past it, the smallest normal,
    subnormals, halfway cases, NaN)."""
    edges = [65504.0, 65519.0, 65520.0, 1e5, -7e4, 6.1035156e-5, 6.1e-5, 1e-7, 2.9e-8, 3e-8, 5.960464477539063e-08,
             1.0 + 2**-11, 1.0 + 3 * 2**-11, -(2.0 + 2**-10), 0.0, -0.0, float("inf"), float("nan")]
    g = torch.Generator().manual_seed(1)
    v = torch.cat((torch.tensor(edges), 100 * torch.randn(16 * 40 - len(edges), generator=g)))
    for h in range(0, v.numel(), 16):
        qkv = torch.cat((torch.zeros(32), v[h:h + 16])).view(1, -1)  # q and k zero, v the values
        k_cache, v_cache = torch.zeros(1, 4, 16, dtype=torch.float16), torch.zeros(1, 4, 16, dtype=torch.float16)
        _native.rope_store(qkv, 1, 1, None, None, 1e-6, torch.ones(4, 4), torch.zeros(4, 4), False, k_cache, v_cache, 2,
                           torch.empty(1, 16))
        assert torch.equal(v_cache[0, 2].view(torch.int16), v[h:h + 16].half().view(torch.int16)), h


def test_rope_store_refuses_a_position_past_the_cache():
    cos = torch.ones(8, 4)
    with pytest.raises(ValueError, match="position out of range"):
        _native.rope_store(torch.zeros(3 * 8), 1, 1, None, None, 1e-6, cos, cos, False, torch.zeros(1, 8, 8),
                           torch.zeros(1, 8, 8), 8, torch.zeros(1, 8))


@pytest.mark.parametrize("seed", range(20))
def test_routers_choose_what_the_modules_choose(seed):
    """Each router's module run on an identity projection (its logits are then the input)."""
    g = torch.Generator().manual_seed(seed)
    E, k = 16, 4
    logits = 2 * torch.randn(1, E, generator=g)
    eye = torch.eye(E)
    bias = 0.3 * torch.randn(E, generator=g)

    def native(fn, *args):
        ids, w = torch.empty(1, k, dtype=torch.int64), torch.empty(1, k)
        fn(logits, *args, ids, w)
        order = ids[0].argsort()
        return ids[0][order], w[0][order]

    def reference(router):
        ids, w = router(logits)
        order = ids[0].argsort()
        return ids[0][order], w[0].float()[order]

    for normalize in (True, False):
        ours = native(_native.softmax_topk, k, normalize)
        ref = reference(SoftmaxTopK(eye, k, normalize=normalize, float32_weights=True))
        assert torch.equal(ours[0], ref[0])
        torch.testing.assert_close(ours[1], ref[1])
        ours = native(_native.sigmoid_group_topk, bias, k, 4, 2, normalize, 2.5)
        ref = reference(SigmoidGroupedTopK(eye, bias, k, n_group=4, topk_group=2, normalize=normalize, scaling=2.5))
        assert torch.equal(ours[0], ref[0])
        torch.testing.assert_close(ours[1], ref[1])
    ours = native(_native.topk_softmax, k)
    ref = reference(TopKSoftmax(eye, torch.zeros(E), k))
    assert torch.equal(ours[0], ref[0])
    torch.testing.assert_close(ours[1], ref[1])


def test_group_routing_chooses_what_transformers_chooses_at_deepseek_v3s_shape():
    """Eight groups of 16 experts, the best four groups by their top-two scores, the top 8 of
    those, by score plus correction bias (the tiny models' parity tests have 8 experts in 4
    groups): the module and the native router against transformers' own router."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(hidden_size=64, n_routed_experts=128, num_experts_per_tok=8, n_group=8,
                                           topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.3)
        x = torch.randn(200, 64)
        _, want_w, want_ids = router(x)
        weight, bias = router.weight.detach().clone(), router.e_score_correction_bias.detach().clone()
        module = SigmoidGroupedTopK(weight, bias, 8, n_group=8, topk_group=4, normalize=True, scaling=2.5)
        ids, w = module(x)
        logits = x @ weight.T
    for t in range(len(x)):
        order, want = want_ids[t].argsort(), want_ids[t].sort().values
        ours = ids[t].argsort()
        assert torch.equal(ids[t][ours], want)
        torch.testing.assert_close(w[t].float()[ours], want_w[t][order])
        native_ids, native_w = torch.empty(1, 8, dtype=torch.int64), torch.empty(1, 8)
        _native.sigmoid_group_topk(logits[t : t + 1], bias, 8, 8, 4, True, 2.5, native_ids, native_w)
        mine = native_ids[0].argsort()
        assert torch.equal(native_ids[0][mine], want)
        torch.testing.assert_close(native_w[0][mine], want_w[t][order])


def test_router_arguments_are_checked():
    ids, w = torch.empty(1, 2, dtype=torch.int64), torch.empty(1, 2)
    with pytest.raises(ValueError, match="k must be"):
        _native.softmax_topk(torch.zeros(1, 8), 9, True, ids, w)
    with pytest.raises(ValueError, match="groups of two"):
        _native.sigmoid_group_topk(torch.zeros(1, 8), None, 2, 3, 1, True, 1.0, ids, w)
