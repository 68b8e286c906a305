"""The Backend/Session protocol both backends implement, and the typed events they emit.

    Backend.load(model_path, plan, on_progress, cancel) -> Session
    Session.generate(messages, sampling, cancel) -> Iterator[Event]
    Session.complete(prompt, sampling, cancel) -> Iterator[Event]   (raw text, no chat template)

The app (TUI, headless, server) calls only these verbs and consumes only these events. Up to
``Session.max_parallel`` generations may run at once, each in its own thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Union

from hybridmoe.backend.errors import HybridMoeError


class Cancelled(HybridMoeError):
    """Long work stopped because the user asked (exit code 130 in the CLI)."""

    exit_code = 130


class CancelToken:
    """Set from any thread (Esc in the TUI, Ctrl+C in the CLI, a closed HTTP connection)."""

    def __init__(self):
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def raise_if_cancelled(self, what: str = "the operation") -> None:
        if self._event.is_set():
            raise Cancelled(f"{what} was cancelled")


@dataclass(frozen=True)
class Progress:
    """Progress of a long operation: `done` of `total` units (bytes, tensors, layers)."""

    stage: str  # "load", "download", "convert", ...
    done: float
    total: float | None = None
    unit: str = ""
    message: str = ""


ProgressCallback = Callable[[Progress], None]


@dataclass(frozen=True)
class Message:
    role: str  # "system", "user", "assistant", "tool"
    content: str


@dataclass(frozen=True)
class TextPiece:
    """Newly generated text; never splits a UTF-8 character; concatenated pieces are the answer."""

    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Stats:
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_s: float | None
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    # Share of routed-expert activations computed by experts resident on the main device.
    main_device_expert_share: float | None = None
    peak_memory_bytes: dict[str, int] = field(default_factory=dict)
    backend: str = ""


@dataclass(frozen=True)
class Done:
    """The last event of a generation. reason: "stop" (end-of-sequence token or stop string),
    "length" (max tokens), "cancelled"."""

    reason: str
    text: str
    token_ids: tuple[int, ...]
    stats: Stats


Event = Union[TextPiece, Done]


class Session(Protocol):
    """What a loaded model can do, stated rather than probed: callers read these attributes
    and never ask which module or class a session comes from."""

    # The backend that runs it: "engine" or "llamacpp".
    backend: str
    # How many generations may run at once (from as many threads); more must wait.
    max_parallel: int
    # Whether it counts which routed experts each token chose (``save_expert_stats``).
    counts_experts: bool
    # Which path computes each new token and why, one line ("decode: native chain, all 48
    # layers"): the engine's plan per layer group (``plan/decode_path``), or llama.cpp's.
    decode_path: str

    def generate(self, messages: Sequence[Message], sampling, cancel: CancelToken | None = None) -> Iterator[Event]: ...

    def complete(self, prompt: str, sampling, cancel: CancelToken | None = None) -> Iterator[Event]: ...

    def save_expert_stats(self, path) -> None:
        """Write the expert counts (the planner's ExpertStats file); only where ``counts_experts``."""

    def close(self) -> None: ...


class Backend(Protocol):
    name: str

    def load(self, model_path, plan, on_progress: ProgressCallback | None = None,
             cancel: CancelToken | None = None, *, chat_template=None) -> Session:
        """``chat_template``: a ``text.chat_template.TemplateFile`` rendered instead of the
        model's own, or None."""
