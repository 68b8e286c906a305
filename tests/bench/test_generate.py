"""`hybridmoe bench generate`'s per-token breakdown of the engine's decode step.

The parts' bytes are held to what the engine reads and to the plan's own figure for a token
(the plan is a promise: its bytes read per token are the engine's), their times to the token's
time; the report's plumbing is checked on a tiny GGUF (its speed says nothing)."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch

from hybridmoe.app import cli
from hybridmoe.backend.bench.generate import GREEDY_STEPS
from hybridmoe.backend.engine import native_kernels, step_profile
from hybridmoe.backend.engine.session import EngineBackend
from hybridmoe.backend.hardware import detect
from hybridmoe.backend.models import inspect_model
from hybridmoe.backend.plan import Workload, make
from tests.convert.conftest import build_checkpoint

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")

PROMPT, STEPS = 20, 6


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from hybridmoe.backend.convert import to_gguf

    work = tmp_path_factory.mktemp("bench-generate")
    checkpoint = build_checkpoint(work / "checkpoint", "qwen3_moe")
    return to_gguf(checkpoint.path, work / "tiny-q8_0.gguf", "q8_0")


@pytest.fixture(scope="module")
def profiled(tiny_gguf):
    """The plan, the model and the profile of STEPS decode tokens after a PROMPT-token prompt."""
    inspected = inspect_model(tiny_gguf)
    plan = make(inspected.spec, inspected.inventory, detect(measure_bandwidth=False),
                Workload(context=64, strategy="cpu-only"))
    net = EngineBackend().load(tiny_gguf, plan).model
    logits = net(torch.arange(3, 3 + PROMPT), 0, last_only=True)
    tok = int(logits[-1].argmax())
    with step_profile.recording() as profile:
        for i in range(STEPS):
            tok = int(net(torch.tensor([tok]), PROMPT + i, last_only=True)[-1].argmax())
    return plan, net, profile


def test_each_part_reads_what_the_engine_holds(profiled):
    plan, net, profile = profiled
    assert net._decode_step, "the tiny model must take the native decode step"
    layers = net._decode_step.layers
    # Routed experts: a token's k choices are distinct experts, each read once.
    expert_bytes = sum(step.ffn.expert_bytes for step in layers)
    assert profile.bytes["experts"] == STEPS * plan.experts_per_token * expert_bytes
    # Projections: their stored matrices, once a step.
    qkv = sum(step.attn.qkv_proj.native.bytes for step in layers)
    assert profile.bytes["qkv"] == STEPS * qkv
    assert profile.bytes["o"] == STEPS * sum(step.attn.o.native.bytes for step in layers)
    assert profile.bytes["router"] == STEPS * sum(step.ffn.logits.native.bytes for step in layers)
    assert profile.bytes["head"] == STEPS * net._decode_step.head.native.bytes
    # Attention reads every position so far, keys and values of every layer.
    positions = sum(PROMPT + i + 1 for i in range(STEPS))
    assert profile.bytes["attend"] == positions * plan.kv_bytes_per_token


def test_a_token_reads_the_bytes_the_plan_promises(profiled):
    """The plan's bytes per token (CPU-only, one conversation) are the weights the engine reads
    plus the cache at the full context; the engine reads the cache as far as it has come."""
    plan, _, profile = profiled
    weights = sum(profile.bytes[p] for p in ("experts", "qkv", "o", "router", "head")) / STEPS
    promised = plan.host_bytes_per_token - plan.kv_cache_bytes
    # What the plan counts beside the projections: the layers' norm weights (float32 vectors).
    assert weights <= promised <= weights * 1.02, (weights, promised)


def test_the_parts_add_up_to_the_steps(profiled):
    _, _, profile = profiled
    parts = sum(profile.seconds.values())
    assert all(profile.seconds[p] > 0 for p in ("experts", "qkv", "o", "router", "attend", "small", "head"))
    profile_copy = step_profile.StepProfile(dict(profile.seconds), dict(profile.bytes))
    profile_copy.close(parts + 0.5)
    assert profile_copy.seconds["rest"] == pytest.approx(profile.seconds["rest"] + 0.5)
    per = profile.per_token(STEPS)
    assert per["experts"]["bytes"] == profile.bytes["experts"] / STEPS


def test_nothing_is_recorded_outside_a_recording(profiled, tiny_gguf):
    _, net, _ = profiled
    assert step_profile.active is None
    net(torch.tensor([5]), PROMPT + STEPS, last_only=True)  # no profile to add to: no error, no record
    assert step_profile.active is None


@pytest.mark.slow
def test_the_report_has_the_breakdown(tiny_gguf, capsys):
    code = cli.main(["bench", "generate", str(tiny_gguf), "--backends", "engine", "--prompt-tokens", "16",
                     "--gen-tokens", "5", "--threads", "1", "--repeats", "1", "--rounds", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    engine = json.loads(out)["results"]["engine"]
    per = engine["per_token"]
    # One probe right before and one right after each timed decode pass.
    assert per["probe_gbps"] > 0 and len(engine["probe"]) == 2 and len(engine["decode_probe"]) == 1
    assert {"experts", "qkv", "o", "router", "attend", "small", "head", "sampling", "rest"} <= set(per["parts"])
    # The rate is the plain pass's; the parts are those of the same tokens again, timed.
    assert per["end_to_end"]["seconds"] == pytest.approx(1 / engine["decode_median"])
    assert per["end_to_end"]["bytes"] == pytest.approx(sum(p["bytes"] for p in per["parts"].values()))
    assert 0 < per["end_to_end"]["of_probe"]
    for name in ("experts", "qkv", "head"):
        assert per["parts"][name]["gbps"] > 0 and per["parts"][name]["of_probe"] > 0
    # Which executor computed the tokens: every layer of the tiny Qwen3-MoE in the native chain.
    assert engine["decode_path"] == "decode: native chain, all 2 layers"

    saved = tiny_gguf.parent / "bench.json"
    cli.main(["bench", "generate", str(tiny_gguf), "--backends", "engine", "--prompt-tokens", "16",
              "--gen-tokens", "5", "--threads", "1", "--repeats", "1", "--rounds", "1", "--out", str(saved)])
    text = capsys.readouterr().out
    assert set(json.loads(saved.read_text())["results"]) == {"engine"}  # --out: the results beside the table
    assert "engine decode, one token part by part" in text
    assert "the engine's decode: native chain, all 2 layers" in text
    assert "routed experts" in text and "between calls" in text
    assert "end to end:" in text and "of the probe" in text
    assert "the plan's figure:" in text and engine["plan_bytes_per_token"] > per["end_to_end"]["bytes"] * 0.9


@pytest.mark.slow
def test_both_backends_decode_in_alternation_in_one_process(tiny_gguf, capsys):
    """The paired figure: each pair's passes cover the same positions, the order alternating."""
    pytest.importorskip("llama_cpp")
    code = cli.main(["bench", "generate", str(tiny_gguf), "--prompt-tokens", "16", "--gen-tokens", "5",
                     "--threads", "1", "--repeats", "1", "--rounds", "1", "--pairs", "3", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    paired = json.loads(out)["paired"]
    assert paired["pairs"] == 3 and len(paired["engine"]) == len(paired["llamacpp"]) == len(paired["ratios"]) == 3
    assert paired["ratios"] == [e / lc for e, lc in zip(paired["engine"], paired["llamacpp"])]
    low, high = paired["quartiles"]
    assert min(paired["ratios"]) <= low <= paired["median"] <= high <= max(paired["ratios"])
    # The engine's share of the probe at its paired rate: its bytes a token, the probes before and after.
    nbytes = json.loads(out)["results"]["engine"]["per_token"]["end_to_end"]["bytes"]
    assert len(paired["probe"]) == 2 and all(p > 0 for p in paired["probe"])
    assert paired["engine_of_probe"] == pytest.approx(
        nbytes * statistics.median(paired["engine"]) / statistics.median(paired["probe"]))
    # Then both rewound to the prompt: llama.cpp's greedy tokens fed to the engine, every step
    # compared; each difference a token llama.cpp ranked first and the engine did not.
    forced = paired["greedy"]
    assert forced["steps"] == GREEDY_STEPS and len(forced["differences"]) == GREEDY_STEPS - forced["same"]
    assert all(d["llamacpp_margin"] >= 0 < d["engine_margin"] for d in forced["differences"])
    # The rows line up: the engine's logits before each of llama.cpp's tokens are close to its
    # own (a row off by one step, or a cache not rewound, would be as far apart as two steps').
    assert 0 < forced["distance"] < 0.1
    cli.main(["bench", "generate", str(tiny_gguf), "--prompt-tokens", "16", "--gen-tokens", "5", "--threads", "1",
              "--repeats", "1", "--rounds", "1", "--pairs", "2"])
    text = capsys.readouterr().out
    assert "in alternation in one process (2 pairs of 16-token passes at the same positions): decode" in text
    assert "; greedy tokens teacher-forced: " in text and f"/{GREEDY_STEPS}" in text
    assert "the engine at " in text and "% of the probe)" in text


def test_the_report_says_how_long_the_greedy_tokens_agree():
    from hybridmoe.backend.bench.generate import table

    run = {"load_s": 1.0, "rss_after_load": 1 << 30, "rss_peak": 1 << 30, "prefill_median": 10.0,
           "decode_median": 5.0}
    summary = {"model": "m.gguf", "prompt_tokens": 8, "gen_tokens": 4, "threads": 2, "repeats": 1, "rounds": 1,
               "results": {"engine": dict(run, tokens=[1, 2, 3, 4]), "llamacpp": dict(run, tokens=[1, 2, 9, 4])},
               "decode_ratio": 1.0, "prefill_ratio": 1.0, "same_greedy_tokens": False, "greedy_tokens_in_common": 2}
    assert table(summary).endswith("greedy tokens the same for the first 2 of 4")
    summary.update(same_greedy_tokens=True, greedy_tokens_in_common=4)
    assert table(summary).endswith("greedy tokens the same")


def test_the_report_bounds_the_ratio_by_the_wall():
    from hybridmoe.backend.bench.generate import summarize, table

    passes = [{"experts": {"seconds": 0.01, "bytes": 200e6}, "rest": {"seconds": 0.002, "bytes": 0}}]
    run = {"load_s": 1.0, "rss_after_load": 1 << 30, "rss_peak": 1 << 30, "prefill": [10.0], "probe": [20e9]}
    engine = dict(run, decode=[80.0], tokens=[1, 2], breakdown=passes)
    llama = dict(run, decode=[50.0], tokens=[1, 2])
    summary = summarize("m.gguf", 8, 2, 2, 1, 1, {"engine": engine, "llamacpp": llama})
    # 200 MB a token at 50 tokens/s is 10 GB/s: half of the 20 GB/s probe, so at most 2x at the wall.
    assert summary["llamacpp_of_probe"] == pytest.approx(0.5)
    assert summary["decode_ratio_at_wall"] == pytest.approx(2.0)
    assert "llama.cpp read 50% of the probe on the same bytes per token: at the wall, decode would be 2.00x" in table(summary)


def test_each_pass_is_set_against_the_probes_around_it():
    """The bandwidth moves between the passes: a pass's share of the probe is its own rate
    against the probes taken around it, and the ratio of the two backends' median shares is
    the decode ratio with the drift taken out."""
    from hybridmoe.backend.bench.generate import summarize, table

    passes = [{"experts": {"seconds": 0.01, "bytes": 200e6}}] * 3
    run = {"load_s": 1.0, "rss_after_load": 1 << 30, "rss_peak": 1 << 30, "prefill": [10.0] * 3}
    # The engine ran while the machine gave 40, 20, 40 GB/s; llama.cpp while it gave 20 GB/s.
    engine = dict(run, decode=[160.0, 80.0, 160.0], decode_probe=[40e9, 20e9, 40e9], probe=[40e9, 20e9, 40e9],
                  tokens=[1], breakdown=passes)
    llama = dict(run, decode=[50.0] * 3, decode_probe=[20e9] * 3, probe=[20e9] * 3, tokens=[1])
    summary = summarize("m.gguf", 8, 2, 2, 3, 1, {"engine": engine, "llamacpp": llama})
    assert summary["results"]["engine"]["per_token"]["end_to_end"]["of_probe"] == pytest.approx(0.8)
    assert summary["llamacpp_of_probe"] == pytest.approx(0.5)
    assert summary["decode_ratio"] == pytest.approx(3.2)  # 160 / 50: the engine's fast moments counted
    assert summary["decode_ratio_per_bandwidth"] == pytest.approx(1.6)
    assert "decode 3.20x (1.60x pass by pass against the probes around each)" in table(summary)


def test_the_plans_expected_figures_are_printed_beside_the_measured(tiny_gguf, capsys):
    """bench generate prints, per backend, the plan's expected decode and prefill figures for
    what it runs (made before the run) beside the measured ones; the printed figures are the
    plan's own."""
    from hybridmoe.backend.bench.generate import plan_expectation
    from hybridmoe.backend.hardware import achieved, detect
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.plan import Workload, make

    code = cli.main(["bench", "generate", str(tiny_gguf), "--backends", "engine", "--prompt-tokens", "16",
                     "--gen-tokens", "5", "--threads", "1", "--repeats", "1", "--rounds", "1", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    summary = json.loads(out)
    predicted = summary["plan_expected"]["engine"]
    assert predicted["decode"] > 0 and predicted["prefill"] > 0 and predicted["decode"] < predicted["decode_bound"]
    inspected = inspect_model(tiny_gguf)
    # The plan's arithmetic with the same inputs (the bandwidth read once in this process).
    expected = plan_expectation(str(tiny_gguf), 16 + 5 + 8, 16)["engine"]
    plan = make(inspected.spec, inspected.inventory, detect(measure_bandwidth=True),
                Workload(context=16 + 5 + 8, strategy="cpu-only", backend="engine", prefill_chunk=16))
    assert expected["decode"] == plan.decode_tokens_per_s_expected
    assert expected["prefill"] == plan.prefill_tokens_per_s_expected
    from hybridmoe.backend.bench.generate import table

    text = table({**summary, "plan_expected": {"engine": expected}})
    measured = summary["results"]["engine"]["decode_median"]
    assert (f"engine     measured decode {measured:.1f} tok/s, the plan expected {expected['decode']:.1f}" in text)
    assert f"at most {expected['decode_bound']:.1f}" in text and f"expected {expected['prefill']:.1f}" in text
    assert f"the plan's expected prefill, the engine: {expected['prefill_how']}" in text
    # A tiny model's token is timed by its fixed costs, not its reads: its rate is not kept
    # for this machine (a mid-size model's is: tests/plan/test_expected.py).
    assert summary["results"]["engine"]["per_token"]["end_to_end"]["bytes"] < achieved.MIN_BYTES_PER_TOKEN
    assert achieved.lookup(detect(measure_bandwidth=False)) is None


def test_a_run_keeps_the_engines_prompt_rate_and_an_i_quants_decoding_rate():
    """What bench generate keeps for this machine (hardware.achieved): the prompt's flops at the
    measured prompt rate; for a format whose decoding limits it, the expert weights a core decoded
    per second, and not a read rate; for the others, the read rate."""
    from hybridmoe.backend.bench.generate import record_engine_rate
    from hybridmoe.backend.hardware import achieved, detect

    here = detect(measure_bandwidth=False)
    engine = {"per_token": {"end_to_end": {"gbps": 13.0, "bytes": 200e6, "seconds": 0.015, "of_probe": 0.4},
                            "parts": {"experts": {"seconds": 0.008, "bytes": 78e6}}},
              "prefill_median": 300.0, "prompt_tokens": 512}
    iq2 = {"expert_format": "iq2_xxs", "expert_bytes_per_weight": 2.0625 / 8, "prefill_cpu_flops_per_token": 1e9}
    record_engine_rate(engine, "bench generate", iq2, threads=2)
    per_core, where, _ = achieved.lookup_rate(here, "expert_weights_per_s_per_core", "iq2_xxs")
    assert per_core == pytest.approx(78e6 / (2.0625 / 8) / 0.008 / 2) and "on 2 cores" in where
    assert achieved.lookup(here) is None  # its reads say nothing of the read rate
    assert achieved.lookup_rate(here, "prefill_flops_per_s", "iq2_xxs")[0] == pytest.approx(300e9)
    # A Q4_0 run: the read rate; a short prompt's rate is not kept.
    record_engine_rate({**engine, "prompt_tokens": 16}, "bench generate", {**iq2, "expert_format": "q4_0"}, threads=2)
    assert achieved.lookup(here)[0] == pytest.approx(200e6 / 0.015)
    assert achieved.lookup_rate(here, "prefill_flops_per_s", "q4_0") is None
    assert achieved.lookup_rate(here, "expert_weights_per_s_per_core", "q4_0") is None


def test_the_sweep_gives_the_engine_share_of_the_probe_at_its_paired_rate():
    """The sweep's "of probe" column: the paired passes' figure where they ran, else the
    engine worker's own pass; its greedy column the teacher-forced comparison's."""
    from hybridmoe.backend.bench.generate import sweep_table

    engine = {"tokens": [1] * 4, "per_token": {"end_to_end": {"of_probe": 0.5}}}
    forced = {"steps": 4, "same": 4, "differences": [], "distance": 0.01}

    def row(paired: dict) -> dict:
        d64 = {"results": {"engine": engine}, "greedy_tokens_in_common": 4, "decode_ratio": 1.5, "paired": paired}
        return {"type": "iq2_xs", "bytes": 2e9, "decode_64": d64, "decode_2048": {"decode_ratio": 1.4},
                "prefill_512": {"prefill_ratio": 1.1}}

    paired = {"median": 2.0, "engine_of_probe": 0.8, "greedy": forced}
    with_pairs = sweep_table({"model": "m.gguf", "types": [row(paired)]})
    assert with_pairs.splitlines()[2].split() == ["iq2_xs", "2.00", "2.00x", "80%", "1.40x", "1.10x", "4/4"]
    alone = sweep_table({"model": "m.gguf", "types": [row({})]})  # no pairs: no forced comparison either
    assert alone.splitlines()[2].split() == ["iq2_xs", "2.00", "1.50x", "50%", "1.40x", "1.10x", "-"]


def test_teacher_forced_differences_carry_both_margins():
    """Every step is compared (llama.cpp's tokens fed to both); a difference says how far apart
    the two tokens were in each backend's logits, and the words say whether that was a near tie."""
    from hybridmoe.backend.bench.greedy import compare, in_words

    theirs = [np.array([0.0, 1.0, 0.5]), np.array([2.0, 0.0, 1.998]), np.array([0.0, 0.0, 3.0])]
    ours = [np.array([0.0, 1.1, 0.4]), np.array([1.9, 0.0, 2.0]), np.array([0.5, 0.0, 2.0])]
    result = compare([1, 0, 2], theirs, ours)
    assert result["steps"] == 3 and result["same"] == 2
    (d,) = result["differences"]
    assert (d["step"], d["engine"], d["llamacpp"]) == (1, 2, 0)
    assert d["llamacpp_margin"] == pytest.approx(0.002) and d["engine_margin"] == pytest.approx(0.1)
    assert in_words(result) == "2/3 (near ties: llama.cpp margins up to 0.0020)"
    theirs[2] = np.array([2.9, 0.0, 3.0])
    ours[2] = np.array([3.0, 0.0, 2.0])
    assert in_words(compare([1, 0, 2], theirs, ours)) == "1/3 (llama.cpp margins 0.0020, 0.1000)"
    assert in_words(compare([1, 0, 2], theirs, theirs)) == "3/3"
