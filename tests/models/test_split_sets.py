"""Split GGUF sets (``NAME-00001-of-0000N.gguf``, as gguf-py's writer and llama.cpp's
gguf-split write them) whose parts do not make one model: a part missing beside parts of
another split of the same name, a part of another model, a part renamed out of the pattern,
a name whose numbers make no sense. Each is one message naming the file, and every reader
(inspection, the engine's weights, llama.cpp's header) gives it; `inspect` prints it as one
error, also with --json."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from hybridmoe.backend.errors import ModelError
from tests.models.conftest import write_qwen3moe_gguf
from tests.quant.tiny_gguf import rand, write_gguf


def readers():
    from hybridmoe.backend.formats.gguf_weights import open_gguf
    from hybridmoe.backend.llamacpp.header import read_header
    from hybridmoe.backend.models import inspect_model

    return (inspect_model, open_gguf, read_header)


def refused_by_every_reader(path: Path) -> str:
    """The message every reader gives for `path`: one and the same."""
    messages = set()
    for read in readers():
        with pytest.raises(ModelError) as err:
            read(path)
        messages.add(f"{err.value.what}\n{err.value.hint}")
    assert len(messages) == 1, messages
    return messages.pop()


@pytest.fixture(scope="module")
def three_parts(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("three")
    parts = write_qwen3moe_gguf(folder / "tiny.gguf", split_max_tensors=16)
    assert [p.name for p in parts] == ["tiny-00001-of-00003.gguf", "tiny-00002-of-00003.gguf", "tiny-00003-of-00003.gguf"]
    return parts


def test_a_missing_part_beside_parts_of_another_split_of_the_same_name(three_parts, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    two = write_qwen3moe_gguf(other / "tiny.gguf", split_max_tensors=24)
    assert len(two) == 2
    folder = tmp_path / "mixed"
    folder.mkdir()
    for part in [*three_parts[:2], *two]:
        shutil.copy(part, folder / part.name)
    message = refused_by_every_reader(folder / "tiny-00002-of-00003.gguf")
    assert "tiny-00002-of-00003.gguf is part of a 3-file GGUF set, but tiny-00003-of-00003.gguf is missing" in message
    assert "also holds parts of a 2-file split of the same name: those belong to another set" in message
    assert "Download every part of the set into the same folder." in message


def test_a_part_of_another_model_with_the_same_name_and_count(tmp_path):
    rng = np.random.default_rng(3)
    mine = tmp_path / "mine"
    theirs = tmp_path / "theirs"
    mine.mkdir(), theirs.mkdir()
    # Four tensors in two parts, and three in two parts: the same names, another set.
    write_gguf(mine / "m.gguf", "qwen3moe", {f"blk.{i}.attn_norm.weight": (rand(rng, 64), T.F32) for i in range(4)},
               split_max_tensors=2)
    write_gguf(theirs / "m.gguf", "qwen3moe", {f"blk.{i}.attn_norm.weight": (rand(rng, 64), T.F32) for i in range(3)},
               split_max_tensors=2)
    shutil.copy(theirs / "m-00002-of-00002.gguf", mine / "m-00002-of-00002.gguf")
    from hybridmoe.backend.models.gguf_reader import open_gguf_set

    for given in ("m-00001-of-00002.gguf", "m-00002-of-00002.gguf"):
        with pytest.raises(ModelError) as err:
            open_gguf_set(mine / given)
        assert err.value.what == ("m-00002-of-00002.gguf belongs to another GGUF set than m-00001-of-00002.gguf: "
                                  "it says the set holds 3 tensors, m-00001-of-00002.gguf says 4 (split.tensors.count).")
        assert "different models or downloads" in err.value.hint


def test_a_part_from_a_split_with_another_count(three_parts, tmp_path):
    """A 2-part split's second part renamed into a 3-part set: its split.count says so."""
    other = tmp_path / "other"
    other.mkdir()
    two = write_qwen3moe_gguf(other / "tiny.gguf", split_max_tensors=24)
    for part in three_parts:
        shutil.copy(part, tmp_path / part.name)
    shutil.copy(two[1], tmp_path / "tiny-00002-of-00003.gguf")
    message = refused_by_every_reader(tmp_path / "tiny-00001-of-00003.gguf")
    assert "tiny-00002-of-00003.gguf says it is part 2 of 2, but its name makes it part 2 of 3" in message


@pytest.mark.parametrize(("name", "said"), [
    ("tiny-part1.gguf", "its name does not follow the NAME-00001-of-0000N.gguf pattern"),
    ("tiny-1-of-3.gguf", "its name is not written as llama.cpp writes split names (five digits: tiny-00001-of-00003.gguf)"),
])
def test_a_part_renamed_out_of_the_pattern(three_parts, tmp_path, name, said):
    """Before, such a file opened as a whole model with two thirds of its tensors missing."""
    renamed = shutil.copy(three_parts[0], tmp_path / name)
    message = refused_by_every_reader(renamed)
    assert f"{renamed} is part 1 of a 3-file split GGUF set (its split.count key), but {said}" in message
    assert "so the other parts cannot be found" in message
    assert "NAME-00001-of-0000N.gguf to NAME-0000N-of-0000N.gguf (five digits each) in one folder" in message
    assert "llama-gguf-split --merge" in message


def test_a_name_whose_numbers_make_no_sense(three_parts, tmp_path):
    wrong = shutil.copy(three_parts[0], tmp_path / "tiny-00004-of-00003.gguf")
    message = refused_by_every_reader(wrong)
    assert message.startswith("tiny-00004-of-00003.gguf is named as part 4 of a 3-file GGUF set, which cannot be.")


def test_inspect_refuses_a_set_in_one_error_also_in_json(three_parts, tmp_path, capsys):
    from hybridmoe.app.cli import main

    for part in three_parts[:2]:
        shutil.copy(part, tmp_path / part.name)
    assert main(["inspect", str(tmp_path / "tiny-00002-of-00003.gguf"), "--json"]) == 1
    out, err = capsys.readouterr()
    error = json.loads(out)["error"]
    assert error["message"].startswith("tiny-00002-of-00003.gguf is part of a 3-file GGUF set, but "
                                       "tiny-00003-of-00003.gguf is missing")
    assert error["hint"] == "Download every part of the set into the same folder."
    assert "Traceback" not in err and err.startswith("hybridmoe: error: tiny-00002-of-00003.gguf")


@pytest.mark.parametrize("which", [0, 1, 2])
def test_inspect_and_plan_from_any_part(three_parts, capsys, which):
    from hybridmoe.app.cli import main

    whole = three_parts[0].parent / "whole"
    whole.mkdir(exist_ok=True)
    single = write_qwen3moe_gguf(whole / "tiny.gguf")[0]
    assert main(["inspect", str(single), "--json"]) == 0
    expected = json.loads(capsys.readouterr().out)["inventory"]
    assert main(["inspect", str(three_parts[which]), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["inventory"]["files"] == [str(p) for p in three_parts]  # the set, from its first part
    assert got["inventory"]["bytes_by_class"] == expected["bytes_by_class"]
    assert got["inventory"]["types"] == expected["types"]
    assert main(["plan", str(three_parts[which]), "--hardware", "cpu-only", "--context", "256", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "tiny-qwen3moe" and plan["fits"]
