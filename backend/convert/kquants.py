"""K-quants (Q4_K_M) through llama.cpp's own quantizer.

gguf-py can encode only the simple block types; the K-quant mixes need llama.cpp's
``llama_model_quantize``, which llama-cpp-python exposes through ctypes. It runs in a child
process: the call blocks in C for minutes with no way to interrupt it, and a child can be
stopped on cancel (and cannot take the app down with it if llama.cpp aborts). Progress is
the output file's growth against the estimated size.

Run as ``python -m backend.convert.kquants SRC DST FTYPE [--allow-requantize]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from backend.errors import HybridMoeError, UnsupportedModelError
from backend.session import CancelToken, Progress, ProgressCallback

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


def quantize(src: Path, dst: Path, mix: str, *, expected_bytes: int, allow_requantize: bool = False,
             on_progress: ProgressCallback | None = None, cancel: CancelToken | None = None,
             stage: str = "quantize") -> None:
    """Quantize the GGUF `src` into `dst` with llama.cpp's `mix` (e.g. "q4_k_m")."""
    if not available():
        raise UnsupportedModelError(
            f"--quant {mix} needs llama.cpp's quantizer, from llama-cpp-python, which is not installed.",
            "Install it (pip install llama-cpp-python), or choose --quant q4_0 or q8_0.",
        )
    cmd = [sys.executable, "-m", "backend.convert.kquants", str(src), str(dst), mix]
    if allow_requantize:
        cmd.append("--allow-requantize")
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


def _main(argv: list[str]) -> int:
    import llama_cpp

    src, dst, mix = argv[:3]
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[mix])
    params.nthread = os.cpu_count() or 1
    # Int4 experts copied from the checkpoint arrive as Q4_0; llama.cpp refuses to re-quantize
    # an already quantized tensor unless told to.
    params.allow_requantize = "--allow-requantize" in argv
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
