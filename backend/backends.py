"""Which backend serves a model: `--backend auto|engine|llamacpp` (Workload.backend).

``auto`` prefers the embedded engine and falls back to llama.cpp when the engine says it cannot
serve the model (UnsupportedModelError: an architecture, GGUF type or tokenizer it lacks),
telling the caller why through ``on_fallback``. Other failures (a damaged file, a plan for
another model, a cancelled load) are not a reason to try another backend: they would fail
there too, or the user asked to stop.

``auto`` never picks llama.cpp where it is known to crash (an AMX CPU with a llama-cpp-python
too old to keep its weights off the AMX buffer type, hybridmoe.backend.llamacpp.model.crash_risk): a plan
made for llama.cpp is then served by the engine, unless the planner chose llama.cpp because the
engine's own layout does not fit (``Plan.engine_misfit``), and a model only llama.cpp serves is
refused with the reason. An explicit `--backend llamacpp` is refused there with the same reason.

``auto`` also prefers llama.cpp when the plan says the engine would compute routed experts on a
slow path on the CPU (``Plan.engine_slow_path``: PyTorch dequantizing them on every call), and
says so through ``on_choice``; where llama.cpp cannot take the model, the engine serves it, and
``on_choice`` says that too.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hybridmoe.backend.errors import PlanError, UnsupportedModelError, UsageError
from hybridmoe.backend.models.inspect import InspectedModel
from hybridmoe.backend.plan.plan import Plan
from hybridmoe.backend.plan.workload import BACKENDS
from hybridmoe.backend.session import CancelToken, ProgressCallback, Session
from hybridmoe.backend.text.chat_template import TemplateFile

BACKEND_NAMES = {"engine": "the embedded engine", "llamacpp": "llama.cpp"}


def load_session(
    choice: str,
    model: InspectedModel | str | os.PathLike[str],
    plan: Plan,
    on_progress: ProgressCallback | None = None,
    cancel: CancelToken | None = None,
    on_fallback: Callable[[UnsupportedModelError], None] | None = None,
    on_choice: Callable[[str, str], None] | None = None,
    chat_template: TemplateFile | None = None,
) -> Session:
    """A session on the chosen backend. ``auto`` follows the plan's own choice when it names
    one (a plan made with `hybridmoe plan --backend llamacpp` stays on llama.cpp), and tells
    ``on_choice(backend, reason)`` so, since nothing on the command line said it. ``model`` is a
    path, or the InspectedModel the plan was made from: handed on, its files are not resolved
    or inspected again. ``chat_template``: a template file the session renders with instead of
    the model's own (``--chat-template FILE``)."""
    if choice not in BACKENDS:
        raise UsageError(f"unknown backend {choice!r}", f"Choose one of {', '.join(BACKENDS)}.")
    if choice == "auto" and plan.workload.backend != "auto":
        choice = plan.workload.backend
        reason = f"the plan was made for {BACKEND_NAMES[choice]}"
        if choice == "llamacpp" and (risk := _llamacpp_crash_risk()):
            if plan.gpu_expert_format == "stored" and plan.gpu_expert_count:
                # llama.cpp's layout (whole layers of experts, as stored) is not one the engine holds.
                raise PlanError(f"This plan is llama.cpp's layout (whole layers of experts on the GPUs, as stored), "
                                f"and {risk}.",
                                "Update llama-cpp-python (pip install -U llama-cpp-python), or plan for the engine "
                                "(hybridmoe plan --backend engine).")
            if plan.engine_misfit:
                raise PlanError(f"This model's layout fits only on llama.cpp here (the embedded engine's does not: "
                                f"{plan.engine_misfit}), and {risk}.",
                                "Update llama-cpp-python (pip install -U llama-cpp-python), or plan for the engine "
                                "with a shorter context or fewer GPU experts (hybridmoe plan --backend engine).")
            choice, reason = "engine", f"{reason}, but {risk}"
        if on_choice is not None:
            on_choice(choice, reason)
    if choice == "auto" and plan.engine_slow_path:
        choice, reason = _around_the_slow_path(plan)
        if on_choice is not None:
            on_choice(choice, reason)
    if plan.parallel == "tp" and choice == "llamacpp":  # asked for, or the plan's own choice
        raise UsageError("this plan shares the GPUs by tensor parallelism, which the llama.cpp backend does not run",
                         "Run it on the embedded engine (--backend engine), or plan with --parallel pp.")
    if choice == "engine":
        return _engine().load(model, plan, on_progress, cancel, chat_template=chat_template)
    if choice == "llamacpp":
        return _llamacpp().load(model, plan, on_progress, cancel, chat_template=chat_template)
    try:
        return _engine().load(model, plan, on_progress, cancel, chat_template=chat_template)
    except UnsupportedModelError as why:
        from hybridmoe.backend.llamacpp import LlamaCppUnavailable

        if plan.parallel == "tp":
            raise UnsupportedModelError(why.what, f"{why.hint or ''} The llama.cpp fallback does not run this "
                                        "tensor-parallel plan; plan with --parallel pp for it.".strip()) from why

        if risk := _llamacpp_crash_risk():
            raise UnsupportedModelError(why.what, f"{why.hint or ''} The llama.cpp fallback is not used: {risk}.".strip()) from why
        if on_fallback is not None:
            on_fallback(why)
        try:
            return _llamacpp().load(model, plan, on_progress, cancel, chat_template=chat_template)
        except LlamaCppUnavailable as missing:
            hint = f"{why.hint or ''} The llama.cpp fallback is not available: {missing}".strip()
            raise UnsupportedModelError(why.what, hint) from why


def _around_the_slow_path(plan: Plan) -> tuple[str, str]:
    """(backend, reason) for `auto` where the engine would take a slow path: llama.cpp, which
    reads every GGUF type in place, unless it cannot serve this plan on this machine."""
    from hybridmoe.backend.llamacpp import LlamaCppUnavailable
    from hybridmoe.backend.llamacpp.library import llama

    slow = f"on the embedded engine {plan.engine_slow_path}"
    if plan.parallel == "tp":
        return "engine", f"llama.cpp does not run this tensor-parallel plan, although {slow}"
    if risk := _llamacpp_crash_risk():
        return "engine", f"{risk}, although {slow}"
    try:
        llama()
    except LlamaCppUnavailable as missing:
        return "engine", f"{missing.what}, although {slow}"
    return "llamacpp", slow


def _llamacpp_crash_risk() -> str | None:
    from hybridmoe.backend.llamacpp import LlamaCppUnavailable, crash_risk

    try:
        return crash_risk()
    except LlamaCppUnavailable:
        return None  # not installed: the load says so, with the way to install it


def _engine():
    from hybridmoe.backend.engine.session import EngineBackend

    return EngineBackend()


def _llamacpp():
    from hybridmoe.backend.llamacpp import LlamaCppBackend

    return LlamaCppBackend()
