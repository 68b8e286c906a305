"""Opening a GGUF with llama.cpp: ``load_model`` is the one function through which the app, its
tests and its benchmarks load llama.cpp weights (tests/llamacpp/test_loading.py fails on any
other way in).

Why one function: on CPUs with AMX (Sapphire Rapids and later Xeons) llama.cpp stores the CPU's
2-D quantized weights in its AMX buffer type, whose matmul (``ggml_backend_amx_mul_mat``)
segfaults on the first batch of more than one token (llama.cpp issue 20824, open without a
fix). On such a CPU the weights are kept off it with ``use_extra_bufts = False``, llama.cpp's
`--no-repack`. That also turns off CPU_REPACK, the interleaved layout that speeds up Q4_0,
Q4_K, IQ4_NL and Q8_0 on the CPU, and keeping that while dropping AMX alone was weighed and
refused: llama.cpp has no switch for AMX alone, AMX comes first in its list of CPU buffer types
(an override to "CPU" picks it again), and an override naming CPU_REPACK is taken without
llama.cpp's support check, so a tensor the repacker cannot handle (a type or row count this
build does not interleave) would dereference a null layout while loading: one crash traded for
another, unless ggml's per-ISA, per-version repack rules were copied here. Correctness first;
the fallback is a fallback, and the embedded engine serves these CPUs at full speed.

Loading also installs a last word for fatal signals (``hybridmoe.backend.llamacpp.crash``): if llama.cpp
crashes anyway, the user reads that it did and what to do instead of a bare exit 139.

``RawModel`` is the model opened for raw evaluation (token ids in, logits out), as the tests'
comparisons and the benchmark need it; the app's sessions use hybridmoe.backend.llamacpp.session.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from hybridmoe.backend.llamacpp.library import LlamaCppUnavailable, llama

# /proc/cpuinfo flags of CPUs on which llama.cpp builds its AMX buffer type.
AMX_FEATURES = ("amx_int8", "amx_tile")
CRASH_ISSUE = "llama.cpp issue 20824"


class LlamaCppUnsafe(LlamaCppUnavailable):
    """llama.cpp would crash on this machine and the installed build cannot be told to avoid it."""


@lru_cache(maxsize=1)
def _cpu_features() -> tuple[str, ...]:
    from hybridmoe.backend.hardware.cpu import detect_cpu

    return detect_cpu()[0].features  # never raises: unknown facts come back empty


def cpu_has_amx(features: Iterable[str]) -> bool:
    return any(f in AMX_FEATURES for f in features)


def _can_keep_off_amx(params_type: type) -> bool:
    return any(name == "use_extra_bufts" for name, *_ in params_type._fields_)


def crash_risk(features: Iterable[str] | None = None, params_type: type | None = None) -> str | None:
    """Why llama.cpp is known to crash on this machine (None: it is not): an AMX CPU with a
    llama-cpp-python too old to keep the weights off the AMX buffer type."""
    if not cpu_has_amx(_cpu_features() if features is None else features):
        return None
    if params_type is None:
        params_type = llama().llama_model_params
    if _can_keep_off_amx(params_type):
        return None
    return (f"llama.cpp's AMX matmul crashes on this CPU ({CRASH_ISSUE}) and the installed llama-cpp-python "
            "is too old to keep the weights off it")


def safe_params(params: Any, features: Iterable[str] | None = None) -> Any:
    """``params`` (llama_model_params) with the weights kept off llama.cpp's AMX buffer type
    when the CPU has AMX; unchanged otherwise. Raises LlamaCppUnsafe where that cannot be done."""
    features = _cpu_features() if features is None else tuple(features)
    if not cpu_has_amx(features):
        return params
    if not _can_keep_off_amx(type(params)):
        raise LlamaCppUnsafe(
            f"{crash_risk(features, type(params))}",
            "Update llama-cpp-python (pip install -U llama-cpp-python), or use the embedded engine (--backend engine).",
        )
    params.use_extra_bufts = False
    return params


def load_model(path: str | Path, params: Any | None = None):
    """``llama_model_load_from_file`` on ``path`` with ``params`` (llama.cpp's defaults when
    None) made safe for this CPU. Returns the model pointer, NULL when llama.cpp could not
    load the file (its reason is in its log, hybridmoe.backend.llamacpp.log)."""
    from hybridmoe.backend.llamacpp import crash

    bindings = llama()
    params = safe_params(bindings.llama_model_default_params() if params is None else params)
    crash.install()
    return bindings.llama_model_load_from_file(str(path).encode(), params)


class RawModel:
    """A GGUF opened for raw evaluation: ``eval`` runs token ids and returns their logits.
    No chat template, no sampling, one sequence. ``vocab_only`` opens the vocabulary alone
    (``tokenize``), without weights or a context. ``n_seq_max`` > 1 makes room in the context
    for that many sequences (``n_ctx`` / ``n_seq_max`` tokens each), for a caller that drives
    ``ctx`` with batches of several sequences itself (``eval`` uses sequence 0). ``params``
    (backend/llamacpp/params.build's LlamaParams: GPU layers, tensor overrides, flash attention)
    replaces llama.cpp's defaults and the context arguments above."""

    def __init__(self, path: str | Path, *, n_ctx: int = 512, n_batch: int = 512, n_ubatch: int = 512,
                 n_threads: int = 1, logits_all: bool = False, vocab_only: bool = False, n_seq_max: int = 1,
                 params: Any | None = None):
        from hybridmoe.backend.errors import ModelError

        b = self._b = llama()
        # llama.cpp keeps pointers into the parameters (the override array) while the model lives.
        self._params = params
        model_params = b.llama_model_default_params() if params is None else params.model
        model_params.vocab_only = vocab_only
        self.model = load_model(path, model_params)
        if not self.model:
            raise ModelError(f"llama.cpp could not load {path}", "See the log (logger 'hybridmoe.llamacpp') for details.")
        self.vocab = b.llama_model_get_vocab(self.model)
        self.ctx = self._batch = None
        self.logits_all = logits_all
        self._rows: list[np.ndarray] = []  # logits of the evaluated tokens (the last only, without logits_all)
        self.n_tokens = 0
        if vocab_only:
            return
        if params is not None:
            cp = params.context
        else:
            cp = b.llama_context_default_params()
            cp.n_ctx = n_ctx
            cp.n_batch = min(n_batch, n_ctx)
            cp.n_ubatch = min(n_ubatch, cp.n_batch)
            cp.n_threads = cp.n_threads_batch = n_threads
            cp.n_seq_max = n_seq_max
            # llama-cpp-python's Llama, which these comparisons were written against, turns it off.
            cp.flash_attn_type = b.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = b.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self.close()
            raise ModelError(f"llama.cpp loaded {path} but could not create a context of {cp.n_ctx} tokens")
        self.n_batch = cp.n_batch
        self._batch = b.llama_batch_init(self.n_batch, 0, 1)

    def n_vocab(self) -> int:
        return self._b.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: bytes, add_bos: bool = False, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos`` adds what the vocabulary adds (BOS), ``special``
        parses special tokens written in the text."""
        capacity = len(text) + 8
        out = (self._b.llama_token * capacity)()
        n = self._b.llama_tokenize(self.vocab, text, len(text), out, capacity, add_bos, special)
        if n < 0:  # too small: llama.cpp says how many it needs
            capacity = -n
            out = (self._b.llama_token * capacity)()
            n = self._b.llama_tokenize(self.vocab, text, len(text), out, capacity, add_bos, special)
        return list(out[:n])

    def reset(self) -> None:
        self._b.llama_memory_clear(self._b.llama_get_memory(self.ctx), True)
        self._rows, self.n_tokens = [], 0

    def rewind(self, n_tokens: int) -> None:
        """Forget every token after the first ``n_tokens`` (their cache entries too): the next
        ``eval`` continues from position ``n_tokens``."""
        if not 0 <= n_tokens <= self.n_tokens:
            raise ValueError(f"cannot rewind to {n_tokens} tokens: {self.n_tokens} are evaluated")
        self._b.llama_memory_seq_rm(self._b.llama_get_memory(self.ctx), 0, n_tokens, -1)
        self.n_tokens = n_tokens
        self._rows = self._rows[:n_tokens] if self.logits_all else []

    def eval(self, ids: Sequence[int]) -> np.ndarray:
        """Run ``ids`` after the tokens already evaluated; their logits, one row per token
        (the last token's only without ``logits_all``)."""
        from hybridmoe.backend.errors import ModelError

        b, batch, vocab = self._b, self._batch, self.n_vocab()
        rows = []
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            last_chunk = start + self.n_batch >= len(ids)
            for i, token in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = self.n_tokens + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = self.logits_all or (last_chunk and i == len(chunk) - 1)
            batch.n_tokens = len(chunk)
            rc = b.llama_decode(self.ctx, batch)
            if rc != 0:
                raise ModelError(f"llama.cpp failed to evaluate {len(chunk)} tokens (llama_decode returned {rc})")
            wanted = range(len(chunk)) if self.logits_all else ([len(chunk) - 1] if last_chunk else [])
            for i in wanted:
                ptr = b.llama_get_logits_ith(self.ctx, i)
                rows.append(np.ctypeslib.as_array(ptr, shape=(vocab,)).copy())  # llama.cpp reuses the buffer
            self.n_tokens += len(chunk)
        self._rows.extend(rows)
        return np.stack(rows) if rows else np.zeros((0, vocab), np.float32)

    @property
    def scores(self) -> np.ndarray:
        """The logits of every token evaluated since ``reset`` (with ``logits_all``)."""
        return np.stack(self._rows)

    def close(self) -> None:
        if self._batch is not None:
            self._b.llama_batch_free(self._batch)
        if self.ctx:
            self._b.llama_free(self.ctx)
        if self.model:
            self._b.llama_model_free(self.model)
        self._batch = self.ctx = self.model = None

    def __enter__(self) -> RawModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
