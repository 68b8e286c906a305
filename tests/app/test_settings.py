"""Settings in TOML under the platform config directory."""

import pytest

from hybridmoe.backend import settings


@pytest.fixture(autouse=True)
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("HYBRIDMOE_CONFIG", raising=False)
    return tmp_path / "config"


def test_defaults_when_there_is_no_file(config_home):
    assert settings.load() == settings.Settings()
    assert settings.settings_path() == config_home / "hybridmoe" / "settings.toml"


def test_save_and_load_round_trip():
    s = settings.Settings(default_model="/models/x", context=8192, users=2, record_stats=True)
    path = s.save()
    assert path.read_text().startswith("model_store")
    assert settings.load() == s


def test_the_model_store_defaults_to_the_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    assert settings.Settings().model_store_path == settings.default_model_store()
    assert str(settings.default_model_store()) == str(constants.HF_HUB_CACHE)
    assert settings.Settings(model_store=str(tmp_path)).model_store_path == tmp_path


@pytest.mark.parametrize(
    "line, key, needle",
    [
        ("context = -5", "context", "context must be a number of tokens from 1 to"),
        (f"context = {settings.MAX_CONTEXT + 1}", "context", "context must be a number of tokens from 1 to"),
        ('context = "big"', "context", "context must be a number of tokens"),
        ('backend = "gpu-magic"', "backend", "backend must be one of auto, engine, llamacpp, not 'gpu-magic'"),
        ("users = 0", "users", "users must be a number of conversations from 1 to"),
        ('kv_dtype = "fp4"', "kv_dtype", "kv_dtype must be one of bf16"),
        ('measure_bandwidth = "yes"', "measure_bandwidth", "measure_bandwidth must be true or false"),
        ("model_store = 5", "model_store", "model_store must be a string"),
    ],
)
def test_a_bad_value_is_named_and_its_default_used_the_good_ones_kept(line, key, needle, tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text(f'default_model = "/models/x"\n{line}\n')
    monkeypatch.setenv("HYBRIDMOE_CONFIG", str(path))
    loaded = settings.read()
    assert len(loaded.problems) == 1, loaded.problems
    problem = loaded.problems[0]
    assert problem.startswith(f"{path}: ") and needle in problem
    assert f"using the default {getattr(settings.Settings(), key)!r}" in problem
    assert getattr(loaded.settings, key) == getattr(settings.Settings(), key)
    assert loaded.settings.default_model == "/models/x"  # the good entries stay
    assert settings.load() == loaded.settings


def test_an_unknown_key_is_named_and_ignored(tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text("contxt = 5\ncontext = 8192\n")
    monkeypatch.setenv("HYBRIDMOE_CONFIG", str(path))
    loaded = settings.read()
    assert loaded.settings == settings.Settings(context=8192)
    assert loaded.problems == (f"{path}: unknown setting 'contxt' ignored (the settings are model_store, "
                               "default_model, backend, context, users, kv_dtype, measure_bandwidth, record_stats)",)


@pytest.mark.parametrize("text, needle", [("context = [\n", "is not valid TOML"), (b"\xff\xfe", "is not valid TOML"),
                                          (None, "cannot read the settings file")])
def test_a_file_that_cannot_be_read_gives_every_default(text, needle, tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    if text is None:
        path.mkdir()  # a folder where the file should be
    elif isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    monkeypatch.setenv("HYBRIDMOE_CONFIG", str(path))
    loaded = settings.read()
    assert loaded.settings == settings.Settings()
    assert len(loaded.problems) == 1 and str(path) in loaded.problems[0] and needle in loaded.problems[0]
    assert loaded.problems[0].endswith("using the default settings")


def test_saving_over_a_file_with_problems_keeps_it_beside_the_new_one(tmp_path, monkeypatch):
    path = tmp_path / "settings.toml"
    path.write_text("contxt = 65536\n")  # a typo the person will want to see again
    monkeypatch.setenv("HYBRIDMOE_CONFIG", str(path))
    settings.Settings(users=3).save()
    assert settings.read() == settings.LoadedSettings(settings.Settings(users=3), path)
    kept = list(tmp_path.glob("settings.toml.invalid-*"))
    assert len(kept) == 1 and kept[0].read_text() == "contxt = 65536\n"
    settings.Settings(users=4).save()  # a clean file is simply replaced
    assert len(list(tmp_path.glob("settings.toml.invalid-*"))) == 1


def test_every_command_warns_once_on_stderr_and_carries_on(tmp_path, monkeypatch, capsys):
    from hybridmoe.app import cli

    path = tmp_path / "s.toml"
    path.write_text('context = -5\nbackend = "gpu-magic"\n')
    monkeypatch.setenv("HYBRIDMOE_CONFIG", str(path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert cli.main(["models", "--json"]) == 0  # lists the model store, which the settings name
    out, err = capsys.readouterr()
    assert out.strip() == "[]"
    lines = err.splitlines()
    assert lines[0] == f"hybridmoe: warning: {path}: context must be a number of tokens from 1 to " \
                       f"{settings.MAX_CONTEXT}, not -5; using the default 32768"
    assert lines[1].startswith(f"hybridmoe: warning: {path}: backend must be one of")
    assert lines[2].startswith("  Fix the file or delete it.") and len(lines) == 3
