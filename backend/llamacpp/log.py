"""llama.cpp's log output: captured per call, forwarded to Python logging, never printed.

llama.cpp reports failures by logging a reason to stderr and returning NULL, and it reports
where each tensor went ("tensor blk.3.ffn_up_exps.weight (...) buffer type overridden to
CPU", "layer 3 assigned to device CUDA0") only in its log. One process-wide callback
(``llama_log_set`` also routes ggml's and the GGUF reader's messages) collects complete lines;
``capture()`` hands the lines logged by the calling thread during a block to that block, so
a load can turn llama.cpp's own words into a ModelError and check the placement it reports.

Every line also goes to the ``hybridmoe.llamacpp`` logger (with a NullHandler, so nothing
reaches the terminal unless the application configures logging): headless runs keep stderr
for progress and statistics.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

logger = logging.getLogger("hybridmoe.llamacpp")
logger.addHandler(logging.NullHandler())

# enum ggml_log_level as llama.cpp has numbered it since late 2024 (llama-cpp-python's own
# _logger.py still carries the older numbering in a comment).
NONE, DEBUG, INFO, WARN, ERROR, CONT = 0, 1, 2, 3, 4, 5
_PY_LEVELS = {NONE: logging.DEBUG, DEBUG: logging.DEBUG, INFO: logging.INFO, WARN: logging.WARNING, ERROR: logging.ERROR}

_OVERRIDDEN = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
_ASSIGNED = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")
# "llama_model_load: error loading model: llama_model_loader: reason" -> "reason"
_PREFIXES = re.compile(r"^(?:(?:\w+|error loading model): )+")
# What llama.cpp adds after the real reason, which says nothing more.
_GENERIC = re.compile(r"failed to load model|failed to load model from .*|failed to initiali[sz]e the context")


@dataclass(frozen=True)
class LogLine:
    level: int
    text: str  # without the trailing newline


@dataclass(eq=False)  # captures are told apart by identity (two may hold the same lines)
class Capture:
    lines: list[LogLine] = field(default_factory=list)

    def at(self, level: int) -> list[str]:
        return [line.text for line in self.lines if line.level == level]

    @property
    def errors(self) -> list[str]:
        return self.at(ERROR)

    def overridden_tensors(self) -> dict[str, str]:
        """Tensor name -> buffer type, for every tensor a buffer-type override placed."""
        out = {}
        for line in self.lines:
            m = _OVERRIDDEN.search(line.text)
            if m:
                out[m.group(1)] = m.group(2)
        return out

    def layer_devices(self) -> dict[int, str]:
        """Block index -> device its layer (attention, norms, dense weights) was assigned to."""
        out = {}
        for line in self.lines:
            m = _ASSIGNED.search(line.text)
            if m:
                out[int(m.group(1))] = m.group(2)
        return out

    def failure(self) -> str | None:
        """llama.cpp's reason for a failure, in its words, most specific first: the error
        lines without their function-name prefixes and without the generic "failed to load
        model" that always follows the real reason."""
        reasons = []
        for text in self.errors:
            text = _PREFIXES.sub("", text.strip())
            if not text or _GENERIC.fullmatch(text):
                continue
            if text not in reasons:
                reasons.append(text)
        return "; ".join(reasons) or None


_lock = threading.Lock()
_captures: dict[int, list[Capture]] = {}  # thread id -> active captures, innermost last
_pending: dict[int, tuple[int, str]] = {}  # thread id -> (level, text of an unfinished line)
_callback = None  # the ctypes callback, kept alive for as long as llama.cpp may call it


def install(bindings) -> None:
    """Route llama.cpp's log through ``_on_log`` (idempotent; called on first use of the
    library, after llama-cpp-python installed its own printing callback)."""
    global _callback
    if _callback is None:
        _callback = bindings.llama_log_callback(_on_log)
    bindings.llama_log_set(_callback, ctypes.c_void_p(0))


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    """The lines the calling thread's llama.cpp calls log inside the block."""
    me = threading.get_ident()
    cap = Capture()
    with _lock:
        _captures.setdefault(me, []).append(cap)
    try:
        yield cap
    finally:
        with _lock:
            _flush(me)
            stack = _captures.get(me, [])
            stack[:] = [c for c in stack if c is not cap]
            if not stack:
                _captures.pop(me, None)


def _on_log(level: int, text: bytes | None, user_data) -> None:
    # Called from C: must never raise (ctypes would print the traceback and carry on).
    try:
        me = threading.get_ident()
        piece = text.decode("utf-8", errors="replace") if text else ""
        with _lock:
            held_level, held = _pending.pop(me, (level, ""))
            if level != CONT:
                if held:  # a new message ends an unfinished one (progress dots have no newline)
                    _emit(me, held_level, held)
                held_level, held = level, ""
            held += piece
            *complete, rest = held.split("\n")
            for line in complete:
                _emit(me, held_level, line)
            if rest:
                _pending[me] = (held_level, rest)
    except Exception:  # noqa: BLE001 - see above
        pass


def _flush(me: int) -> None:
    held = _pending.pop(me, None)
    if held and held[1]:
        _emit(me, *held)


def _emit(me: int, level: int, text: str) -> None:
    if not text.strip(" ."):  # progress dots
        return
    line = LogLine(level, text)
    for cap in _captures.get(me, ()):
        cap.lines.append(line)
    logger.log(_PY_LEVELS.get(level, logging.DEBUG), "%s", text)
