"""The shipped catalogue: it loads, every entry's config inspects, its numbers agree, ranking works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridmoe.backend.errors import ModelError, UsageError
from hybridmoe.backend.hardware import preset
from hybridmoe.backend.hub import catalogue
from hybridmoe.backend.models.families import family_by_name
from hybridmoe.backend.plan import Workload

ROOT = Path(__file__).resolve().parents[2]

TARGETS = {  # the models the catalogue must know, by official repository
    "moonshotai/Kimi-K2.6", "moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2-Instruct", "deepseek-ai/DeepSeek-V3",
    "deepseek-ai/DeepSeek-R1", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B", "Qwen/Qwen3-Coder-480B-A35B-Instruct",
    "openai/gpt-oss-20b", "openai/gpt-oss-120b", "zai-org/GLM-4.5", "zai-org/GLM-4.5-Air",
    "mistralai/Mixtral-8x7B-v0.1", "mistralai/Mixtral-8x22B-v0.1", "allenai/OLMoE-1B-7B-0924",
    "Qwen/Qwen1.5-MoE-A2.7B", "deepseek-ai/DeepSeek-V2-Lite",
}


@pytest.fixture(scope="module")
def cat():
    return catalogue.load()


def test_the_catalogue_ships_next_to_the_backend_package(cat):
    assert catalogue.assets_dir() == ROOT / "assets"
    assert cat.path == ROOT / "assets" / "catalogue.toml"


def test_it_knows_every_target_model(cat):
    assert {e.repo for e in cat} == TARGETS
    assert len(set(cat.ids())) == len(cat)


def test_every_entry_config_inspects(cat):
    for e in cat:
        family_by_name(e.family)  # a family hybridmoe.backend.models serves
        assert e.config_path.parent == ROOT / "assets" / "configs"
        assert e.context == e.spec.max_context > 0
        assert e.checkpoint_size().bytes > 0
        for q in e.quants:
            size = e.quant_size(q)
            assert size is None or size.bytes > 0, (e.id, q.name)


def test_published_and_computed_sizes_agree(cat):
    """Within 1% for checkpoints and the llama.cpp types; the gpt-oss GGUFs (other tensors
    quantized too) and Q5_K_M (computed as Q5_K) within 13%."""
    checked = 0
    for e in cat:
        if e.checkpoint_bytes is not None:
            computed = e.inspect().inventory.total_bytes
            assert abs(e.checkpoint_bytes / computed - 1) < 0.01, e.id
            checked += 1
        for q in e.quants:
            if q.published_bytes is None or q.format is None:
                continue
            computed = e.inspect(q.format).inventory.total_bytes
            tolerance = 0.01 if q.format in ("q4_k_m", "q8_0", "bf16") else 0.13
            assert abs(q.published_bytes / computed - 1) < tolerance, (e.id, q.name, q.published_bytes, computed)
            checked += 1
    assert checked >= 15


def test_find_by_id_repo_or_name(cat):
    k = cat.find("kimi-k2.6")
    assert k.repo == "moonshotai/Kimi-K2.6" and k.family == "deepseek" and k.context == 262144
    assert cat.find("MOONSHOTAI/kimi-k2.6") is k and cat.find("Kimi-K2.6") is k
    assert cat.find("unsloth/Qwen3-30B-A3B-GGUF").id == "qwen3-30b-a3b"
    assert cat.find("nothing") is None


def test_to_dict_is_json(cat):
    d = json.loads(json.dumps([e.to_dict() for e in cat]))
    q = next(x for x in d if x["id"] == "deepseek-v3")
    assert q["quants"]["Q4_K_M"]["published"] and q["quants"]["Q4_K_M"]["bytes"] == 404_430_000_000
    assert q["checkpoint"]["format"] == "fp8_block"


def test_rank_for_a_big_machine_lists_what_fits_fastest_first(cat):
    ranked = catalogue.rank_for(preset("4x H200 NVL"), Workload(context=32768), catalogue=cat)
    assert {r.entry.id for r in ranked} >= {"kimi-k2.6", "deepseek-v3", "qwen3-30b-a3b", "gpt-oss-120b"}
    speeds = [r.tokens_per_s for r in ranked]
    assert all(s is not None for s in speeds) and speeds == sorted(speeds, reverse=True)
    assert all(r.plan.fits for r in ranked)
    kimi = next(r for r in ranked if r.entry.id == "kimi-k2.6")
    assert kimi.option == "checkpoint"  # the published int4 fits: no re-quantization
    olmoe = next(r for r in ranked if r.entry.id == "olmoe-1b-7b")
    assert olmoe.context == 4096  # capped at what the model takes


def test_rank_for_a_small_machine_leaves_out_what_does_not_fit(cat):
    from hybridmoe.backend.hardware.overrides import apply_overrides

    small = apply_overrides(preset("cpu-only"), ram=32 << 30)
    ranked = catalogue.rank_for(small, catalogue=cat)
    ids = {r.entry.id for r in ranked}
    assert "kimi-k2.6" not in ids and "deepseek-v3" not in ids
    assert "qwen3-30b-a3b" in ids
    qwen = next(r for r in ranked if r.entry.id == "qwen3-30b-a3b")
    assert qwen.option in ("Q4_K_M", "Q8_0")  # the bf16 checkpoint does not fit 32 GiB
    assert all(r.plan.fits for r in ranked)


def test_names_on_the_command_line(cat, home):
    assert catalogue.model_path("kimi-k2.6") == cat.find("kimi-k2.6").config_path
    assert catalogue.model_path("moonshotai/Kimi-K2.6") == cat.find("kimi-k2.6").config_path
    with pytest.raises(UsageError, match="hybridmoe pull org/unknown"):
        catalogue.model_path("org/unknown")
    with pytest.raises(UsageError, match="neither a file"):
        catalogue.model_path("no-such-model")
    assert catalogue.model_path("./missing.json") == Path("./missing.json")
    assert catalogue.pull_target("kimi-k2.6") == "moonshotai/Kimi-K2.6"
    assert catalogue.pull_target("kimi-k2.6", "UD-Q4_K_XL") == "unsloth/Kimi-K2.6-GGUF"
    assert catalogue.pull_target("someone/repo", "Q4_K_M") == "someone/repo"
    with pytest.raises(UsageError, match="no GGUF repository"):
        catalogue.pull_target("olmoe-1b-7b", "Q4_K_M")


def test_a_malformed_catalogue_names_the_entry(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "c.toml").write_text('[[model]]\nid = "x"\nname = "X"\nrepo = "a/b"\nconfig = "configs/none.json"\n')
    with pytest.raises(ModelError, match=r"model #1 \(x\) is malformed.*does not exist"):
        catalogue.load(tmp_path / "c.toml")


def test_the_wheel_installs_one_import_package():
    """app/, backend/ and assets/ go into the wheel under hybridmoe/ and nothing else at the top
    (a generic top-level name is overwritten by any other distribution that ships it). A wheel
    build compiles native/, too slow for this suite (packaging/check_wheel.sh lists the real
    wheel), so the build configuration is checked, and the extension's install folder."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["scikit-build"]["wheel"]["packages"]
    assert packages == {"hybridmoe/app": "app", "hybridmoe/backend": "backend", "hybridmoe/assets": "assets"}
    assert "DESTINATION hybridmoe)" in (ROOT / "native" / "CMakeLists.txt").read_text()
    assert config["project"]["scripts"] == {"hybridmoe": "hybridmoe.app.cli:main"}
    assert catalogue.assets_dir().samefile(ROOT / "assets")


def test_an_installed_copy_finds_its_catalogue(tmp_path):
    """Installed from the wheel (not editable), the package's folders sit under one
    ``hybridmoe`` directory on sys.path; the catalogue and the configs must be found there.
    (``assets`` once lacked an __init__.py: as a namespace package its ``files()`` was a
    MultiplexedPath whose str() is not a path, so every installed copy missed its catalogue.)"""
    import shutil
    import subprocess
    import sys
    import sysconfig

    root = Path(__file__).resolve().parents[2]
    installed = tmp_path / "site" / "hybridmoe"
    for folder in ("app", "backend", "assets"):  # as pyproject's wheel.packages maps them
        shutil.copytree(root / folder, installed / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # -S: no .pth files, so no editable-install finder; then this site's packages after the copy.
    code = (f"import sys; sys.path[:0] = [{str(tmp_path / 'site')!r}]; sys.path.append({sysconfig.get_paths()['purelib']!r})\n"
            "from hybridmoe.backend.hub import catalogue\n"
            "print(catalogue.assets_dir()); print(len(catalogue.load().entries))")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    where, entries = r.stdout.split()
    assert Path(where) == installed / "assets" and int(entries) > 0


# ---- a catalogue name means the variant that fits (#48 item 9) --------------------------------


def _a_32_gib_pc():
    from hybridmoe.backend.hardware.overrides import apply_overrides
    from hybridmoe.backend.hardware.presets import preset

    return apply_overrides(preset("cpu-only"), ram=32 * 2**30, gpus=0)


def test_pull_of_a_catalogue_name_takes_the_variant_the_list_shows():
    from hybridmoe.backend.hub.catalogue import pull_choice, rank_for

    hardware = _a_32_gib_pc()
    listed = {r.entry.id: r.option for r in rank_for(hardware)}
    assert listed["qwen3-30b-a3b"] == "Q4_K_M"  # its 57 GiB checkpoint does not fit 32 GiB
    choice = pull_choice("qwen3-30b-a3b", None, hardware)
    assert choice.quant == "Q4_K_M" and choice.repo.endswith("GGUF") and "fits this machine" in choice.why
    nothing = pull_choice("kimi-k2.6", None, hardware)
    assert nothing.repo == "moonshotai/Kimi-K2.6" and nothing.quant is None and "no variant" in nothing.why
    asked = pull_choice("qwen3-30b-a3b", "Q8_0", hardware)  # a quantization asked for is taken as asked
    assert asked.quant == "Q8_0" and asked.why == ""
    assert pull_choice("org/repo", None, hardware).repo == "org/repo"


def test_run_of_a_catalogue_name_loads_its_copy_on_disk_or_says_how_to_get_it(monkeypatch, tmp_path):
    from hybridmoe.backend.errors import UsageError
    from hybridmoe.backend.hub import discover
    from hybridmoe.backend.hub.catalogue import runnable_path
    from hybridmoe.backend.hub.local import LocalModel

    on_disk: list[LocalModel] = []
    monkeypatch.setattr(discover, "list_local_models", lambda **_: list(on_disk))
    with pytest.raises(UsageError, match="not on this machine") as err:
        runnable_path("qwen3-30b-a3b")  # was: the bundled config.json, planned as the bf16 checkpoint
    assert "hybridmoe pull qwen3-30b-a3b" in err.value.hint
    gguf = tmp_path / "Qwen_Qwen3-30B-A3B-Q4_K_M.gguf"
    on_disk.append(LocalModel(name="q", path=gguf, kind="gguf", size_bytes=1, source="hf-cache",
                              repo_id="bartowski/Qwen_Qwen3-30B-A3B-GGUF"))
    assert runnable_path("qwen3-30b-a3b") == gguf


def test_every_model_is_planned_at_its_own_default_context(cat):
    """The F3 catalogue is given the loaded model's workload: each model is still planned at its
    own default context (the default, or its maximum when less), and ranked by the speed to
    expect, the bound beside it."""
    ranked = catalogue.rank_for(preset("4x H200 NVL"), Workload(context=2048, users=1), catalogue=cat)
    for r in ranked:
        assert r.context == r.plan.workload.context == min(Workload().context, r.entry.context), r.entry.id
        assert r.tokens_per_s == r.plan.decode_tokens_per_s_expected <= r.bound_tokens_per_s
