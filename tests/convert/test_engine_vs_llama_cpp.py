"""The engine and llama.cpp on the same quantized GGUF (Q8_0, Q4_0): close logits, same greedy tokens.

Both read the same quantized weights. llama.cpp rounds activations to 8 bits for its dot
products, and so do the engine's native kernels for CPU experts; the engine computes the
rest in float32 here. The models route every token to all their experts (see
ALL_EXPERTS in conftest): in a random tiny MoE some token always has two experts nearly
tied for a top-k slot, and rounding flips such a choice, which says nothing about the
formats or kernels under test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from gguf import GGUFReader

from hybridmoe.backend.engine.model import build_model
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.models import inspect_model
from tests.convert.conftest import build_checkpoint, llama_greedy, llama_logits, open_llama

PROMPT = [5, 77, 123, 9, 250, 31, 64, 199, 12, 88, 140, 3]
STEPS = 16


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss"])
def test_engine_matches_llama_cpp_on_the_same_file(family, quant, converted):
    path = converted(family, quant, all_experts=True)
    spec = inspect_model(path).spec
    model = build_model(spec.config, open_weights(path), max_context=64, dtype=torch.float32)
    ours = model(torch.tensor(PROMPT), 0)

    llm = open_llama(path)
    try:
        theirs = llama_logits(llm, PROMPT)
        their_tokens = llama_greedy(llm, PROMPT, STEPS)
    finally:
        llm.close()
    spread = float(theirs.abs().max())
    # llama.cpp rounds the activations of its matmuls to 8 bits and keeps an f16 cache; the
    # engine computes prompt rows on dequantized weights with float activations (no 8-bit
    # rounding: a prompt then computes the same however it is chunked). Measured: up to 5.0%
    # of the logit spread on these models (GLM-4.5, Q8_0).
    tolerance = 0.06 * spread
    max_diff = float((ours - theirs).abs().max())
    assert max_diff <= tolerance, f"max |engine - llama.cpp| = {max_diff:.4f} with logits up to {spread:.2f}"
    assert_same_choices(ours, theirs.argmax(-1), tolerance)

    # Greedy: follow llama.cpp's tokens and check the engine would have chosen each of them.
    sequence = PROMPT + their_tokens
    logits = model(torch.tensor(sequence), 0)[len(PROMPT) - 1 : -1]
    assert_same_choices(logits, torch.tensor(their_tokens), tolerance)


# llama.cpp's quantizer in a child process (it can abort the process it runs in).
QUANTIZE = textwrap.dedent("""
    import sys, llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q2_K
    sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
""")


def test_engine_matches_llama_cpp_on_its_q2_k_mix(tmp_path):
    """llama.cpp's own Q2_K mix of a model whose rows are whole K-quant super-blocks (hidden
    and widths 256): routed experts in Q2_K (gate, up) and Q3_K (down), attention in Q2_K to
    Q4_K. The engine reads the experts in place in the CPU kernels and agrees with llama.cpp
    as on the Q8_0 and Q4_0 files above."""
    from hybridmoe.backend.convert import to_gguf

    sizes = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64,
                 num_experts_per_tok=8)
    checkpoint = build_checkpoint(tmp_path / "ckpt", "qwen3_moe", overrides=sizes)
    bf16 = to_gguf(checkpoint.path, tmp_path / "m-bf16.gguf", "bf16")
    path = tmp_path / "m-q2_k.gguf"
    subprocess.run([sys.executable, "-c", QUANTIZE, str(bf16), str(path)], check=True, timeout=300,
                   capture_output=True)
    types = {t.name.split(".")[-2]: t.tensor_type.name for t in GGUFReader(path).tensors if ".0." in t.name}
    assert (types["ffn_gate_exps"], types["ffn_up_exps"], types["ffn_down_exps"]) == ("Q2_K", "Q2_K", "Q3_K"), types

    assert_matches_llama_cpp_with_experts_in_place(path, ("q2_k", "q3_k"))


def assert_matches_llama_cpp_with_experts_in_place(path, formats: tuple[str, str]) -> None:
    """The engine reads the routed experts of `path` in place in the CPU kernels as `formats`
    (gate/up, down) and agrees with llama.cpp on the same file: prompt logits, the decode
    kernels, and greedy choices, within the Q8_0 files' tolerance above."""
    from hybridmoe.backend.engine import native_experts
    from hybridmoe.backend.engine.moe import MoE

    spec = inspect_model(path).spec
    model = build_model(spec.config, open_weights(path), max_context=64, dtype=torch.float32)
    native = native_experts.native_for(next(m for m in model.modules() if isinstance(m, MoE)).host)
    assert (native.layer.format, native.layer.down_format) == formats
    ours = model(torch.tensor(PROMPT), 0)
    decode = [model(torch.tensor([t]), len(PROMPT) + i)[-1] for i, t in enumerate(PROMPT[:4])]

    llm = open_llama(path)
    try:
        theirs = llama_logits(llm, PROMPT)
        theirs_decode = llama_logits(llm, PROMPT + PROMPT[:4])[len(PROMPT):]
        their_tokens = llama_greedy(llm, PROMPT, STEPS)
    finally:
        llm.close()
    tolerance = 0.06 * float(theirs.abs().max())  # as above
    assert float((ours - theirs).abs().max()) <= tolerance
    assert float((torch.stack(decode) - theirs_decode).abs().max()) <= tolerance  # the decode kernels
    assert_same_choices(ours, theirs.argmax(-1), tolerance)
    sequence = PROMPT + their_tokens
    logits = model(torch.tensor(sequence), 0)[len(PROMPT) - 1 : -1]
    assert_same_choices(logits, torch.tensor(their_tokens), tolerance)


def assert_same_choices(ours: torch.Tensor, their_choice: torch.Tensor, tolerance: float) -> None:
    """The engine's top token is llama.cpp's, or llama.cpp's is within `tolerance` of the
    engine's best (a near tie that rounding decides); nearly all positions agree outright,
    except those where the engine's best leads its runner-up by under a sixth of `tolerance`
    (1 % of the logit spread): the rounding of 8-bit activations decides those (DeepSeek-V3,
    Q8_0: three such positions, leads of 0.004-0.06 in a spread of 14.3, with the latent maps
    read as stored, as llama.cpp reads them)."""
    best = ours.argmax(-1)
    gaps = ours.gather(1, best[:, None]) - ours.gather(1, their_choice[:, None])
    assert bool((gaps <= tolerance).all()), f"llama.cpp's token trails the engine's best by {float(gaps.max()):.3f}"
    top2 = ours.topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] >= tolerance / 6
    agree = int((best == their_choice)[decided].sum())
    assert agree >= int(decided.sum()) - 2, (f"engine and llama.cpp pick the same token at {agree} of the "
                                             f"{int(decided.sum())} positions that are no near tie")


COMMUNITY_TYPES = ("q4_1", "q5_1", "iq4_nl", "iq4_xs", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s",
                   "iq1_m")


@pytest.fixture(scope="module")
def wide_q8_0(tmp_path_factory):
    """A Qwen3-MoE model whose rows are whole super-blocks (hidden and widths 256), every
    expert routed, in Q8_0: the source the community types below are written from."""
    from hybridmoe.backend.convert import to_gguf

    tmp = tmp_path_factory.mktemp("wide")
    sizes = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64,
                 num_experts_per_tok=8)
    checkpoint = build_checkpoint(tmp / "ckpt", "qwen3_moe", overrides=sizes)
    return to_gguf(checkpoint.path, tmp / "m-q8_0.gguf", "q8_0")


@pytest.mark.parametrize("fmt", COMMUNITY_TYPES)
def test_engine_matches_llama_cpp_on_community_expert_types(fmt, wide_q8_0, tmp_path):
    """The routed experts in each type of the community GGUFs (random valid blocks at the
    spread of the Q8_0 source: backend/bench/retype.py), read in place by the CPU kernels;
    the engine agrees with llama.cpp on the prompt, the decode kernels and greedy choices, as
    on the files above."""
    from hybridmoe.backend.bench.retype import retype

    (path,) = retype(wide_q8_0, tmp_path / f"m-{fmt}.gguf", experts=fmt)
    layout = f"{fmt}x8" if fmt in ("iq4_nl", "iq4_xs") else fmt  # rows in eights: the row-interleaved copy
    assert_matches_llama_cpp_with_experts_in_place(path, (layout, layout))
