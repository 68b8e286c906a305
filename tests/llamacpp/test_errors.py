"""What the user is told when a model or a plan cannot be served: one clear message each,
with llama.cpp's own reason where llama.cpp is the one refusing."""

from __future__ import annotations

import dataclasses

import pytest

from hybridmoe.backend.errors import ModelError, UnsupportedModelError, UsageError
from hybridmoe.backend.llamacpp import LlamaCppBackend
from tests.llamacpp.conftest import copy_gguf, make_plan

EXPERTS = r"ffn_(up|down|gate|gate_up)_(ch|)exps"


def load(path, plan):
    session = LlamaCppBackend().load(path, plan)
    session.close()


@pytest.fixture(scope="module")
def qwen(ggufs):
    path = ggufs("qwen3_moe")
    return path, make_plan(path, gpu_moe_layers=1)


def test_a_file_that_is_not_gguf(tmp_path, qwen):
    _, plan = qwen
    bogus = tmp_path / "model.safetensors"
    bogus.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ModelError, match="is not a GGUF file") as err:
        load(bogus, plan)
    assert "--backend engine" in err.value.hint


def test_a_hugging_face_checkpoint(checkpoint_dirs, qwen):
    _, plan = qwen
    with pytest.raises(ModelError, match="Hugging Face checkpoint; the llama.cpp backend reads GGUF files only"):
        load(checkpoint_dirs("qwen3_moe"), plan)


def test_a_missing_file(tmp_path, qwen):
    with pytest.raises(ModelError, match="does not exist"):
        load(tmp_path / "nowhere.gguf", qwen[1])


def test_an_architecture_llama_cpp_lacks(tmp_path, qwen):
    path, plan = qwen
    unknown = copy_gguf(path, tmp_path / "future.gguf", arch="qwen9moe")
    with pytest.raises(UnsupportedModelError) as err:
        load(unknown, plan)
    message = str(err.value)
    assert "does not know the architecture 'qwen9moe'" in message
    assert "unknown model architecture: 'qwen9moe'" in message  # llama.cpp's own words
    assert "Update llama-cpp-python" in message


def test_a_truncated_file(tmp_path, qwen):
    path, plan = qwen
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 3 // 4])
    with pytest.raises(ModelError, match="damaged or incomplete.*not within the file bounds") as err:
        load(cut, plan)
    assert "Download the file again" in str(err.value)


def test_an_override_pattern_that_matches_nothing(qwen):
    path, plan = qwen
    settings = {**plan.llama_cpp, "override_tensor": [rf"blk\.(7|8)\.{EXPERTS}=CPU"], "n_cpu_moe": 0}
    with pytest.raises(UsageError, match=r"matches no tensor of .*qwen3moe, 2 blocks\).*another model") as err:
        load(path, dataclasses.replace(plan, llama_cpp=settings))
    assert "hybridmoe plan" in err.value.hint


def test_a_plan_for_another_model(ggufs, qwen):
    path, _ = qwen
    deepseek_plan = make_plan(ggufs("deepseek_v3"), gpu_moe_layers=1)
    with pytest.raises(UsageError, match=r"the plan was made for .*MoE layers 1-2.*has MoE layers 0-1"):
        load(path, deepseek_plan)


def test_a_buffer_type_this_build_lacks(qwen):
    from hybridmoe.backend.llamacpp import system_info

    if any(d["buffer_type"] == "CUDA0" for d in system_info()["devices"]):
        pytest.skip("this build has a CUDA0 buffer type")
    path, plan = qwen
    settings = {**plan.llama_cpp, "override_tensor": [rf"blk\.0\.{EXPERTS}=CUDA0"]}
    with pytest.raises(UsageError, match="places tensors on 'CUDA0', which this llama.cpp build does not have"):
        load(path, dataclasses.replace(plan, llama_cpp=settings))


def test_a_malformed_override(qwen):
    path, plan = qwen
    for entry, problem in ((r"blk\.0\.ffn_up_exps", "not of the form PATTERN=BUFFER_TYPE"),
                           (r"blk\.(0\.ffn=CPU", "not a valid regular expression")):
        with pytest.raises(UsageError, match=problem):
            load(path, dataclasses.replace(plan, llama_cpp={**plan.llama_cpp, "override_tensor": [entry]}))


def test_a_context_llama_cpp_cannot_create(ggufs):
    """llama.cpp refuses a q8_0 K cache whose rows are not whole 32-value blocks (this tiny
    DeepSeek's MLA heads are 48 wide); its reason reaches the user."""
    path = ggufs("deepseek_v3")
    plan = make_plan(path, cache_type_k="q8_0", cache_type_v="q8_0")
    with pytest.raises(ModelError, match=r"could not create its context: K cache type q8_0 .* does not divide"):
        load(path, plan)


def test_llama_cpp_log_reasons_are_picked_out():
    from hybridmoe.backend.llamacpp import log

    captured = log.Capture([log.LogLine(log.ERROR, text) for text in (
        "gguf_init_from_reader: invalid magic characters: 'impo', expected 'GGUF'",
        "llama_model_load: error loading model: llama_model_loader: failed to load model from /x.gguf",
        "llama_model_load_from_file_impl: failed to load model",
    )])
    assert captured.failure() == "invalid magic characters: 'impo', expected 'GGUF'"
