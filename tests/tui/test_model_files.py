"""Deleting a model removes its files and nothing else; the app state survives damage."""

from __future__ import annotations

import os

import pytest

from hybridmoe.app.model_files import delete_model_files, deletable
from hybridmoe.app.state import AppState, SetupProgress, load_state, save_state
from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.hub.local import LocalModel


def _link(link, target):
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, link.parent), link)


def test_a_cached_model_goes_with_its_blobs_but_shared_blobs_stay(tmp_path):
    repo = tmp_path / "hub" / "models--org--model"
    blobs = repo / "blobs"
    blobs.mkdir(parents=True)
    (blobs / "cfg").write_text("{}")
    (blobs / "w1").write_bytes(b"x" * 1000)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c1")
    old, new = repo / "snapshots" / "c0", repo / "snapshots" / "c1"
    _link(old / "config.json", blobs / "cfg")  # an older snapshot shares the config blob
    _link(new / "config.json", blobs / "cfg")
    _link(new / "sub" / "model.safetensors", blobs / "w1")
    model = LocalModel(name="org/model", path=new, kind="safetensors", size_bytes=1002, source="hf-cache",
                       files=(new / "config.json", new / "sub" / "model.safetensors"))

    freed = delete_model_files(model)

    assert freed == 1000
    assert not (blobs / "w1").exists() and (blobs / "cfg").exists()
    assert not new.exists()  # the emptied snapshot is pruned ...
    assert (old / "config.json").read_text() == "{}"  # ... the other one still works
    assert (repo / "refs" / "main").exists()


def test_a_folder_model_loses_only_its_own_files(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "m-Q4_K_M.gguf").write_bytes(b"g" * 10)
    (folder / "notes.txt").write_text("mine")
    model = LocalModel(name="m", path=folder / "m-Q4_K_M.gguf", kind="gguf", size_bytes=10, source="directory",
                       files=(folder / "m-Q4_K_M.gguf",))
    assert delete_model_files(model) == 10
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("source,needle", [("ollama", "ollama rm"), ("lmstudio", "LM Studio")])
def test_other_programs_stores_are_refused(tmp_path, source, needle):
    blob = tmp_path / "blob"
    blob.write_bytes(b"1")
    model = LocalModel(name="qwen3:30b", path=blob, kind="gguf", size_bytes=1, source=source, files=(blob,))
    assert needle in deletable(model)
    with pytest.raises(HybridMoeError):
        delete_model_files(model)
    assert blob.exists()


def test_state_round_trips_and_a_damaged_file_is_set_aside(tmp_path):
    state = AppState(setup=SetupProgress(step="get", repo="org/m", quant="Q4_K_M"), obtained=("/a",),
                     system_prompt="Be brief.", sampling={"temperature": 0.2, "top_p": 0.9, "seed": None})
    save_state(tmp_path, state)
    loaded = load_state(tmp_path)
    assert loaded.setup == state.setup and loaded.obtained == ("/a",) and loaded.sampling["temperature"] == 0.2
    assert "seed" not in loaded.sampling  # TOML has no null: unset stays unset
    (tmp_path / "tui-state.toml").write_text("this is [not toml")
    assert load_state(tmp_path) == AppState()
    assert (tmp_path / "tui-state.toml.damaged").exists()
