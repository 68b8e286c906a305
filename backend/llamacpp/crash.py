"""A last word when llama.cpp crashes the process.

llama.cpp runs inside our process; a segmentation fault in it (its AMX matmul on Sapphire
Rapids, llama.cpp issue 20824, was one) ends the process with exit status 139 and nothing on
stderr, in `hybridmoe run`, the server and the terminal UI alike. Once llama.cpp weights are
loaded, a handler for the fatal signals writes one message naming llama.cpp and what to do,
then hands the signal on: to the handler that was there before (Python's faulthandler, when
enabled, adds its stack dump), else to the default action, so the process still dies of the
signal (exit 128 + N in a shell, a core dump where enabled) and nothing runs on in a broken state.

Why a handler in this process rather than running llama.cpp in another one: it covers the
three front ends at once and costs nothing while all is well. Python's own `signal` module
cannot do this (its handlers run later, between bytecodes, which a faulting thread never reaches),
and faulthandler writes a fixed "Fatal Python error" text. So the handler is a C-callable
(ctypes) function; it only writes a prepared message and re-raises the signal. A crash in a
llama.cpp worker thread runs it on that thread, which takes the GIL first: the thread that
called into llama.cpp released it (ctypes releases it around foreign calls).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading

FATAL_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")

_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_int)
_lock = threading.Lock()
_installed: dict[int, int | None] = {}  # signal -> the handler it replaced (a C pointer)
_handler = None  # the ctypes callback; kept alive as long as it is installed


def message(signum: int) -> str:
    name = signal.Signals(signum).name
    description = signal.strsignal(signum) or name
    return (
        f"hybridmoe: error: llama.cpp crashed ({name}, {description.lower()}) and took hybridmoe down with it.\n"
        "  Serve the model with the embedded engine instead: `--backend engine` (in the app: the Layout step's "
        "backend), or update llama-cpp-python (pip install -U llama-cpp-python). `hybridmoe doctor` shows the "
        "llama.cpp build; please report the crash with its output.\n"
    )


def _prefix() -> bytes:
    # The terminal UI may own the screen: leave its alternate screen, show the cursor and stop
    # mouse reporting, so that the message stays readable after the process is gone.
    try:
        if os.isatty(2):
            return b"\x1b[?1000l\x1b[?1003l\x1b[?1006l\x1b[?25h\x1b[?1049l\r\n"
    except OSError:
        pass
    return b"\n"


def install() -> None:
    """Install the message for the fatal signals (once; POSIX only)."""
    global _handler
    if os.name != "posix":
        return
    with _lock:
        if _installed:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        messages = {getattr(signal, name): _prefix() + message(getattr(signal, name)).encode()
                    for name in FATAL_SIGNALS if hasattr(signal, name)}
        reraise = libc["raise"]
        reraise.argtypes = [ctypes.c_int]

        def on_fatal(signum: int) -> None:
            # Only what is safe at this point: write prepared bytes, put the previous handler
            # back and raise the signal again; it is delivered when this handler returns.
            os.write(2, messages.get(signum, b""))
            libc.signal(signum, _installed.get(signum))
            reraise(signum)

        _handler = _HANDLER_TYPE(on_fatal)
        address = ctypes.cast(_handler, ctypes.c_void_p).value
        for signum in messages:
            _installed[signum] = libc.signal(signum, address)
