"""What the error dialog says about an exception.

A ``HybridMoeError`` is the user's to act on: its ``what`` and ``hint``, as the CLI prints
them. ``Cancelled`` is not an error at all (a notification says it). Anything else is a bug:
one line in the dialog, the traceback in the log file the CLI uses too.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from datetime import datetime

from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.session import Cancelled


@dataclass(frozen=True)
class ErrorReport:
    title: str
    message: str
    hint: str = ""
    cancelled: bool = False


def report_for(error: BaseException) -> ErrorReport:
    if isinstance(error, Cancelled):
        return ErrorReport("Cancelled", error.what, error.hint or "", cancelled=True)
    if isinstance(error, HybridMoeError):
        return ErrorReport("Error", error.what, error.hint or "")
    where = log_internal_error(error)
    return ErrorReport(
        "Internal error",
        f"{type(error).__name__}: {error}",
        f"This is a bug in hybridmoe. The details are in {where}; please report it.",
    )


def log_internal_error(error: BaseException) -> str:
    from hybridmoe.backend.settings import state_dir

    try:
        log_dir = state_dir()
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "errors.log"
        with open(path, "a") as f:
            f.write(f"--- {datetime.now().isoformat()} terminal UI\n")
            f.write("".join(traceback.format_exception(error)) + "\n")
        return str(path)
    except OSError:
        return "(the log could not be written)"
