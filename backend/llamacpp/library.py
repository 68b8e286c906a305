"""The llama.cpp shared libraries, as llama-cpp-python ships them.

``llama_cpp.llama_cpp`` binds llama.h through ctypes. What the backend needs beyond llama.h
lives in ggml (the CPU buffer type for tensor overrides, the backend/device registry for
``doctor`` and for buffer-type names such as "CUDA0"). Those are declared here once, against
the libraries llama-cpp-python already loaded, so both sides share one copy of ggml's global
state (a second copy would have its own CPU buffer type, which llama.cpp would not recognise
as the CPU).
"""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from hybridmoe.backend.errors import HybridMoeError

INSTALL_HINT = (
    "Install it with `pip install llama-cpp-python`; for GPU offload build it with the GPU "
    "backend, e.g. CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall --no-cache-dir "
    "llama-cpp-python (see the README, \"llama.cpp backend\")."
)

# ggml_backend_dev_type
DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL"}

class LlamaCppUnavailable(HybridMoeError):
    """llama-cpp-python is missing or its libraries cannot be loaded."""


_init_lock = threading.Lock()
_initialised = False


def llama() -> ModuleType:
    """``llama_cpp.llama_cpp`` (the ctypes bindings of llama.h), with the backend initialised
    and log output routed through hybridmoe.backend.llamacpp.log."""
    global _initialised
    try:
        import llama_cpp.llama_cpp as bindings
    except (ImportError, OSError, RuntimeError) as exc:  # missing package, or a library that will not load
        raise LlamaCppUnavailable(f"the llama.cpp backend is not available: {exc}", INSTALL_HINT) from exc
    with _init_lock:
        if not _initialised:
            from hybridmoe.backend.llamacpp import log

            log.install(bindings)
            bindings.llama_backend_init()
            _load_dynamic_backends()
            _initialised = True
    return bindings


def _symbol(name: str, restype, argtypes):
    """A ggml function, looked up through libllama first (on Linux and macOS dlsym searches
    its dependencies, so this is the very ggml llama.cpp uses), then in libggml-base and
    libggml next to it (Windows resolves symbols per DLL)."""
    for lib in _libraries():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            continue
        fn.restype, fn.argtypes = restype, argtypes
        return fn
    raise LlamaCppUnavailable(
        f"the installed llama-cpp-python has no {name}() in its libraries",
        "Install llama-cpp-python 0.3.16 or newer.",
    )


@lru_cache(maxsize=1)
def _libraries() -> tuple[ctypes.CDLL, ...]:
    import llama_cpp.llama_cpp as bindings
    from llama_cpp._ctypes_extensions import load_shared_library

    libs = [bindings._lib]
    for base in ("ggml-base", "ggml"):
        try:
            libs.append(load_shared_library(base, Path(bindings._base_path)))
        except (FileNotFoundError, RuntimeError):
            pass  # statically linked into libllama: the first lookup finds everything
    return tuple(libs)


class Ggml:
    """The ggml functions the backend calls, declared on first use."""

    def __init__(self):
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        self.cpu_buffer_type = _symbol("ggml_backend_cpu_buffer_type", vp, [])
        self.buft_name = _symbol("ggml_backend_buft_name", cp, [vp])
        self.reg_count = _symbol("ggml_backend_reg_count", sz, [])
        self.reg_get = _symbol("ggml_backend_reg_get", vp, [sz])
        self.reg_name = _symbol("ggml_backend_reg_name", cp, [vp])
        self.dev_count = _symbol("ggml_backend_dev_count", sz, [])
        self.dev_get = _symbol("ggml_backend_dev_get", vp, [sz])
        self.dev_name = _symbol("ggml_backend_dev_name", cp, [vp])
        self.dev_description = _symbol("ggml_backend_dev_description", cp, [vp])
        self.dev_type = _symbol("ggml_backend_dev_type", ctypes.c_int, [vp])
        self.dev_buffer_type = _symbol("ggml_backend_dev_buffer_type", vp, [vp])
        self.dev_memory = _symbol("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])

    def devices(self) -> list[dict]:
        """Every device ggml registered: name, description, kind, its buffer type's name and
        handle, and memory (free, total) as the device reports it."""
        out = []
        for i in range(self.dev_count()):
            dev = self.dev_get(i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            self.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            buft = self.dev_buffer_type(dev)
            out.append({
                "name": _text(self.dev_name(dev)),
                "description": _text(self.dev_description(dev)),
                "type": DEVICE_TYPES.get(self.dev_type(dev), "unknown"),
                "buffer_type": _text(self.buft_name(buft)) if buft else "",
                "buffer_type_handle": buft,
                "memory_free_bytes": free.value,
                "memory_total_bytes": total.value,
            })
        return out

    def registry(self) -> list[str]:
        """Names of the compute backends compiled into (or loaded by) this build."""
        return [_text(self.reg_name(self.reg_get(i))) for i in range(self.reg_count())]

    def buffer_types(self) -> dict[str, int]:
        """Buffer type name -> handle, as llama.cpp's `-ot PATTERN=NAME` resolves names: the
        CPU buffer type, then each device's default buffer type ("CUDA0", "Vulkan1", ...)."""
        types = {"CPU": self.cpu_buffer_type()}
        for dev in self.devices():
            if dev["buffer_type_handle"] and dev["buffer_type"] not in types:
                types[dev["buffer_type"]] = dev["buffer_type_handle"]
        return types


@lru_cache(maxsize=1)
def ggml() -> Ggml:
    llama()  # initialise the backend (and its log routing) before the first ggml call
    return Ggml()


def _load_dynamic_backends() -> None:
    """Builds with GGML_BACKEND_DL=ON keep each compute backend in its own library, loaded at
    run time; llama-cpp-python does not load them, so a CUDA build would see no GPU. Static
    builds (the default) have them registered already and skip this."""
    count = _symbol("ggml_backend_reg_count", ctypes.c_size_t, [])
    if count() > 0:
        return
    try:
        load_all = _symbol("ggml_backend_load_all_from_path", None, [ctypes.c_char_p])
    except LlamaCppUnavailable:
        return
    import llama_cpp.llama_cpp as bindings

    load_all(str(bindings._base_path).encode())


def _text(value: bytes | None) -> str:
    return value.decode("utf-8", errors="replace") if value else ""
