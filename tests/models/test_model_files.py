"""resolve_model_files: which model a path means, one rule for every loader.

The resolver reads names (and a file's first four bytes) only, so the files here are stubs
that start with the GGUF magic; what the loaders then read is tested in
tests/test_model_file_choice.py on real files.
"""

from __future__ import annotations

import json

import pytest

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.model_files import ModelFiles, is_projector, resolve_model_files


def stub(path, content: bytes = b"GGUF\x03\x00\x00\x00"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def split_set(folder, stem: str, count: int):
    return [stub(folder / f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def test_a_gguf_file(tmp_path):
    model = stub(tmp_path / "Model-Q8_0.gguf")
    assert resolve_model_files(model) == ModelFiles("gguf", model, (model,))


def test_a_gguf_file_by_its_magic_whatever_its_name(tmp_path):
    model = stub(tmp_path / "model.bin")
    found = resolve_model_files(model)
    assert (found.kind, found.path) == ("gguf", model)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_any_part_of_a_split_set_means_the_set_from_its_first_part(tmp_path, which):
    parts = split_set(tmp_path, "Model-Q4_K_M", 3)
    found = resolve_model_files(parts[which])
    assert (found.kind, found.path, found.files) == ("gguf", parts[0], tuple(parts))


def test_a_split_set_with_a_part_missing_names_it(tmp_path):
    parts = split_set(tmp_path, "Model-Q4_K_M", 3)
    parts[1].unlink()
    with pytest.raises(ModelError, match="Model-Q4_K_M-00002-of-00003.gguf is missing"):
        resolve_model_files(tmp_path)


@pytest.mark.parametrize("projector", ["mmproj-Model-F16.gguf", "Model-mmproj-f16.gguf", "A-MMPROJ.gguf"])
def test_a_folder_with_a_split_set_and_a_projector(tmp_path, projector):
    """The projector is skipped wherever "mmproj" stands in its name (the old engine rule
    skipped only names starting with it, and took "Model-mmproj-f16.gguf" for a second model)."""
    parts = split_set(tmp_path, "Model-Q4_K_M", 2)
    stub(tmp_path / projector)
    found = resolve_model_files(tmp_path)
    assert (found.kind, found.path, found.files) == ("gguf", parts[0], tuple(parts))
    assert is_projector(projector)


def test_a_folder_with_two_models_names_both_and_says_how_to_choose(tmp_path):
    single = stub(tmp_path / "Model-Q8_0.gguf")
    parts = split_set(tmp_path, "Model-Q4_K_M", 2)
    stub(tmp_path / "mmproj-Model-F16.gguf")
    with pytest.raises(ModelError) as err:
        resolve_model_files(tmp_path)
    assert str(err.value).startswith(f"{tmp_path} holds several GGUF models (")
    assert parts[0].name in err.value.what and single.name in err.value.what
    assert "mmproj" not in err.value.what and parts[1].name not in err.value.what
    assert "Give the path of the one to use" in err.value.hint and str(tmp_path) in err.value.hint


def test_a_safetensors_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    shards = [stub(tmp_path / f"model-0000{i}-of-00002.safetensors", b"") for i in (1, 2)]
    stub(tmp_path / "Model-Q8_0.gguf")  # a conversion kept next to it: the checkpoint wins
    found = resolve_model_files(tmp_path)
    assert (found.kind, found.path, found.files) == ("safetensors", tmp_path, tuple(shards))


def test_config_json_next_to_a_gguf_means_the_gguf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    model = stub(tmp_path / "model.gguf")
    assert resolve_model_files(tmp_path).path == model


def test_a_folder_with_only_config_json_and_a_bare_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert resolve_model_files(tmp_path) == resolve_model_files(config)
    found = resolve_model_files(config)
    assert (found.kind, found.path, found.files) == ("config", config, (config,))


def test_nothing_there(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_files(tmp_path / "nowhere")
    with pytest.raises(ModelError, match="holds neither config.json nor a .gguf model file") as err:
        resolve_model_files(tmp_path)
    assert "multimodal projector" not in err.value.what
    stub(tmp_path / "mmproj-Model-F16.gguf")
    with pytest.raises(ModelError, match=r"mmproj-Model-F16.gguf: a multimodal projector, not a language model"):
        resolve_model_files(tmp_path)
    with pytest.raises(ModelError, match="is neither a model folder, a .gguf file nor a config.json"):
        resolve_model_files(stub(tmp_path / "notes.txt", b"hello"))
