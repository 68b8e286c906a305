"""Settings in TOML under the platform config directory."""

import pytest

from backend import settings
from backend.errors import UsageError


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
    "text, needle",
    [
        ("context = [\n", "not valid TOML"),
        ("contxt = 5\n", "unknown key 'contxt'"),
        ('context = "big"\n', "context must be a int"),
    ],
)
def test_a_bad_file_names_itself_and_the_problem(text, needle, tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text(text)
    monkeypatch.setenv("HYBRIDMOE_CONFIG", str(path))
    with pytest.raises(UsageError, match=needle) as e:
        settings.load()
    assert str(path) in str(e.value)
