"""User settings (TOML in the platform config dir) and where the app keeps its state.

Locations follow the platform conventions through platformdirs (XDG on Linux, so
XDG_CONFIG_HOME / XDG_DATA_HOME / XDG_STATE_HOME move them); HYBRIDMOE_CONFIG overrides the
settings file itself.

A settings file is written by hand, so it may be wrong: ``read`` never fails on one. Each
unusable entry is named (file, key, what is wrong, what is used instead) and replaced by its
default; the good entries are kept; a file that cannot be read or parsed gives all defaults.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import platformdirs
import tomli_w

from hybridmoe.backend.files import set_aside, write_atomic
from hybridmoe.backend.workload_choices import BACKENDS, KV_BYTES_PER_ELEMENT

APP = "hybridmoe"

# Beyond the context window of every released model (the longest are 10M tokens): a larger
# number is a typo, and planning for it would only say that nothing fits.
MAX_CONTEXT = 1 << 24
MAX_USERS = 1024  # concurrent conversations on one workstation; more is a typo


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
        """Write the settings. A file there that does not read cleanly (a hand edit gone
        wrong) is set aside first, not overwritten: what the person wrote stays readable."""
        path = path or settings_path()
        if path.is_file() and read(path).problems:
            set_aside(path, "invalid")
        return write_atomic(path, tomli_w.dumps(asdict(self)))


def _allowed_values() -> dict[str, tuple[Callable[[Any], bool], str]]:
    """What a value may be beyond its type: a test, and the words that say what it must be."""
    return {
        "backend": (lambda v: v in BACKENDS, f"one of {', '.join(BACKENDS)}"),
        "context": (lambda v: 1 <= v <= MAX_CONTEXT, f"a number of tokens from 1 to {MAX_CONTEXT}"),
        "users": (lambda v: 1 <= v <= MAX_USERS, f"a number of conversations from 1 to {MAX_USERS}"),
        "kv_dtype": (lambda v: v in KV_BYTES_PER_ELEMENT, f"one of {', '.join(KV_BYTES_PER_ELEMENT)}"),
    }


_TYPE_WORDS = {str: "a string", int: "a whole number", bool: "true or false"}


@dataclass(frozen=True)
class LoadedSettings:
    settings: Settings
    path: Path
    # One line per problem: the file, the key, what is wrong, what is used instead.
    problems: tuple[str, ...] = ()

    @property
    def hint(self) -> str:
        return (f"Fix the file or delete it. Should the app save a setting first, it keeps this file "
                f"beside the new one as {self.path.name}.invalid-<time>.")


def read(path: Path | None = None) -> LoadedSettings:
    """The settings from the TOML file (defaults when there is none), and what was wrong in it."""
    path = path or settings_path()
    defaults = Settings()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return LoadedSettings(defaults, path)
    except OSError as e:
        return LoadedSettings(defaults, path, (f"cannot read the settings file {path} ({e.strerror or e}); "
                                               "using the default settings",))
    try:
        data = tomllib.loads(raw.decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        return LoadedSettings(defaults, path, (f"the settings file {path} is not valid TOML ({e}); "
                                               "using the default settings",))
    known = [f.name for f in fields(Settings)]
    allowed_values = _allowed_values()
    values: dict[str, Any] = {}
    problems = []
    for key, value in data.items():
        if key not in known:
            problems.append(f"{path}: unknown setting {key!r} ignored (the settings are {', '.join(known)})")
            continue
        default = getattr(defaults, key)
        allowed, words = allowed_values.get(key, (lambda v: True, ""))
        if type(value) is not type(default):
            words = words or _TYPE_WORDS[type(default)]
        elif allowed(value):
            values[key] = value
            continue
        problems.append(f"{path}: {key} must be {words}, not {value!r}; using the default {default!r}")
    return LoadedSettings(Settings(**values), path, tuple(problems))


def load(path: Path | None = None) -> Settings:
    """The settings to use, whatever the file holds (``read`` says what was wrong in it)."""
    return read(path).settings
