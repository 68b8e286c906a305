"""`list_local_models`: the HF cache, registered folders, LM Studio and Ollama stores, read in place."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from hybridmoe.backend.errors import UsageError
from hybridmoe.backend.hub import list_local_models, pull, registry
from hybridmoe.backend.hub.gguf_sets import gguf_sets, quant_label
from tests.hub.conftest import gguf_repo_files


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime: to show nothing was written."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def by_name(models):
    return {m.name: m for m in models}


@pytest.fixture
def split_set(gguf_bytes) -> dict[str, bytes]:
    n = int(gguf_bytes["n_parts"])
    return {f"tiny-Q4_K_M-{k:05d}-of-{n:05d}.gguf": gguf_bytes[f"part{k}"] for k in range(1, n + 1)}


def test_pulled_models_are_listed_from_the_hf_cache(hub, checkpoint_files, gguf_bytes):
    hub.add_repo("org/tiny", checkpoint_files)
    hub.add_repo("org/tiny-GGUF", gguf_repo_files(gguf_bytes))
    pull("org/tiny")
    pull("org/tiny-GGUF", quant="Q4_K_M")
    pull("org/tiny-GGUF", quant="Q8_0")
    models = by_name(list_local_models())
    assert set(models) == {"org/tiny", "org/tiny-GGUF:Q4_K_M", "org/tiny-GGUF:Q8_0"}
    st = models["org/tiny"]
    assert (st.kind, st.family, st.quantization, st.source) == ("safetensors", "mixtral", "fp16", "hf-cache")
    assert st.size_bytes == sum(len(b) for b in checkpoint_files.values()) and st.repo_id == "org/tiny"
    q4 = models["org/tiny-GGUF:Q4_K_M"]
    assert (q4.kind, q4.family, q4.quantization) == ("gguf", "qwen3_moe", "Q4_K_M")
    assert q4.path.name.startswith("tiny-Q4_K_M-00001-of-") and len(q4.files) == int(gguf_bytes["n_parts"])


def test_an_interrupted_pull_is_listed_as_incomplete(hub, checkpoint_files):
    hub.add_repo("org/tiny", checkpoint_files)
    model = pull("org/tiny")
    (model.path / "model-00002-of-00002.safetensors").unlink()
    (listed,) = list_local_models(lmstudio=False, ollama=False)
    assert not listed.usable and "1 of 2 shards are missing" in listed.problem
    assert "hybridmoe pull org/tiny" in listed.problem


def test_a_registered_folder_with_checkpoints_and_loose_gguf_files(home, tmp_path, checkpoint_files, split_set,
                                                                    gguf_bytes):
    models_dir = tmp_path / "models"
    ck = models_dir / "my-mixtral"
    ck.mkdir(parents=True)
    for name, data in checkpoint_files.items():
        (ck / name).write_bytes(data)
    (models_dir / "qwen").mkdir()
    for name, data in split_set.items():
        (models_dir / "qwen" / name).write_bytes(data)
    (models_dir / "tiny-Q8_0.gguf").write_bytes(gguf_bytes["single"])
    (models_dir / "mmproj-tiny-F16.gguf").write_bytes(b"GGUF")  # a projector, not a model
    (models_dir / "broken-Q2_K.gguf").write_bytes(b"not a gguf at all")
    (models_dir / "half").mkdir()
    first = next(iter(split_set))
    (models_dir / "half" / first).write_bytes(split_set[first])  # part 2 missing
    registry.add_dir(models_dir)
    before = tree(models_dir)

    models = by_name(list_local_models(lmstudio=False, ollama=False))
    assert models["my-mixtral"].kind == "safetensors" and models["my-mixtral"].family == "mixtral"
    assert models["my-mixtral"].source == "directory"
    assert models["qwen:Q4_K_M"].usable and models["qwen:Q4_K_M"].family == "qwen3_moe"
    assert models["tiny-Q8_0.gguf"].quantization == "Q8_0" and models["tiny-Q8_0.gguf"].usable
    broken = models["broken-Q2_K.gguf"]
    assert not broken.usable and "not a GGUF file" in broken.problem
    half = models["half:Q4_K_M"]
    assert not half.usable and "incomplete" in half.problem
    assert not any("mmproj" in n for n in models)
    assert tree(models_dir) == before  # read in place, nothing written


def test_lm_studio_store_is_read_in_place(home, gguf_bytes, split_set):
    for base in (home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"):
        repo = base / "lmstudio-community" / "Tiny-GGUF"
        repo.mkdir(parents=True)
        (repo / "Tiny-Q8_0.gguf").write_bytes(gguf_bytes["single"])
    (home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-GGUF" / "Tiny-Q8_0.gguf").unlink()
    new = home / ".lmstudio" / "models" / "bartowski" / "Tiny-GGUF"
    new.mkdir(parents=True)
    for name, data in split_set.items():
        (new / name).write_bytes(data)
    before = tree(home)
    models = by_name(list_local_models(ollama=False))
    assert set(models) == {"lmstudio-community/Tiny-GGUF:Q8_0", "bartowski/Tiny-GGUF:Q4_K_M"}
    assert all(m.source == "lmstudio" and m.usable and m.family == "qwen3_moe" for m in models.values())
    assert tree(home) == before


def write_ollama(models_dir: Path, name: str, tag: str, blob: bytes | None, namespace="library",
                 registry_host="registry.ollama.ai") -> str:
    digest = hashlib.sha256(blob or b"missing").hexdigest()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64,
                   "size": 10},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
             "size": len(blob or b"")},
            {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "1" * 64, "size": 5},
        ],
    }
    path = models_dir / "manifests" / registry_host / namespace / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    (models_dir / "blobs").mkdir(parents=True, exist_ok=True)
    if blob is not None:
        (models_dir / "blobs" / f"sha256-{digest}").write_bytes(blob)
    return digest


def test_ollama_manifests_name_their_gguf_blobs(home, gguf_bytes):
    store = home / ".ollama" / "models"
    digest = write_ollama(store, "tiny", "30b-a3b-q4_K_M", gguf_bytes["single"])
    write_ollama(store, "tiny", "latest", gguf_bytes["single"])  # same blob, another tag
    write_ollama(store, "gone", "7b", None)  # manifest whose blob was deleted
    write_ollama(store, "other", "q8_0", gguf_bytes["single"] + b"", namespace="someone")
    before = tree(home)
    models = by_name(list_local_models(lmstudio=False))
    tagged = models["tiny:30b-a3b-q4_K_M"]
    assert tagged.source == "ollama" and tagged.kind == "gguf" and tagged.family == "qwen3_moe"
    assert tagged.quantization == "Q4_K_M" and tagged.path.name == f"sha256-{digest}"
    assert tagged.size_bytes == len(gguf_bytes["single"])
    assert "tiny:latest" not in models or models["tiny:latest"].path == tagged.path  # one entry per blob
    assert "missing" in models["gone:7b"].problem and not models["gone:7b"].usable
    assert tree(home) == before


def test_ollama_models_env_moves_the_store(home, tmp_path, gguf_bytes, monkeypatch):
    store = tmp_path / "elsewhere"
    write_ollama(store, "tiny", "q8_0", gguf_bytes["single"])
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    models = by_name(list_local_models(lmstudio=False))
    assert models["tiny:q8_0"].usable and models["tiny:q8_0"].quantization == "Q8_0"


def test_an_hf_cache_registered_as_a_directory(hub, checkpoint_files, tmp_path):
    hub.add_repo("org/tiny", checkpoint_files)
    other_cache = tmp_path / "other-cache"
    pull("org/tiny", cache_dir=other_cache)
    registry.add_dir(other_cache)
    models = by_name(list_local_models(cache_dirs=[], lmstudio=False, ollama=False))
    assert models["org/tiny"].source == "directory" and models["org/tiny"].usable


# ---- the registry -----------------------------------------------------------------------------------


def test_register_and_unregister_directories(home, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert registry.registered_dirs() == []
    registry.add_dir(a)
    registry.add_dir(b)
    registry.add_dir(str(a) + os.sep)  # the same folder: stored once
    assert registry.registered_dirs() == [a, b]
    assert registry.registry_path().is_relative_to(tmp_path / "data")
    registry.remove_dir(a)
    assert registry.registered_dirs() == [b]
    with pytest.raises(UsageError, match="not a registered"):
        registry.remove_dir(a)
    with pytest.raises(UsageError, match="not a directory"):
        registry.add_dir(tmp_path / "missing")


def test_a_damaged_registry_is_a_clear_error(home):
    registry.registry_path().parent.mkdir(parents=True, exist_ok=True)
    registry.registry_path().write_text("directories = 3")
    with pytest.raises(UsageError, match="must be a list"):
        registry.registered_dirs()


# ---- names of GGUF sets -----------------------------------------------------------------------------


@pytest.mark.parametrize("path, label", [
    ("Qwen3-30B-A3B-Q4_K_M.gguf", "Q4_K_M"),
    ("Q4_K_M/Kimi-K2-Instruct-Q4_K_M-00001-of-00013.gguf", "Q4_K_M"),
    ("UD-Q4_K_XL/Kimi-K2.6-UD-Q4_K_XL-00002-of-00014.gguf", "UD-Q4_K_XL"),
    ("deepseek-ai_DeepSeek-V3-0324-Q4_K_M-V2/x-Q4_K_M-V2-00001-of-00011.gguf", "Q4_K_M-V2"),
    ("gpt-oss-120b-mxfp4-00001-of-00003.gguf", "MXFP4"),
    ("BF16/model-00001-of-00004.gguf", "BF16"),
    ("mixtral-8x7b-v0.1.Q5_K_S.gguf", "Q5_K_S"),
    ("qwen2.5-7b-instruct-iq2_xxs.gguf", "IQ2_XXS"),
    ("Kimi-K2-Instruct-UD-TQ1_0.gguf", "UD-TQ1_0"),
    ("plain-model.gguf", "plain-model"),
])
def test_quantization_names_from_file_names(path, label):
    assert quant_label(path) == label


def test_sets_group_split_parts_and_skip_projectors():
    sets = gguf_sets([("Q4_K_M/m-Q4_K_M-00001-of-00002.gguf", 5), ("Q4_K_M/m-Q4_K_M-00002-of-00002.gguf", 7),
                      ("m-Q8_0.gguf", 9), ("mmproj-m-f16.gguf", 1), ("README.md", 1)])
    assert [(s.label, s.files, s.size_bytes, s.complete) for s in sets] == [
        ("Q4_K_M", ("Q4_K_M/m-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf"), 12, True),
        ("Q8_0", ("m-Q8_0.gguf",), 9, True),
    ]
