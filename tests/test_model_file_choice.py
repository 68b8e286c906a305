"""Every loader opens the file the resolver chose, and a `run` parses a GGUF header at most twice.

A tiny converted Qwen3-MoE GGUF (random weights, a trained byte-level BPE tokenizer) is split
into a three-part set and put in a folder with a multimodal projector, the case where the
loaders used to apply four different rules. GGUF headers are counted by wrapping the project's
one GGUF parser (``GGUFFile._parse``), which every GGUF reader goes through.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.gguf_reader import GGUFFile
from tests.convert.conftest import build_checkpoint


def split_copy(src: Path, folder: Path, stem: str, *, max_tensors: int) -> list[Path]:
    """``src`` rewritten as a split set ``stem-0000k-of-0000N.gguf`` in ``folder`` (gguf-py's
    writer keeps every key/value in the first part, as llama.cpp's gguf-split does)."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    writer = GGUFWriter(folder / f"{stem}.gguf", reader.fields["general.architecture"].contents(),
                        split_max_tensors=max_tensors)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.tensor_type == GGMLQuantizationType.F32:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(shape))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # bytes as stored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(folder.glob(f"{stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    from hybridmoe.backend.convert import to_gguf

    root = tmp_path_factory.mktemp("choice")
    build_checkpoint(root / "hf", "qwen3_moe")
    return to_gguf(root / "hf", root / "tiny-qwen3moe-BF16.gguf", "bf16")


@pytest.fixture(scope="module")
def folder_with_projector(converted, tmp_path_factory) -> tuple[Path, list[Path]]:
    """A folder holding a three-part set and an mmproj file that sorts first and is a valid
    GGUF (a copy of the model: a rule that does not skip it would open it without complaint)."""
    folder = tmp_path_factory.mktemp("folder")
    parts = split_copy(converted, folder, "tiny-qwen3moe-BF16", max_tensors=12)
    assert len(parts) == 3
    shutil.copy(converted, folder / "a-tiny-mmproj-f16.gguf")
    return folder, parts


@pytest.fixture
def parsed(monkeypatch) -> list[Path]:
    """The files whose GGUF header is parsed, in order, while the test runs."""
    seen: list[Path] = []
    original = GGUFFile._parse

    def counting(self, *args, **kwargs):
        seen.append(self.path)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GGUFFile, "_parse", counting)
    return seen


def test_every_loader_opens_the_first_part_of_the_set(folder_with_projector, parsed):
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.llamacpp.header import read_header
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.models.model_files import resolve_model_files
    from hybridmoe.backend.text.tokenizer import load_tokenizer

    folder, parts = folder_with_projector
    resolved = resolve_model_files(folder)
    assert (resolved.kind, resolved.path, resolved.files) == ("gguf", parts[0], tuple(parts))
    assert inspect_model(folder).files == tuple(parts)
    assert open_weights(folder).files == tuple(parts)
    assert read_header(folder).path == parts[0]
    parsed.clear()
    assert load_tokenizer(folder).encode("Hello world")
    assert parsed == [parts[0]]  # the vocabulary is read from the first part, never the projector


def test_every_loader_refuses_two_models_in_one_words(folder_with_projector, converted, tmp_path):
    """Before, inspection said "several GGUF models", the engine's weights "2 GGUF models",
    the llama.cpp header "must hold exactly one", and the tokenizer took the first file."""
    from hybridmoe.backend.formats.weights import open_weights
    from hybridmoe.backend.llamacpp.header import read_header
    from hybridmoe.backend.models import inspect_model
    from hybridmoe.backend.text.tokenizer import load_tokenizer

    folder, parts = folder_with_projector
    for part in parts:
        shutil.copy(part, tmp_path / part.name)
    shutil.copy(converted, tmp_path / "other-Q8_0.gguf")
    messages = set()
    for loader in (inspect_model, open_weights, read_header, load_tokenizer):
        with pytest.raises(ModelError) as err:
            loader(tmp_path)
        messages.add(str(err.value))
    assert len(messages) == 1, messages
    assert f"(other-Q8_0.gguf, {parts[0].name})" in messages.pop()


@pytest.mark.parametrize("which", [0, 2])
def test_any_part_of_the_set_means_the_set(folder_with_projector, which):
    from hybridmoe.backend.llamacpp.header import read_header
    from hybridmoe.backend.models import inspect_model

    _, parts = folder_with_projector
    assert inspect_model(parts[which]).files == tuple(parts)
    assert read_header(parts[which]).path == parts[0]


@pytest.mark.parametrize("backend", ["engine", "llamacpp"])
def test_a_run_parses_a_gguf_header_twice(folder_with_projector, parsed, monkeypatch, tmp_path, capsys, backend):
    """Once to inspect and plan (the mappings are let go: planning must not hold the model's
    files), once when the backend opens the model: the engine maps the weights it serves
    from and reads the vocabulary from that same mapping; llama.cpp's header is read to check
    the plan against the file. Each parse of a three-part set reads three headers. Before,
    an engine `run` parsed the set four times: inspect in the command, inspect again in the
    engine, the tokenizer's own read, and the weights."""
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp")
    from hybridmoe.app.cli import main

    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, parts = folder_with_projector
    code = main(["run", "-m", str(folder), "-p", "Hello", "--max-tokens", "2", "--temperature", "0",
                 "--backend", backend, "--context", "64", "--json"])
    assert code == 0, capsys.readouterr().err
    assert f'"backend": "{backend}"' in capsys.readouterr().out
    assert parsed == [*parts, *parts]


@pytest.mark.parametrize("backend", ["engine", "llamacpp"])
def test_a_run_from_the_last_part_serves_the_set(folder_with_projector, monkeypatch, tmp_path, capsys, backend):
    """Given the last part, both backends load the whole set (llama.cpp from the first part's
    path, which it needs to find the others) and answer as from the folder."""
    if backend == "llamacpp":
        pytest.importorskip("llama_cpp")
    from hybridmoe.app.cli import main

    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder, parts = folder_with_projector
    answers = []
    for given in (folder, parts[-1]):
        code = main(["run", "-m", str(given), "-p", "Hello", "--max-tokens", "3", "--temperature", "0",
                     "--backend", backend, "--context", "64", "--json"])
        out, err = capsys.readouterr()
        assert code == 0, err
        answers.append(json.loads(out))
    assert answers[1]["backend"] == backend
    assert answers[1]["token_ids"] == answers[0]["token_ids"] and len(answers[1]["token_ids"]) == 3
