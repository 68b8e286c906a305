"""The token loop both backends share: sample, stop, detokenize, stream events, measure.

A backend prefills the prompt its own way, then hands this loop the last logits and a
`forward(token) -> logits` step; everything a user sees (which token ends a turn, how stop
strings cut, what the statistics mean) is then the same whichever backend runs.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from hybridmoe.backend.text.sampling import Sampler, SamplingParams, StopStringMatcher
from hybridmoe.backend.errors import DamagedModelError, PromptTooLongError, UsageError
from hybridmoe.backend.session import CancelToken, Done, Stats, TextPiece


_TOO_LONG_HINT = "Shorten the conversation, or plan a longer context (`hybridmoe plan --context N`)."


def max_new_tokens(prompt_tokens: int, context: int, sampling: SamplingParams) -> int:
    """Tokens that may be generated after the prompt: max_tokens, capped by the context."""
    if prompt_tokens >= context:
        raise PromptTooLongError(f"the prompt is {prompt_tokens} tokens, the context holds {context}", _TOO_LONG_HINT,
                                 prompt_tokens=prompt_tokens, context=context)
    budget = context - prompt_tokens
    return min(sampling.max_tokens, budget) if sampling.max_tokens else budget


@dataclass(frozen=True)
class Prefilled:
    """What the backend's prefill produced: the prompt, its last logits (None: cancelled),
    how many tokens it computed and when it started and took."""

    ids: Sequence[int]
    logits: torch.Tensor | None
    computed: int
    started: float
    seconds: float


def stream(
    prefilled: Prefilled,
    sampling: SamplingParams,
    *,
    detokenizer,
    stop_strings: Sequence[str],
    is_stop: Callable[[int], bool],
    forward: Callable[[int], torch.Tensor | None],
    max_new: int,
    cancel: CancelToken | None,
    backend: str,
    expert_share: Callable[[], float | None],
    peak_memory: Callable[[], dict[str, int]],
    model: str = "the model",
) -> Iterator[TextPiece | Done]:
    """forward(token) runs one token at the next position and returns its logits [vocab]
    (None when the backend aborted on cancel). Logits that are not all finite end the
    generation with a DamagedModelError naming `model`: sampled, they would be an error of
    the sampler's or, greedy, an arbitrary token (NaN compares false: argmax takes the first)."""
    sampler = Sampler(sampling)
    stops = StopStringMatcher([*sampling.stop, *stop_strings])
    context_ids = list(prefilled.ids)
    logits = prefilled.logits
    generated: list[int] = []
    text: list[str] = []
    reason = "length"
    first_token_at = None
    while True:
        if logits is None or (cancel is not None and cancel.cancelled):
            reason = "cancelled"
            break
        check_finite(logits, model, position=len(context_ids))
        token = sampler.sample(logits, context_ids)
        if first_token_at is None:
            first_token_at = time.perf_counter()
        if is_stop(token) and not sampling.ignore_eos:
            reason = "stop"
            break
        generated.append(token)
        context_ids.append(token)
        piece = stops.feed(detokenizer.feed(token))
        if piece:
            text.append(piece)
            yield TextPiece(piece, (token,))
        if stops.stopped:
            reason = "stop"
            break
        if len(generated) >= max_new:
            break
        logits = forward(token)
    if not stops.stopped:
        tail = stops.feed(detokenizer.flush()) + stops.flush()
        if tail:
            text.append(tail)
            yield TextPiece(tail, ())
    decode_tokens = max(len(generated) - 1, 0)
    decode_s = time.perf_counter() - first_token_at if first_token_at else 0.0
    stats = Stats(
        prompt_tokens=len(prefilled.ids),
        generated_tokens=len(generated),
        time_to_first_token_s=(first_token_at - prefilled.started) if first_token_at else None,
        prefill_tokens_per_s=(
            prefilled.computed / prefilled.seconds
            if prefilled.computed and prefilled.logits is not None and prefilled.seconds > 0 else None
        ),
        decode_tokens_per_s=decode_tokens / decode_s if decode_tokens and decode_s > 0 else None,
        main_device_expert_share=expert_share(),
        peak_memory_bytes=peak_memory(),
        backend=backend,
    )
    yield Done(reason, "".join(text), tuple(generated), stats)


def check_finite(logits: torch.Tensor, model: str, position: int) -> None:
    """Raise DamagedModelError when `logits` hold a NaN or an infinity."""
    if not bool(torch.isfinite(logits).all()):
        raise DamagedModelError(
            f"{model} computed logits that are not numbers (NaN or infinity) at position {position}: "
            "its weights are damaged",
            f"Download or convert the model again; `hybridmoe inspect {model} --check` names the tensors "
            "holding such values.")


def fitting_prompt_ids(tokenizer, text: str, context: int) -> list[int]:
    """``tokenizer.encode_prompt(text)``, refused before tokenizing when the text's length
    alone shows it cannot fit the context: a prompt of megabytes would otherwise be tokenized
    whole (seconds, and memory for millions of ids) only to be refused."""
    at_least = tokenizer.min_tokens(text)
    if at_least >= context:
        raise PromptTooLongError(
            f"the prompt is at least {at_least:,} tokens ({len(text):,} characters), the context holds {context}",
            _TOO_LONG_HINT, prompt_tokens=at_least, context=context, at_least=True,
        )
    return tokenizer.encode_prompt(text)


def raw_prompt_ids(tokenizer, prompt: str, context: int) -> list[int]:
    """Ids of a prompt taken as it is (no chat template), with the model's BOS as a rendered
    chat prompt would have it; special tokens written in the text are recognised."""
    ids = fitting_prompt_ids(tokenizer, prompt, context)
    if not ids:  # nothing to continue from: no logits to sample the first token from
        raise UsageError("the prompt is empty", "Give some text to continue.")
    return ids


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the shared start of two token lists: what a backend's cache can keep."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def host_peak_rss() -> int:
    """This process's peak resident memory in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
