"""The llama.cpp fallback backend (llama-cpp-python): the Backend/Session protocol of
backend/session.py, obeying the same Plan as the embedded engine, expert placement included.

    LlamaCppBackend().load(model_path, plan, on_progress, cancel) -> LlamaCppSession
    system_info() -> dict      what the installed llama.cpp build has (for `hybridmoe doctor`)

Modules, one concept each: library (the shared libraries and the ggml/gguf functions
llama-cpp-python does not bind), log (llama.cpp's log, captured), header (the GGUF's metadata
and tensor names), placement (the Plan's expert layout as tensor buffer-type overrides),
params (the rest of the Plan as llama.cpp parameters), vocab (tokenizing and streaming text),
model (the one way in: loading weights, kept off the AMX buffer type where it crashes; raw
evaluation for tests and benchmarks), crash (a last word if llama.cpp crashes the process),
session (loading and generating), capabilities (what the build can do).
"""

from __future__ import annotations

import importlib

# Imported on first use: `hybridmoe doctor` asks for system_info without paying for torch.
_EXPORTS = {
    "LlamaCppBackend": "hybridmoe.backend.llamacpp.session",
    "LlamaCppSession": "hybridmoe.backend.llamacpp.session",
    "LlamaCppUnavailable": "hybridmoe.backend.llamacpp.library",
    "RawModel": "hybridmoe.backend.llamacpp.model",
    "crash_risk": "hybridmoe.backend.llamacpp.model",
    "system_info": "hybridmoe.backend.llamacpp.capabilities",
    "system_summary": "hybridmoe.backend.llamacpp.capabilities",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    return getattr(module, "summary" if name == "system_summary" else name)
