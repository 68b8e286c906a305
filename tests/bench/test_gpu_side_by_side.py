"""`hybridmoe bench generate FILE --plan PLAN`: the engine's hybrid layout against llama.cpp with
the same routed experts on the GPU (backend/bench/gpu_side_by_side.py).

The plan -> llama.cpp mapping is a pure function, checked on its own; that llama.cpp then puts
exactly those tensors where asked is checked with the real llama-cpp-python on a tiny GGUF (its
load log names every tensor an override moved); the whole run, both worker processes taking
turns, on the same file with the CPU standing in for the GPU (its speed says nothing here)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from hybridmoe.app import cli
from hybridmoe.backend.bench import gpu_side_by_side as side
from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.plan.llamacpp import expert_override_pattern

# A DeepSeek-V3-like file's tensor names: a dense first block, shared experts, the routing bias,
# and block numbers whose prefixes collide (1 and 10, 11).
NAMES = ["token_embd.weight", "output.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "blk.0.ffn_gate.weight"]
for _i in range(1, 12):
    NAMES += [f"blk.{_i}.{t}.weight" for t in ("ffn_up_exps", "ffn_down_exps", "ffn_gate_exps", "ffn_up_shexp",
                                               "ffn_gate_inp", "attn_kv_a_mqa", "attn_output")]
    NAMES.append(f"blk.{_i}.exp_probs_b.bias")


def overridden(layout: side.LlamaLayout, names=NAMES) -> set[str]:
    """What llama.cpp's regex_search over each tensor name would move with these overrides."""
    patterns = [re.compile(o.rpartition("=")[0]) for o in layout.override_tensor]
    return {n for n in names if any(p.search(n) for p in patterns)}


def test_whole_layers_of_half_the_experts_are_the_last_layers():
    gpu = side.whole_layers(range(1, 12), 8, 0.5)
    assert [layer for layer, ids in gpu.items() if ids] == [6, 7, 8, 9, 10, 11]  # round(5.5) = 6 layers
    assert all(ids == tuple(range(8)) for layer, ids in gpu.items() if layer >= 6)
    assert not any(side.whole_layers(range(4), 8, 0.0).values())
    assert all(len(ids) == 8 for ids in side.whole_layers(range(4), 8, 1.0).values())
    with pytest.raises(UsageError, match="between 0 and 1"):
        side.whole_layers(range(4), 8, 1.5)


def test_the_plans_whole_layers_become_exactly_their_overrides():
    layout = side.llamacpp_layout(side.whole_layers(range(1, 12), 8, 0.5), range(1, 12), 8)
    assert layout.gpu_layers == (6, 7, 8, 9, 10, 11) and layout.cpu_layers == (1, 2, 3, 4, 5)
    assert layout.exact and layout.engine_gpu_experts == layout.llamacpp_gpu_experts == 48
    assert layout.override_tensor == (expert_override_pattern([1, 2, 3, 4, 5]),)
    # Exactly the routed experts of blocks 1-5: not block 10's or 11's, not the shared expert,
    # the router or the routing bias.
    want = {f"blk.{i}.{t}.weight" for i in range(1, 6) for t in ("ffn_up_exps", "ffn_down_exps", "ffn_gate_exps")}
    assert overridden(layout) == want == side.cpu_expert_tensors(NAMES, layout)
    settings = layout.settings(block_count=12, context=4200, threads=4, gpu=True)
    assert settings["n_gpu_layers"] == 13 and settings["n_cpu_moe"] == 0 and settings["use_mmap"] is False
    assert settings["override_tensor"] == list(layout.override_tensor)
    assert "-ngl 13 -ot 'blk\\.(1|2|3|4|5)\\.ffn_" in layout.command(12)
    assert layout.command(12).endswith("-ub 2048 --no-mmap") and layout.command(12, gpu=False).endswith("-ub 512")


def test_every_layer_on_the_gpu_needs_no_override_and_none_moves_them_all():
    everything = side.llamacpp_layout({layer: range(8) for layer in range(1, 12)}, range(1, 12), 8)
    assert everything.override_tensor == () and overridden(everything) == set() and everything.exact
    nothing = side.llamacpp_layout({}, range(1, 12), 8)
    assert nothing.gpu_layers == () and len(overridden(nothing)) == 33 and nothing.exact


def test_a_layer_held_in_part_has_no_llama_cpp_equivalent():
    half_of_each = {layer: tuple(range(4)) for layer in range(1, 12)}
    with pytest.raises(UsageError, match="holds 4 of layer 1's 8 routed experts") as err:
        side.llamacpp_layout(half_of_each, range(1, 12), 8)
    assert "--gpu-share" in str(err.value)
    # count: as many whole layers as 44 experts fill (5.5 -> 6), the last ones; not the same experts.
    layout = side.llamacpp_layout(half_of_each, range(1, 12), 8, match="count")
    assert layout.gpu_layers == (6, 7, 8, 9, 10, 11) and not layout.exact
    assert layout.engine_gpu_experts == 44 and layout.llamacpp_gpu_experts == 48
    with pytest.raises(UsageError, match="no routed experts"):
        side.llamacpp_layout({0: (1,)}, range(1, 12), 8)


def test_llama_cpps_buffer_lines_and_which_of_them_are_on_the_card():
    from hybridmoe.backend.llamacpp.log import LogLine

    lines = [LogLine(2, "load_tensors: offloaded 9/9 layers to GPU"),
             LogLine(2, "load_tensors:        CUDA0 model buffer size =  1234.50 MiB"),
             LogLine(2, "load_tensors:    CUDA_Host model buffer size =  1300.00 MiB"),
             LogLine(2, "load_tensors:   CPU_Mapped model buffer size =    64.25 MiB"),
             LogLine(2, "llama_kv_cache:      CUDA0 KV buffer size =    68.00 MiB")]
    assert side.buffer_sizes(lines) == {"CUDA0": 1234.5, "CUDA_Host": 1300.0, "CPU_Mapped": 64.25}
    # Pinned host memory is the host's: experts llama.cpp moved there are where the plan asked.
    assert side._is_host("CUDA_Host") and side._is_host("CPU") and side._is_host("CPU_REPACK")
    assert not side._is_host("CUDA0")


def test_the_ratios_median_and_quartiles_and_the_targets():
    result = {"measurements": {"decode@64": {"engine": [30.0, 26.0, 28.0], "llamacpp": [20.0, 20.0, 20.0],
                                             "ratios": [1.5, 1.3, 1.4]},
                               "prefill 4096": {"engine": [100.0], "llamacpp": [60.0], "ratios": [100 / 60]},
                               "prefill 512": {"engine": [], "llamacpp": [], "ratios": []}}}
    out = side.summarize(result)["measurements"]
    assert out["decode@64"]["ratio"] == pytest.approx(1.4) and out["decode@64"]["quartiles"] == pytest.approx([1.35, 1.45])
    assert out["decode@64"]["engine_median"] == 28.0 and out["decode@64"]["meets_target"]
    assert out["prefill 4096"]["target"] == 2.0 and not out["prefill 4096"]["meets_target"]
    assert "ratio" not in out["prefill 512"]  # a run stopped by an error before it: nothing to report


# ---- with llama-cpp-python and the engine ---------------------------------------------------


@pytest.fixture(scope="module")
def gguf_of(tmp_path_factory):
    """A tiny Q8_0 GGUF of a family, made once."""
    from hybridmoe.backend.convert import to_gguf
    from tests.convert.conftest import build_checkpoint

    made = {}

    def get(family: str):
        if family not in made:
            work = tmp_path_factory.mktemp(f"side-by-side-{family}")
            checkpoint = build_checkpoint(work / "checkpoint", family)
            made[family] = to_gguf(checkpoint.path, work / "tiny-q8_0.gguf", "q8_0")
        return made[family]

    return get


@pytest.fixture(scope="module")
def tiny_gguf(gguf_of):
    return gguf_of("qwen3_moe")


@pytest.fixture(scope="module")
def tiny_plan(tiny_gguf):
    return side.plan_here(str(tiny_gguf), 256)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_llama_cpp_puts_exactly_the_planned_tensors_on_the_cpu(gguf_of, family, share):
    pytest.importorskip("llama_cpp")
    from hybridmoe.backend.llamacpp.header import read_header

    gguf = gguf_of(family)
    whole = side.plan_here(str(gguf), 256)
    plan = side.with_gpu_experts(whole, side.whole_layers(whole.moe_layers, whole.n_routed_experts, share))
    layout = side.llamacpp_layout(plan.gpu_experts, plan.moe_layers, plan.n_routed_experts)
    worker = side._LlamaWorker(str(gguf), plan, 1, layout, 128)
    try:
        names = read_header(gguf).tensor_names
        # llama.cpp's own log: the tensors an override moved are the CPU layers' three expert
        # projections, no more (the worker compares the names and refuses a mismatch); the
        # DeepSeek-V3 file's dense first block and shared experts stay where the layers are.
        assert worker.info["placement_ok"]
        assert worker.info["cpu_tensors"] == worker.info["cpu_tensors_expected"] == 3 * len(layout.cpu_layers)
        assert side.cpu_expert_tensors(names, layout) == overridden(layout, names)
        assert not any("shexp" in n for n in overridden(layout, names))
        if family == "deepseek_v3":
            assert not any(n.startswith("blk.0.") for n in overridden(layout, names))  # the dense block
            if share == 0.5:
                assert layout.cpu_layers == (1,) and layout.gpu_layers == (2,)
        assert sum(worker.info["buffers_mib"].values()) > 0
        # And it computes: a token after a short prompt.
        assert 0 <= worker.eval([5, 6, 7, 8], 0) < worker.vocab
    finally:
        worker.llm.close()


def test_a_plan_for_another_model_is_refused_in_one_message(tiny_gguf, tiny_plan, tmp_path, capsys):
    other = dataclasses.replace(tiny_plan, n_routed_experts=tiny_plan.n_routed_experts * 2, model="another")
    path = other.save(tmp_path / "other.json")
    code = cli.main(["bench", "generate", str(tiny_gguf), "--plan", str(path), "--prefill", "32", "--decode-at", "16"])
    err = capsys.readouterr().err
    assert code != 0 and "the plan was made for another" in err and "experts" in err
    short = dataclasses.replace(tiny_plan, workload=dataclasses.replace(tiny_plan.workload, context=64))
    with pytest.raises(UsageError, match="shorter than the longest measurement"):
        side.check_plan_for_file(short, str(tiny_gguf), 128)


def test_a_cuda_machine_refuses_a_llama_cpp_without_a_gpu(tiny_gguf, tiny_plan, monkeypatch):
    pytest.importorskip("llama_cpp")
    import torch

    # The parent believes it has a card; the workers (their own processes) and llama.cpp do not.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = side.with_gpu_experts(tiny_plan, side.whole_layers(tiny_plan.moe_layers, tiny_plan.n_routed_experts, 0.5))
    result = side.measure(str(tiny_gguf), plan, pairs=1, decode_at=[16], prefill=[32], decode_tokens=2, threads=1)
    assert side.failed(result) == ["llamacpp"]
    assert "has no GPU device" in result["llamacpp"]["error"] and "LLAMA_CPP_LIB_PATH" in result["llamacpp"]["error"]
    assert not result["measurements"]


@pytest.mark.slow
def test_both_backends_take_turns_on_every_measurement(tiny_gguf, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    out = tmp_path / "side.json"
    code = cli.main(["bench", "generate", str(tiny_gguf), "--gpu-share", "0.5", "--pairs", "3", "--gen-tokens", "3",
                     "--decode-at", "16,64", "--prefill", "32,128", "--threads", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    result = json.loads(out.read_text())
    assert set(result["measurements"]) == {"decode@16", "decode@64", "prefill 32", "prefill 128"}
    for m in result["measurements"].values():
        assert len(m["engine"]) == len(m["llamacpp"]) == len(m["ratios"]) == 3
        assert m["ratios"] == pytest.approx([e / lc for e, lc in zip(m["engine"], m["llamacpp"])])
        low, high = m["quartiles"]
        assert min(m["ratios"]) <= low <= m["ratio"] <= high <= max(m["ratios"])
    assert result["measurements"]["decode@64"]["target"] == 1.3
    # One host probe before each pair and one after the last; no card here to copy to.
    assert len(result["host_probe"]) == 4 and all(p > 0 for p in result["host_probe"])
    assert result["copy_probe"] == [None, None]
    assert result["layout"]["exact"] and result["plan"]["gpu_layers"] == list(result["layout"]["gpu_layers"])
    assert result["llamacpp"]["placement_ok"] and result["engine"]["ready"]
    assert "no CUDA: the engine's GPU side runs on the CPU" in text and "the same experts" in text
    assert re.search(r"decode@64 +[\d.]+ +[\d.]+ +[\d.]+x", text)


@pytest.mark.slow
def test_a_budget_ends_the_run_with_what_it_measured(tiny_gguf, tiny_plan, tmp_path):
    pytest.importorskip("llama_cpp")
    plan = side.with_gpu_experts(tiny_plan, side.whole_layers(tiny_plan.moe_layers, tiny_plan.n_routed_experts, 0.5))
    seen = []
    result = side.measure(str(tiny_gguf), plan, pairs=5, decode_at=[16], prefill=[32], decode_tokens=2, threads=1,
                          budget_s=1e-3, on_pair=lambda r: seen.append(r["pairs_done"]), log_dir=tmp_path)
    # The first pair always runs; the budget, spent by then, stops the rest.
    assert seen == [1] and result["pairs_done"] == 1 and result["stopped"] == "time budget: 1 of 5 pairs"
    assert all(len(m["ratios"]) == 1 for m in result["measurements"].values())
    assert "stopped early (time budget: 1 of 5 pairs)" in side.table(result)
    assert (tmp_path / "engine-worker.log").exists() and (tmp_path / "llamacpp-worker.log").exists()


def test_the_carried_llama_cpp_tree_keeps_what_the_library_build_reads():
    """scripts/prepare_gpu_bench.py's cut of llama.cpp's source (a namespace import: scripts/ is
    not a package, as benchmarks/make_midsize_qwen3.py imports scripts.gpu_check)."""
    from scripts.prepare_gpu_bench import keep

    kept = ["CMakeLists.txt", "cmake/build-info.cmake", "src/llama-model.cpp", "include/llama.h",
            "ggml/CMakeLists.txt", "ggml/src/CMakeLists.txt", "ggml/src/ggml.c", "ggml/src/gguf.cpp",
            "ggml/src/ggml-cpu/ops.cpp", "ggml/src/ggml-cuda/mmvq.cu",
            "ggml/src/ggml-cuda/template-instances/mmq-instance-q4_0.cu", "vendor/CMakeLists.txt",
            "vendor/hash/sha1/sha1.c", "vendor/miniaudio/CMakeLists.txt"]
    dropped = ["ggml/src/ggml-vulkan/ggml-vulkan.cpp", "ggml/src/ggml-metal/ggml-metal.m", "tools/server/server.cpp",
               "common/common.cpp", "tests/test-backend-ops.cpp", "models/ggml-vocab-llama-bpe.gguf",
               "vendor/miniaudio/miniaudio.h", "vendor/cpp-httplib/httplib.h", "docs/build.md", "CMakeLists.txt.bak"]
    assert [p for p in kept if not keep(p)] == []
    assert [p for p in dropped if keep(p)] == []
