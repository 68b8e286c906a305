"""What the terminal UI remembers between runs that is not a preference a person writes by
hand (those are in settings.toml): where the setup wizard stopped, which models hybridmoe
itself downloaded or converted (only those may be deleted without a second thought), the
chat's system prompt and sampling settings.

A TOML file in the data directory (``<data dir>/tui-state.toml``), written atomically. A
damaged file is set aside and defaults are used: losing this state costs a click, refusing
to start would cost more.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomli_w

from hybridmoe.backend.files import write_atomic

log = logging.getLogger(__name__)

# Chat defaults: a little randomness reads better than greedy decoding in a conversation.
DEFAULT_SAMPLING: dict[str, Any] = {
    "temperature": 0.7,
    "top_k": 0,
    "top_p": 0.95,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}

# Steps of the setup wizard, in order.
SETUP_STEPS = ("hardware", "model", "get", "layout", "load")


@dataclass(frozen=True)
class SetupProgress:
    """Where the wizard is: the step, and what it was getting (so a restart can resume)."""

    step: str = ""  # one of SETUP_STEPS; "" when the wizard is not in progress
    repo: str = ""  # Hub repository being downloaded
    quant: str = ""  # GGUF quantization of it, "" for a safetensors checkpoint
    convert_to: str = ""  # convert the download to this GGUF quantization afterwards, "" not
    model_path: str = ""  # the model once it is on disk


@dataclass(frozen=True)
class AppState:
    setup: SetupProgress = field(default_factory=SetupProgress)
    # Paths of models hybridmoe downloaded or converted (LocalModel.path as a string).
    obtained: tuple[str, ...] = ()
    system_prompt: str = ""
    sampling: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SAMPLING))
    # A conversation longer than the context: leave out its oldest turns (the system prompt
    # stays) rather than refuse every message from then on.
    drop_oldest_turns: bool = True

    def with_obtained(self, path: str | Path) -> AppState:
        path = str(path)
        return self if path in self.obtained else replace(self, obtained=(*self.obtained, path))

    def without_obtained(self, path: str | Path) -> AppState:
        return replace(self, obtained=tuple(p for p in self.obtained if p != str(path)))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["obtained"] = list(self.obtained)
        d["sampling"] = {k: v for k, v in self.sampling.items() if v is not None}  # TOML has no null
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AppState:
        setup_names = {f.name for f in fields(SetupProgress)}
        setup = SetupProgress(**{k: str(v) for k, v in dict(d.get("setup") or {}).items() if k in setup_names})
        if setup.step and setup.step not in SETUP_STEPS:
            setup = SetupProgress()
        return cls(
            setup=setup,
            obtained=tuple(str(p) for p in d.get("obtained") or ()),
            system_prompt=str(d.get("system_prompt") or ""),
            sampling={**DEFAULT_SAMPLING, **dict(d.get("sampling") or {})},
            drop_oldest_turns=bool(d.get("drop_oldest_turns", True)),
        )


def state_path(data_dir: Path) -> Path:
    return data_dir / "tui-state.toml"


def load_state(data_dir: Path) -> AppState:
    path = state_path(data_dir)
    try:
        return AppState.from_dict(tomllib.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return AppState()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, TypeError, ValueError) as error:
        log.warning("ignoring unreadable %s: %s", path, error)
        try:
            path.replace(path.with_suffix(".toml.damaged"))
        except OSError:
            pass
        return AppState()


def save_state(data_dir: Path, state: AppState) -> Path:
    return write_atomic(state_path(data_dir), tomli_w.dumps(state.to_dict()))
