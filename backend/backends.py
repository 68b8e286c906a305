"""Which backend serves a model: `--backend auto|engine|llamacpp` (Workload.backend).

``auto`` prefers the embedded engine and falls back to llama.cpp when the engine says it cannot
serve the model (UnsupportedModelError: an architecture, GGUF type or tokenizer it lacks),
telling the caller why through ``on_fallback``. Other failures (a damaged file, a plan for
another model, a cancelled load) are not a reason to try another backend: they would fail
there too, or the user asked to stop.
"""

from __future__ import annotations

from collections.abc import Callable

from backend.errors import UnsupportedModelError, UsageError
from backend.plan.plan import Plan
from backend.plan.workload import BACKENDS
from backend.session import CancelToken, ProgressCallback, Session


def load_session(
    choice: str,
    model_path,
    plan: Plan,
    on_progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    on_fallback: Callable[[UnsupportedModelError], None] | None = None,
) -> Session:
    """A session on the chosen backend. ``auto`` follows the plan's own choice when it names
    one (a plan made with `hybridmoe plan --backend llamacpp` stays on llama.cpp)."""
    if choice not in BACKENDS:
        raise UsageError(f"unknown backend {choice!r}", f"Choose one of {', '.join(BACKENDS)}.")
    if choice == "auto":
        choice = plan.workload.backend
    if choice == "engine":
        return _engine().load(model_path, plan, on_progress, cancel)
    if choice == "llamacpp":
        return _llamacpp().load(model_path, plan, on_progress, cancel)
    try:
        return _engine().load(model_path, plan, on_progress, cancel)
    except UnsupportedModelError as why:
        from backend.llamacpp import LlamaCppUnavailable

        if on_fallback is not None:
            on_fallback(why)
        try:
            return _llamacpp().load(model_path, plan, on_progress, cancel)
        except LlamaCppUnavailable as missing:
            hint = f"{why.hint or ''} The llama.cpp fallback is not available: {missing}".strip()
            raise UnsupportedModelError(why.what, hint) from why


def _engine():
    from backend.engine.session import EngineBackend

    return EngineBackend()


def _llamacpp():
    from backend.llamacpp import LlamaCppBackend

    return LlamaCppBackend()
