"""Continuous batching: the conversations in progress advance together, one step at a time.

Each generation runs in its caller's thread (a server request's worker, the TUI's chat
worker) and keeps the token loop every backend shares (``generation.stream``: sampling,
stop strings, detokenizing, cancel). What changes is how a forward pass runs: a generation
hands its next token to the ``Batcher`` and waits; the batcher's thread takes every token
handed in and runs them as one step (``MoeTransformer.forward_batch``), which reads the
dense weights once for all of them and the routed experts once over the union of their
choices. A step runs when every generation in its decode phase has handed in its token, or
a moment (``_GRACE_S``) after the first did, so a slow consumer delays the others by at most
that.

A new generation's prompt runs in slices beside the others' decode tokens: each step carries
up to the plan's prefill chunk of prompt tokens, first come first (several short prompts in
one call), so a long prompt stalls the others for one chunk at a time, never for all of it.
Prompt rows run as a call of their own, not as rows of the decode call: decode rows take the
kernels' few-token paths and prompt rows their many-token paths, each at any count
(``native_kernels.rows_are``), so a row's numbers never depend on which rows share its call.
Every generation gets exactly the tokens it gets alone, and a prompt computes the same
however it was sliced. The prompt's last token always runs as a decode row, as it does alone
(``EngineSession``'s cached-prompt rule).

Conversations' caches: when a generation ends, its sequence stays in the cache, idle, with
the token ids it holds. A new prompt starts from the sequence that shares the longest prefix
with it: an idle one it extends (the conversation's next turn, a regenerated answer) is taken
over; otherwise (a common system prompt, a conversation in progress) the prefix's blocks are
shared. When blocks run out, the least recently used idle sequence is evicted; its
conversation is recomputed if it returns.

Locks, always taken in this order: ``_cache`` (held while a step runs and while sequences are
placed or released: the block tables and pools are only touched under it), then ``_lock``
(the queues and the idle list, held briefly).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq

import torch

from hybridmoe.backend.engine.kv_cache import Sequence
from hybridmoe.backend.engine.streams import close_at_exit
from hybridmoe.backend.errors import ModelUnloadedError
from hybridmoe.backend.session import Cancelled, CancelToken
from hybridmoe.backend.text.generation import common_prefix

# How long a step waits for generations that have not handed in their next token since the
# last step gave them their logits (or since another handed in its token): at least this, and
# a quarter of a step, so that the generations' threads can sample, detokenize and stream
# their tokens in turn (they share the interpreter) before the next step leaves one behind,
# which would then run alone, one step in two.
_GRACE_S = 0.005
_GRACE_OF_STEP = 0.25
# An idle sequence whose tokens a new prompt shares but for at most this many at its end is
# taken over rather than shared: the prompt is that conversation's next turn (its last answer
# tokenized again may differ in a few tokens at the end, and its end-of-turn markers).
# Otherwise its cache stays for its own conversation, and the prefix is shared.
_TAKE_OVER_TAIL = 16
# How often waiting callers look at their cancel token.
_POLL_S = 0.05


class Generation:
    """One generation's place in the batcher: its sequence and its handed-in work."""

    def __init__(self, batcher: Batcher, ids: Seq[int]):
        self.batcher = batcher
        self.ids = list(ids)
        self.seq: Sequence | None = None
        self.reused = 0  # prompt positions the cache already held when it started
        self.position = 0  # where its next token goes (a taken-over sequence may hold more)
        self.decoding = False  # in its decode phase: steps wait for its token
        self._prompt_cancel: CancelToken | None = None
        self._ready = threading.Event()
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None

    # ---- what the token loop calls -------------------------------------------------------

    def prefill(self, cancel: CancelToken | None) -> tuple[torch.Tensor | None, int]:
        """The prompt after what the cache held (the batcher runs it in slices, beside other
        generations' tokens), then its last token as a decode row. Returns its last logits
        (None: cancelled) and how many tokens were computed."""
        last = len(self.ids) - 1
        if self.reused < last:
            self._prompt_cancel = cancel
            self._wait(lambda: self.batcher._hand_in_prompt(self))
        if cancel is not None and cancel.cancelled:
            return None, self.position - self.reused
        return self.decode(self.ids[last]), len(self.ids) - self.reused

    def decode(self, token: int) -> torch.Tensor:
        """Run `token` at the next position in the next step; its logits [V]."""
        self.decoding = True
        logits = self._wait(lambda: self.batcher._hand_in_token(self, token))
        self.position += 1
        return logits

    def finish(self) -> None:
        self.batcher._finish(self)

    # ---- the batcher's side ---------------------------------------------------------------

    def _wait(self, hand_in) -> torch.Tensor:
        self._ready.clear()
        hand_in()
        self._ready.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result

    def _deliver(self, result: torch.Tensor | None = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._ready.set()


class Batcher:
    """The step loop of one model: up to ``slots`` generations at once (the conversations the
    KV cache is sized for); more wait for a slot, first come first served."""

    def __init__(self, model, *, chunk: int, slots: int):
        self.model = model
        self.chunk = max(1, chunk)
        self.slots = slots
        self._cache = threading.Lock()
        self._lock = threading.Condition()
        self._active: list[Generation] = []
        self._waiting: deque[Generation] = deque()
        self._idle: OrderedDict[Sequence, None] = OrderedDict()  # least recently used first
        self._tokens: dict[Generation, int] = {}  # decode tokens handed in for the next step
        self._first_token_at: float | None = None
        self._last_step_at = 0.0  # when the last step's results were handed out
        self._step_s = 0.0  # how long the last decode step took
        self._last_prompt_at = 0.0  # when the last prompt was handed in
        self._prompts: deque[Generation] = deque()  # prompts being prefilled, first come first
        self._thread: threading.Thread | None = None
        self._closed = False
        self.steps = 0  # decode steps run, and the rows they carried (for the statistics)
        self.rows = 0
        model.cache.on_full = self._evict
        # Stopped before the interpreter tears down: its thread must never be inside a native
        # call then (a daemon thread ended there aborts the process).
        close_at_exit(self)

    # ---- generations ----------------------------------------------------------------------

    def start(self, ids: Seq[int], cancel: CancelToken | None = None) -> Generation:
        """A generation for prompt `ids` once a slot is free, placed in the cache after the
        longest prefix it holds. Raises Cancelled when `cancel` is set while waiting."""
        g = Generation(self, ids)
        with self._lock:
            self._check_open()
            self._waiting.append(g)
            try:
                while self._waiting[0] is not g or len(self._active) >= self.slots:
                    if cancel is not None and cancel.cancelled:
                        raise Cancelled("waiting for the model was cancelled")
                    self._check_open()
                    self._lock.wait(_POLL_S)
            finally:
                self._waiting.remove(g)
                self._lock.notify_all()
            self._active.append(g)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hybridmoe-batcher", daemon=True)
                self._thread.start()
        try:
            with self._cache, self._lock:
                self._place(g)
        except BaseException:
            self._finish(g)
            raise
        return g

    def _place(self, g: Generation) -> None:
        """Start g from the sequence sharing the longest prefix with its prompt (at least its
        last token is computed: it gives the logits)."""
        cache = self.model.cache
        best, length = None, 0
        candidates = [*self._idle, *(other.seq for other in self._active if other.seq is not None)]
        for seq in candidates:
            n = common_prefix(seq.tokens, g.ids)
            if n > length:
                best, length = seq, n
        length = min(length, len(g.ids) - 1)
        seq = None
        if best is not None and length > 0:
            if best in self._idle and length >= best.filled - _TAKE_OVER_TAIL and cache.reaches(best, length):
                del self._idle[best]  # the conversation's next turn: it continues in place
                seq = best
            else:
                seq = cache.fork(best, length)
        if seq is None:
            seq, length = cache.new_sequence(), 0
        g.seq, g.reused, g.position = seq, length, length

    def _finish(self, g: Generation) -> None:
        """g ends: its slot frees, its sequence stays cached (idle) for a later prompt."""
        with self._cache, self._lock:
            if g in self._active:
                self._active.remove(g)
            self._tokens.pop(g, None)
            if g in self._prompts:  # left while its prompt waited (an error in its thread)
                self._prompts.remove(g)
            seq, g.seq = g.seq, None
            if seq is not None:
                if seq.filled:
                    self._idle[seq] = None
                else:
                    self.model.cache.drop(seq)
            self._lock.notify_all()

    def _evict(self) -> bool:
        """Free the least recently used idle sequence's blocks (the cache is full)."""
        with self._lock:
            if not self._idle:
                return False
            seq, _ = self._idle.popitem(last=False)
        self.model.cache.drop(seq)
        return True

    def idle_sequences(self) -> int:
        with self._lock:
            return len(self._idle)

    def forget(self) -> None:
        """Drop every idle conversation's cache (the next prompts are computed in full)."""
        with self._cache, self._lock:
            for seq in self._idle:
                self.model.cache.drop(seq)
            self._idle.clear()

    def close(self, timeout: float | None = 10.0) -> None:
        """Refuse new work, fail what waits, and wait for a running step to end (at the
        model's next layer: it is unloaded)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            thread = self._thread
        self.model.unload()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise ModelUnloadedError()

    # ---- handing in work ------------------------------------------------------------------

    def _hand_in_token(self, g: Generation, token: int) -> None:
        with self._lock:
            self._check_open()
            if not self._tokens:
                self._first_token_at = time.monotonic()
            self._tokens[g] = token
            self._lock.notify_all()

    def _hand_in_prompt(self, g: Generation) -> None:
        with self._lock:
            self._check_open()
            self._prompts.append(g)
            self._last_prompt_at = time.monotonic()
            self._lock.notify_all()

    # ---- the step loop --------------------------------------------------------------------

    def _due(self) -> float | None:
        """0 when a step should run now, else how long to wait (None: until woken)."""
        if self._prompts and not self._tokens:
            # Requests that arrive together are prefilled together: wait a moment for more.
            return max(0.0, self._last_prompt_at + _GRACE_S - time.monotonic())
        if not self._tokens:
            return None
        if all(g in self._tokens for g in self._active if g.decoding and g.seq is not None):
            return 0.0
        # The others had their results when the last step ended (or before this token came).
        since = max(self._first_token_at, self._last_step_at)
        grace = max(_GRACE_S, _GRACE_OF_STEP * self._step_s)
        return max(0.0, since + grace - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (due := self._due()) != 0.0:
                    if due is None and not self._active:
                        # Nobody generates: the thread ends (``start`` begins another), so an
                        # idle session holds no thread and nothing keeps the model alive.
                        self._thread = None
                        return
                    self._lock.wait(due if due is not None else _POLL_S)
                if self._closed:
                    for g in [*self._tokens, *self._prompts]:
                        g._deliver(error=ModelUnloadedError())
                    return
                tokens, self._tokens = list(self._tokens.items()), {}
                slices = self._prompt_slices()
            with self._cache:
                if tokens:
                    self._decode_step(tokens)
                if slices:
                    self._prompt_step(slices)
            with self._lock:
                self._last_step_at = time.monotonic()

    def _decode_step(self, tokens: list[tuple[Generation, int]]) -> None:
        started = time.monotonic()
        try:
            logits = self.model.forward_batch([(g.seq, [token], g.position) for g, token in tokens])
            self._step_s = time.monotonic() - started
        except Exception as error:  # every generation of the step learns why it failed
            for g, _ in tokens:
                g._deliver(error=error)
            return
        self.steps += 1
        self.rows += len(tokens)
        for (g, _), row in zip(tokens, logits):
            g._deliver(row)

    def _prompt_slices(self) -> list[tuple[Generation, list[int], int]]:
        """The prompt rows of the next step: up to ``chunk`` tokens (the plan's prefill size,
        which its activation reserve is sized for), first come first, several prompts in one
        call when they are short. A cancelled prompt leaves the queue."""
        slices, budget = [], self.chunk
        for g in list(self._prompts):
            if g._prompt_cancel is not None and g._prompt_cancel.cancelled:
                self._prompts.remove(g)
                g._deliver()
                continue
            if not budget:
                break
            end = min(len(g.ids) - 1, g.position + budget)
            slices.append((g, g.ids[g.position : end], g.position))
            budget -= end - g.position
        return slices

    def _prompt_step(self, slices: list[tuple[Generation, list[int], int]]) -> None:
        # A slice of a large model runs for seconds: when every prompt in it is cancelled (Esc,
        # Ctrl-C, a closed connection), it ends at its next layer, not at its end.
        cancels = [g._prompt_cancel for g, _, _ in slices]
        stop = None if None in cancels else (lambda: all(c.cancelled for c in cancels))
        try:
            self.model.forward_batch([(g.seq, ids, start) for g, ids, start in slices], prompt=True, stop=stop)
        except Exception as error:
            with self._lock:
                for g, _, _ in slices:
                    self._prompts.remove(g)
            stopped = isinstance(error, Cancelled)  # then each prefill sees its cancel
            for g, _, _ in slices:
                g._deliver(error=None if stopped else error)
            return
        done = []
        with self._lock:
            for g, ids, start in slices:
                g.position = start + len(ids)
                if g.position == len(g.ids) - 1:
                    self._prompts.remove(g)
                    done.append(g)
        for g in done:
            g._deliver()
