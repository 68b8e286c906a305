"""llama.cpp behind the Backend/Session protocol (backend/session.py), mirroring the engine.

LlamaCppBackend.load() checks the Plan against the GGUF, turns it into llama.cpp parameters
(expert overrides included) and loads the model through llama.h's low-level API;
LlamaCppSession.generate() renders the chat template (our sandboxed ChatTemplate, the same as
the engine's, on the template the GGUF carries), prefills in n_batch chunks after the cached
prefix of the previous turn, samples, streams text, stops on end-of-generation tokens or stop
strings, and reports statistics, exactly as backend/engine/session.py does.

Why the low-level API rather than ``llama_cpp.Llama``: ``Llama(...)`` builds its own
llama_model_params and silently drops keywords it does not know, so there is no way to hand
it ``tensor_buft_overrides`` (expert placement, the point of this backend); it also adds its
own sampling, caching and chat formatting that the protocol defines differently. Loading with
our own params, ``llama_init_from_model``, ``llama_batch`` + ``llama_decode`` and
``llama_get_logits_ith`` is about as much code and leaves nothing implicit.

Sampling uses the engine's ``Sampler`` on llama.cpp's logits rather than llama.cpp's sampler
chain: the knobs then mean the same thing on both backends (transformers' order, repetition
penalty over the whole context), a seed reproduces a generation, and greedy is exactly argmax,
so the two backends can be compared token for token.

Statistics are timed here, with the engine's definitions (prefill: computed prompt tokens over
the prefill's wall time; decode: tokens after the first over the time since the first), so the
numbers of the two backends compare; llama_perf_context would exclude sampling and detokenizing.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from hybridmoe.backend.text.chat_template import ChatTemplate, TemplateFile
from hybridmoe.backend.text.sampling import SamplingParams
from hybridmoe.backend.errors import ModelError, UnsupportedModelError
from hybridmoe.backend.text.generation import (
    fitting_prompt_ids,
    Prefilled,
    common_prefix,
    host_peak_rss,
    max_new_tokens,
    raw_prompt_ids,
    stream,
)
from hybridmoe.backend.llamacpp import log
from hybridmoe.backend.llamacpp.header import GGUFHeader, read_header
from hybridmoe.backend.llamacpp.library import ggml, llama
from hybridmoe.backend.llamacpp.model import load_model
from hybridmoe.backend.llamacpp.params import build as build_params
from hybridmoe.backend.llamacpp.placement import (
    OverrideArray,
    PlacementReport,
    check_plan,
    overrides_from_plan,
)
from hybridmoe.backend.llamacpp.vocab import Vocab
from hybridmoe.backend.plan.plan import Plan
from hybridmoe.backend.session import (
    Cancelled,
    CancelToken,
    Done,
    Message,
    Progress,
    ProgressCallback,
    TextPiece,
)

# llama_decode's return codes
_DECODE_NO_SLOT, _DECODE_ABORTED = 1, 2


class LlamaCppBackend:
    name = "llamacpp"

    def load(self, model_path, plan: Plan, on_progress: ProgressCallback | None = None,
             cancel: CancelToken | None = None, *, chat_template: TemplateFile | None = None) -> LlamaCppSession:
        """``chat_template``: rendered instead of the model's own (``--chat-template FILE``)."""
        b = llama()
        header = read_header(model_path)
        check_plan(plan, header)
        buffer_types = ggml().buffer_types()
        overrides = OverrideArray(overrides_from_plan(plan.llama_cpp or {}, header, buffer_types), buffer_types)

        def progress(fraction: float) -> bool:  # False aborts the load
            if cancel is not None and cancel.cancelled:
                return False
            if on_progress is not None:
                on_progress(Progress("load", round(fraction * 100), 100, unit="%", message="loading tensors"))
            return True

        guarded = _Guarded(progress)
        params = build_params(b, plan, overrides, guarded)
        with log.capture() as captured:
            model = load_model(header.path, params.model)
        if not model:
            if guarded.error is not None:
                raise guarded.error
            if cancel is not None and cancel.cancelled:
                raise Cancelled("loading the model was cancelled")
            raise load_error(header, captured)
        ctx = None
        try:
            with log.capture() as ctx_log:
                ctx = b.llama_init_from_model(model, params.context)
            if not ctx:
                reason = ctx_log.failure() or "llama.cpp gave no reason"
                raise ModelError(
                    f"llama.cpp loaded {header.path.name} but could not create its context: {reason}",
                    "Lower the context (`--context`), use f16 cache types, or make a plan for this machine.",
                )
            report = PlacementReport.from_log(captured, header)
            return LlamaCppSession(b, model, ctx, params, header, plan, report, chat_template)
        except BaseException:  # no session owns the model and context
            if ctx:
                b.llama_free(ctx)
            b.llama_model_free(model)
            raise


def load_error(header: GGUFHeader, captured: log.Capture) -> ModelError:
    """llama.cpp's logged reason for a failed load, as one message with a way out."""
    reason = captured.failure() or "llama.cpp gave no reason"
    name = header.path.name
    if "unknown model architecture" in reason:
        return UnsupportedModelError(
            f"{name}: this llama.cpp build does not know the architecture {header.architecture!r} ({reason})",
            "Update llama-cpp-python (pip install -U llama-cpp-python), or use a model of a supported architecture.",
        )
    if "invalid ggml type" in reason or "unsupported" in reason.lower():
        return UnsupportedModelError(
            f"{name}: this llama.cpp build cannot read the file: {reason}",
            "Update llama-cpp-python (pip install -U llama-cpp-python), or use another quantization of the model.",
        )
    if "out of memory" in reason.lower() or "failed to allocate" in reason.lower():
        return ModelError(
            f"{name} does not fit where the plan puts it: {reason}",
            "Make a plan for this machine (`hybridmoe plan MODEL --backend llamacpp`), or move more experts to the CPU.",
        )
    if "corrupted" in reason or "file bounds" in reason or "truncated" in reason:
        return ModelError(f"{name} is damaged or incomplete: {reason}", "Download the file again.")
    return ModelError(f"llama.cpp could not load {name}: {reason}", "See the log (logger 'hybridmoe.llamacpp') for details.")


class LlamaCppSession:
    # Generations at once: one llama.cpp context holding one sequence's cache (seq 0), so a
    # second generation must wait for the first (the server's queue sees to it).
    max_parallel = 1
    decode_path = "decode: llama.cpp's own graph"
    backend = "llamacpp"
    # llama.cpp does not report which experts a token chose.
    counts_experts = False

    def __init__(self, bindings, model, ctx, params, header: GGUFHeader, plan: Plan, placement: PlacementReport,
                 chat_template: TemplateFile | None = None):
        self._b = bindings
        self.model = model
        self.ctx = ctx
        self.params = params  # holds the override array and callbacks for the model's lifetime
        self.header = header
        self.plan = plan
        self.path = Path(header.path)
        self.placement = placement
        self.vocab = Vocab(bindings, model, header.values)
        templates = header.chat_templates()
        origin = f"{header.path} (tokenizer.chat_template)"
        self.template = ChatTemplate(
            templates.get("default"),
            origin=origin,
            special_tokens=self.vocab.special_tokens,
            tool_use_source=templates.get("tool_use"),
            tool_use_origin=f"{header.path} (tokenizer.chat_template.tool_use)",
            replacement=chat_template,
        )
        self.context = bindings.llama_n_ctx(ctx)
        self.chunk = bindings.llama_n_batch(ctx)
        self._cached: list[int] = []  # the token ids whose keys/values the cache holds
        # The token the abort callback consults; a one-element list, so that the callback
        # does not hold the session itself (which would delay freeing it to the cycle collector).
        self._cancel: list[CancelToken | None] = [None]
        box = self._cancel
        self._abort = bindings.ggml_abort_callback(lambda _data: bool(box[0] is not None and box[0].cancelled))
        # From here on the session owns the model, the context and the batch.
        self._batch = bindings.llama_batch_init(self.chunk, 0, 1)
        self._finalizer = weakref.finalize(self, _free, bindings, model, ctx, self._batch)

    # -- the protocol --------------------------------------------------------------------------

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        text = self.template.render([{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True)
        return fitting_prompt_ids(self.vocab, text, self.context)

    def generate(self, messages: Sequence[Message], sampling: SamplingParams,
                 cancel: CancelToken | None = None) -> Iterator[TextPiece | Done]:
        self._check_open()
        yield from self._generate(self.prompt_ids(messages), self.template.stop_strings, sampling, cancel)

    def complete(self, prompt: str, sampling: SamplingParams,
                 cancel: CancelToken | None = None) -> Iterator[TextPiece | Done]:
        """The continuation of ``prompt`` taken as it is, without the chat template."""
        self._check_open()
        yield from self._generate(raw_prompt_ids(self.vocab, prompt, self.context), (), sampling, cancel)

    def _check_open(self) -> None:
        if self.ctx is None:
            raise ModelError("this llama.cpp session is closed", "Load the model again.")

    def _generate(self, ids: list[int], stop_strings: Sequence[str], sampling: SamplingParams,
                  cancel: CancelToken | None) -> Iterator[TextPiece | Done]:
        max_new = max_new_tokens(len(ids), self.context, sampling)
        started = time.perf_counter()
        logits, computed = self._prefill(ids, cancel)
        prefilled = Prefilled(ids, logits, computed, started, time.perf_counter() - started)
        yield from stream(
            prefilled,
            sampling,
            detokenizer=self.vocab.detokenizer(),
            stop_strings=stop_strings,
            is_stop=self.vocab.is_stop,
            forward=lambda token: self._decode([token], len(self._cached)),
            max_new=max_new,
            cancel=cancel,
            backend="llamacpp",
            expert_share=self.placement.main_device_share,
            peak_memory=peak_memory,
            model=str(self.path),
        )

    def close(self) -> None:
        self._finalizer()
        self.ctx = self.model = None
        self._cached = []

    # -- llama.cpp calls ---------------------------------------------------------------------

    def _prefill(self, ids: list[int], cancel: CancelToken | None) -> tuple[torch.Tensor | None, int]:
        """Feed the prompt after the prefix the cache already holds, in n_batch chunks.
        Returns the last logits (None when cancelled) and how many tokens were computed."""
        start = min(common_prefix(self._cached, ids), len(ids) - 1)  # at least one token must run to give logits
        memory = self._b.llama_get_memory(self.ctx)
        if not self._b.llama_memory_seq_rm(memory, 0, start, -1):
            # A sliding-window cache cannot drop a suffix of what it holds: start over.
            self._b.llama_memory_clear(memory, True)
            start = 0
        self._cached = self._cached[:start]
        # llama.cpp checks the abort callback between graph nodes on the CPU, so Esc stops
        # a long prompt within a node rather than after a whole n_batch chunk.
        self._cancel[0] = cancel
        self._b.llama_set_abort_callback(self.ctx, self._abort, None)
        try:
            logits = None
            for pos in range(start, len(ids), self.chunk):
                if cancel is not None and cancel.cancelled:
                    return None, len(self._cached) - start
                logits = self._decode(ids[pos : pos + self.chunk], pos)
                if logits is None:
                    return None, len(self._cached) - start
            return logits, len(ids) - start
        finally:
            self._b.llama_set_abort_callback(self.ctx, self._b.ggml_abort_callback(), None)
            self._cancel[0] = None

    def _decode(self, tokens: list[int], start: int) -> torch.Tensor | None:
        """Run ``tokens`` at positions start.. and return the last token's logits (None when
        the abort callback stopped it)."""
        batch = self._batch
        n = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == n - 1  # logits for the last token only
        batch.n_tokens = n
        rc = self._b.llama_decode(self.ctx, batch)
        if rc == _DECODE_ABORTED:
            # Finished micro-batches stay in the cache; drop them so it holds exactly _cached.
            self._b.llama_memory_seq_rm(self._b.llama_get_memory(self.ctx), 0, start, -1)
            return None
        if rc == _DECODE_NO_SLOT:
            raise ModelError(f"llama.cpp's cache has no room for {n} more tokens after {start}",
                             "Plan a longer context (`hybridmoe plan --context N`).")
        if rc != 0:
            raise ModelError(f"llama.cpp failed to evaluate {n} tokens (llama_decode returned {rc})",
                             "See the log (logger 'hybridmoe.llamacpp') for details.")
        self._cached = self._cached[:start] + tokens
        ptr = self._b.llama_get_logits_ith(self.ctx, -1)
        # A copy: the buffer belongs to llama.cpp and is overwritten by the next decode.
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.vocab.n_tokens,)).copy())


class _Guarded:
    """A progress callback for C, which must not raise into ctypes (ctypes would print the
    traceback and carry on): an exception in the handler aborts the load and is re-raised
    once llama.cpp has returned."""

    def __init__(self, fn):
        self.fn = fn
        self.error: BaseException | None = None

    def __call__(self, fraction: float) -> bool:
        if self.error is not None:
            return False
        try:
            return self.fn(fraction)
        except BaseException as exc:  # noqa: BLE001 - see above
            self.error = exc
            return False


def _free(bindings, model, ctx, batch) -> None:
    bindings.llama_batch_free(batch)
    if ctx:
        bindings.llama_free(ctx)
    if model:
        bindings.llama_model_free(model)


def peak_memory() -> dict[str, int]:
    # GPU memory is not included: ggml reports only a device's current free memory, not
    # this process's peak.
    return {"host": host_peak_rss()}
