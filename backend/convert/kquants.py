"""K-quants (Q4_K_M) through llama.cpp's own quantizer.

gguf-py can encode only the simple block types; the K-quant mixes need llama.cpp's
``llama_model_quantize``, which llama-cpp-python exposes through ctypes. It runs in a child
process: the call blocks in C for minutes with no way to interrupt it, and a child can be
stopped on cancel (and cannot take the app down with it if llama.cpp aborts). Progress is
the output file's growth against the estimated size.

Tensors the converter copied exactly from the checkpoint (Kimi's int4 as Q4_0, GPT-OSS's
MXFP4) are passed as tensor-type overrides naming their present type: llama.cpp then leaves
them as they are (a tensor already in its target type is copied), where its Q4_K_M mix would
re-quantize them onto the K-quant grid. Requantizing stays disabled, so a quantized tensor
that is not named makes the quantizer fail rather than silently lose precision.

Run as ``python -m hybridmoe.backend.convert.kquants SRC DST FTYPE [--keep TYPE=REGEX ...]``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hybridmoe.backend.errors import HybridMoeError, UnsupportedModelError
from hybridmoe.backend.session import CancelToken, Progress, ProgressCallback

# llama.cpp's llama_ftype values for the mixes offered.
FTYPES = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}

# Average bits per weight of a Q4_K_M file's quantized tensors (Q4_K with some Q6_K), for the
# size estimate that disk checks and progress use.
Q4_K_M_BITS = 4.9


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken build fails in ctypes with various errors
        return False
    return True


def quantize(src: Path, dst: Path, mix: str, *, expected_bytes: int, keep: dict[str, Any] | None = None,
             on_progress: ProgressCallback | None = None, cancel: CancelToken | None = None,
             stage: str = "quantize") -> None:
    """Quantize the GGUF `src` into `dst` with llama.cpp's `mix` (e.g. "q4_k_m"); `keep` maps
    tensor names to the GGML type (gguf.GGMLQuantizationType) they are already in and keep."""
    if not available():
        raise UnsupportedModelError(
            f"--quant {mix} needs llama.cpp's quantizer, from llama-cpp-python, which is not installed.",
            "Install it (pip install llama-cpp-python), or choose --quant q4_0 or q8_0.",
        )
    cmd = [sys.executable, "-m", "hybridmoe.backend.convert.kquants", str(src), str(dst), mix]
    by_type: dict[int, list[str]] = {}
    for name, qtype in (keep or {}).items():
        by_type.setdefault(int(qtype), []).append(name)
    for qtype, names in sorted(by_type.items()):
        # One anchored alternation of the exact names per type (llama.cpp matches with
        # std::regex_search, so anchors keep blk.1 from matching blk.11).
        cmd += ["--keep", f"{qtype}=^(?:{'|'.join(re.escape(n) for n in sorted(names))})$"]
    with tempfile.TemporaryFile() as log:
        # Its own session: a terminal's Ctrl-C reaches only us, and we stop the child
        # through `cancel` (terminating it), rather than it dying mid-write with an error.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                if cancel is not None and cancel.cancelled:
                    _stop(proc)
                    cancel.raise_if_cancelled("The quantization")
                if on_progress is not None:
                    done = dst.stat().st_size if dst.exists() else 0
                    on_progress(Progress(stage, min(done, expected_bytes), expected_bytes, "B", mix))
                time.sleep(0.2)
        except BaseException:
            _stop(proc)
            raise
        if cancel is not None:  # a signal to the whole process group stops the child first
            cancel.raise_if_cancelled("The quantization")
        if proc.returncode != 0:
            log.seek(0)
            tail = log.read()[-2000:].decode("utf-8", "replace").strip()
            raise HybridMoeError(
                f"llama.cpp's quantizer failed on {src.name} (exit code {proc.returncode}):\n{tail}",
                "Try --quant q8_0 or q4_0, which hybridmoe encodes itself.",
            )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tensor_type_overrides(llama_cpp, keep: list[tuple[int, str]]):
    """llama.cpp's array of tensor-type overrides for `keep`'s (ggml type, name pattern) pairs, for
    ``llama_model_quantize_params.tt_overrides`` (ctypes.cast to its pointer type; the array must
    outlive the call)."""
    # A null-pattern entry ends the array, as llama.cpp expects.
    overrides = (llama_cpp.llama_model_tensor_override * (len(keep) + 1))()
    for i, (qtype, pattern) in enumerate(keep):
        overrides[i].pattern = pattern.encode()
        overrides[i].type = int(qtype)
    overrides[len(keep)].pattern = None
    return overrides


def _main(argv: list[str]) -> int:
    import ctypes

    import llama_cpp

    src, dst, mix = argv[:3]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[mix])
    params.nthread = os.cpu_count() or 1
    keep = [argv[i + 1].split("=", 1) for i in range(3, len(argv) - 1) if argv[i] == "--keep"]
    if keep:
        overrides = tensor_type_overrides(llama_cpp, [(int(qtype), pattern) for qtype, pattern in keep])
        params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
