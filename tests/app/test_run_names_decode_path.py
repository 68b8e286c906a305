"""`run --json` names the path that computed each new token, per layer group, and why, for a
model of every family (the engine's decode plan, ``backend/plan/decode_path.py``); `plan`
names the same path before anything is loaded, from the family's descriptions."""

from __future__ import annotations

import json

import pytest

from hybridmoe.backend.engine import native_kernels
from tests.convert.conftest import FAMILIES, build_checkpoint

# The tiny bf16 checkpoints' paths (tests/convert/conftest.py): the chain where every layer has
# its shape; OLMoE norms q and k over all heads, GPT-OSS has sliding windows
# and sinks, and its bf16 experts in transformers' layout are not read natively.
EXPECTED = {
    "olmoe": "decode: per-call path, attention in PyTorch, all 2 layers: attention: q/k norm over all heads",
    "gpt_oss": ("decode: PyTorch modules, all 3 layers: attention: sliding window, attention sinks; feed-forward: "
                "float GPT-OSS experts stored as x @ W are not read natively"),
}


@pytest.fixture(autouse=True)
def own_dirs(tmp_path, monkeypatch):
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_run_json_names_the_decode_path(family, tmp_path, capsys):
    from hybridmoe.app.cli import main

    checkpoint = build_checkpoint(tmp_path / family, family)
    code = main(["run", "-m", str(checkpoint.path), "-p", "Hello", "--max-tokens", "3", "--context", "128", "--json",
                 "--backend", "engine"])
    out, err = capsys.readouterr()
    assert code == 0, err
    said = json.loads(out)["decode_path"]
    assert said.startswith(EXPECTED.get(family, "decode: native chain, all "))


@pytest.mark.skipif(not native_kernels.available(), reason="native extension not built")
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_plan_names_the_decode_path_before_a_load(family, tmp_path, capsys):
    from hybridmoe.app.cli import main

    checkpoint = build_checkpoint(tmp_path / family, family)
    machine = ["--ram", "64GiB", "--cores", "8", "--host-bandwidth", "100GB/s", "--gpus", "0", "--context", "128"]
    assert main(["plan", str(checkpoint.path), *machine, "--json"]) == 0
    said = json.loads(capsys.readouterr().out)["decode_path"]
    assert said["summary"].startswith(EXPECTED.get(family, "decode: native chain, all "))
    layers = sorted(i for group in said["groups"] for i in group["layers"])
    assert layers == list(range(len(layers))) and len(layers) > 1  # every layer in one group
    assert main(["plan", str(checkpoint.path), *machine]) == 0
    assert f"Engine {said['summary']}" in capsys.readouterr().out


def test_plan_of_a_model_the_engine_does_not_run_says_so_and_still_plans(tmp_path, capsys):
    """A rope type the engine lacks: `plan --backend llamacpp` plans it (no engine path needed)
    and says why the engine has none, instead of refusing with advice already in force."""
    from hybridmoe.app.cli import main

    checkpoint = build_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe")
    config = json.loads((checkpoint.path / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_type": "dynamic", "factor": 2.0}
    (checkpoint.path / "config.json").write_text(json.dumps(config))
    machine = ["--ram", "64GiB", "--cores", "8", "--host-bandwidth", "100GB/s", "--gpus", "0", "--context", "128"]
    assert main(["plan", str(checkpoint.path), *machine, "--backend", "llamacpp", "--json"]) == 0
    assert "rope type 'dynamic'" in json.loads(capsys.readouterr().out)["decode_path"]["unsupported"]
    assert main(["plan", str(checkpoint.path), *machine, "--backend", "llamacpp"]) == 0
    out = capsys.readouterr().out
    assert "The embedded engine does not run this model" in out and "--backend llamacpp`" not in out
