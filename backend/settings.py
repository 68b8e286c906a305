"""User settings (TOML in the platform config dir) and where the app keeps its state.

Locations follow the platform conventions through platformdirs (XDG on Linux, so
XDG_CONFIG_HOME / XDG_DATA_HOME / XDG_STATE_HOME move them); HYBRIDMOE_CONFIG overrides the
settings file itself.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import platformdirs
import tomli_w

from backend.errors import UsageError
from backend.files import write_atomic

APP = "hybridmoe"


def config_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP))


def data_dir() -> Path:
    """Conversations, saved plans, expert statistics."""
    return Path(platformdirs.user_data_dir(APP))


def state_dir() -> Path:
    """Logs (the tracebacks of internal errors go here, not to the terminal)."""
    return Path(platformdirs.user_state_dir(APP))


def settings_path() -> Path:
    return Path(os.environ.get("HYBRIDMOE_CONFIG") or config_dir() / "settings.toml")


def default_model_store() -> Path:
    """The Hugging Face hub cache (HF_HOME / HF_HUB_CACHE honoured), shared with other tools."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


@dataclass(frozen=True)
class Settings:
    model_store: str = ""  # empty: the Hugging Face hub cache
    default_model: str = ""
    backend: str = "auto"
    context: int = 32768
    users: int = 1
    kv_dtype: str = "bf16"
    measure_bandwidth: bool = True
    record_stats: bool = False

    @property
    def model_store_path(self) -> Path:
        return Path(self.model_store).expanduser() if self.model_store else default_model_store()

    def save(self, path: Path | None = None) -> Path:
        return write_atomic(path or settings_path(), tomli_w.dumps(asdict(self)))


def load(path: Path | None = None) -> Settings:
    """Settings from the TOML file; defaults when it does not exist."""
    path = path or settings_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Settings()
    except OSError as e:
        raise UsageError(f"cannot read settings file {path}: {e.strerror}")
    try:
        data = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UsageError(f"settings file {path} is not valid TOML: {e}", "Fix or delete it; defaults are used then.")
    known = {f.name: f for f in fields(Settings)}
    defaults = Settings()
    values = {}
    for key, value in data.items():
        if key not in known:
            raise UsageError(f"settings file {path}: unknown key {key!r}", f"Known keys: {', '.join(known)}.")
        expected = type(getattr(defaults, key))
        if type(value) is not expected:
            raise UsageError(
                f"settings file {path}: {key} must be a {expected.__name__}, got {value!r}",
            )
        values[key] = value
    return Settings(**values)
