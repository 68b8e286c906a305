"""A GGUF whose weights hold NaN or infinities (a damaged download): every way of asking it
(`run` greedy or sampled, a session, the API server) ends with one clear error naming the
model as damaged, never an empty answer that looks like a choice to stop, a sampler's error or
an "internal error"; `inspect --check` names the tensors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from hybridmoe.app.server.shared_session import SharedSession
from hybridmoe.backend.errors import DamagedModelError
from hybridmoe.backend.session import Message
from hybridmoe.backend.text.sampling import SamplingParams
from tests.app.test_cli import assert_clean_error, home, run  # noqa: F401 - home is a fixture
from tests.convert.conftest import checkpoints, converted  # noqa: F401 - fixtures: tiny GGUFs
from tests.engine.test_prompt_cache import load
from tests.server.conftest import post

CHAT = [Message("user", "Hello there, how are you?")]


def damaged(converted, tmp_path, how: str):  # noqa: F811
    """A copy of the tiny Q8_0 GGUF with `how`: "nan" sets the final norm to NaN, "inf" sets the
    scales of a few token embedding blocks to infinity (every token's embedding is looked up)."""
    import gguf

    path = tmp_path / f"{how}.gguf"
    shutil.copy(converted("qwen3_moe", "q8_0"), path)
    reader = gguf.GGUFReader(path, "r+")
    tensors = {t.name: t for t in reader.tensors}
    if how == "nan":
        tensors["output_norm.weight"].data[:] = np.nan
    else:
        embedding = tensors["token_embd.weight"].data  # uint8 rows of Q8_0 blocks: fp16 scale, 32 codes
        embedding[:, 0:2] = [0x00, 0x7C]  # +infinity as little-endian fp16, the first block of every row
    reader.data.flush()
    del reader
    return path


@pytest.mark.parametrize("how", ["nan", "inf"])
@pytest.mark.parametrize("temperature", ["0", "0.7"])
def test_run_calls_the_model_damaged(home, converted, tmp_path, how, temperature):  # noqa: F811
    path = damaged(converted, tmp_path, how)
    r = run("run", "-m", path, "-p", "Hello", "--temperature", temperature, "--max-tokens", "4", env=home)
    assert_clean_error(r, 1)
    assert f"{path} computed logits that are not numbers" in r.stderr and "damaged" in r.stderr
    assert "internal error" not in r.stderr and "probability tensor" not in r.stderr


def test_a_greedy_generation_raises_rather_than_stopping(converted, tmp_path):  # noqa: F811
    session = load(damaged(converted, tmp_path, "nan"))
    try:
        with pytest.raises(DamagedModelError, match="damaged"):
            list(session.generate(CHAT, SamplingParams(temperature=0.0, max_tokens=4)))
    finally:
        session.close()


def test_the_server_answers_with_a_server_error_naming_the_damage(start_server, converted, tmp_path):  # noqa: F811
    shared = SharedSession(load(damaged(converted, tmp_path, "nan")))
    try:
        server = start_server(shared)
        for temperature in (0, 0.7):
            status, _, body = post(f"{server.url}/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Hello"}], "temperature": temperature, "max_tokens": 4})
            assert status == 500, body
            assert "computed logits that are not numbers" in body["error"]["message"]
            assert body["error"]["type"] == "server_error"
    finally:
        shared.close()


def test_inspect_check_names_the_tensors(home, converted, tmp_path):  # noqa: F811
    for how, tensor in (("nan", "output_norm.weight"), ("inf", "token_embd.weight")):
        path = damaged(converted, tmp_path, how)
        r = run("inspect", path, "--check", env=home)
        assert_clean_error(r, 1)
        assert f"  {tensor}: " in r.stdout and "damaged" in r.stderr
        r = run("inspect", path, "--check", "--json", env=home)
        assert r.returncode == 1 and list(json.loads(r.stdout)["check"]["non_finite"]) == [tensor]
    r = run("inspect", converted("qwen3_moe", "q8_0"), "--check", env=home)
    assert r.returncode == 0 and "NaN / infinity: none in the" in r.stdout, r.stderr
