"""Choosing the next token from logits, and cutting the text at stop strings.

``Sampler`` follows Hugging Face transformers' semantics and order, so a generation here can
be checked against ``model.generate`` with the same settings:

1. repetition penalty (CTRL, as ``RepetitionPenaltyLogitsProcessor``): every distinct token id
   in ``previous_ids`` (the caller passes the whole context so far, prompt included, as
   transformers does; llama.cpp instead looks at the last ``penalty_last_n`` = 64 tokens, which
   a caller gets by passing only those) has its logit divided by the penalty when positive and
   multiplied by it when negative;
2. temperature 0 means greedy: argmax of the penalised logits;
3. temperature, then top-k, top-p, min-p, each on the result of the one before (transformers'
   order; llama.cpp applies temperature last, which changes what top-p and min-p see);
4. a draw from the remaining distribution with the sampler's own ``torch.Generator``, so a seed
   reproduces a generation regardless of what else uses torch's global RNG.

``StopStringMatcher`` holds back streamed text that could be the start of a stop string.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmoe.backend.errors import UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None  # None = a fresh random seed (Sampler.seed tells which)
    max_tokens: int | None = None  # None = until a stop token or the context is full
    stop: tuple[str, ...] = field(default=())  # a list is accepted and stored as a tuple
    # Generate through end-of-turn tokens until max_tokens (benchmarks need a fixed length;
    # llama.cpp's server and vLLM call it the same).
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        problems = []
        if not self.temperature >= 0:  # also catches NaN
            problems.append(f"temperature must be >= 0 (got {self.temperature})")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be a whole number >= 0 (got {self.top_k})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be in [0, 1] (got {self.min_p})")
        if not self.repetition_penalty > 0:
            problems.append(f"repetition_penalty must be > 0 (got {self.repetition_penalty})")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            problems.append(f"max_tokens must be a whole number >= 1 (got {self.max_tokens})")
        if self.seed is not None and not isinstance(self.seed, int):
            problems.append(f"seed must be a whole number (got {self.seed!r})")
        if any(not isinstance(s, str) or not s for s in stop):
            problems.append("stop strings must be non-empty strings")
        if problems:
            raise UsageError("invalid sampling settings: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any], **overrides: Any) -> SamplingParams:
        """The model's recommended settings (generation_config.json), then ``overrides``.

        ``do_sample: false`` means greedy. Settings the file leaves out stay off rather than
        taking transformers' implicit top_k=50. Overrides that are None are ignored, so options
        a user left unset keep the model's values.
        """
        values: dict[str, Any] = {}
        if config.get("do_sample") is False:
            values["temperature"] = 0.0
        else:
            for key in ("temperature", "top_k", "top_p", "min_p"):
                if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool):
                    values[key] = config[key]
        if isinstance(config.get("repetition_penalty"), (int, float)):
            values["repetition_penalty"] = float(config["repetition_penalty"])
        if "top_k" in values:
            values["top_k"] = int(values["top_k"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.seed: int = params.seed if params.seed is not None else secrets.randbits(63)
        self._generators: dict[torch.device, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor = ()) -> int:
        """The next token id for ``logits`` (shape [vocab], or [1, vocab])."""
        if self.params.greedy:
            # Unpenalised, the logits as they are: no float32 copy of the whole vocabulary.
            x = self._penalised(logits, previous_ids) if self._penalises(previous_ids) else _vector(logits)
            return _argmax(x)
        values, indices = self._candidates(self._penalised(logits, previous_ids))
        probs = torch.softmax(values, dim=-1)
        choice = torch.multinomial(probs, 1, generator=self._generator(probs.device))
        return int(indices[choice])

    def adjusted_logits(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor = ()) -> torch.Tensor:
        """The float32 logits ``sample`` draws from, with filtered tokens at -inf (greedy:
        the penalised logits). For inspection and tests; ``sample`` does not build this."""
        x = self._penalised(logits, previous_ids)
        if self.params.greedy:
            return x
        values, indices = self._candidates(x)
        out = torch.full_like(x, float("-inf"))
        out[indices] = values
        return out

    def probabilities(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor = ()) -> torch.Tensor:
        """The distribution ``sample`` draws from (greedy: one-hot on the argmax)."""
        x = self.adjusted_logits(logits, previous_ids)
        if self.params.greedy:
            return torch.nn.functional.one_hot(torch.argmax(x), x.numel()).to(torch.float32)
        return torch.softmax(x, dim=-1)

    # -- steps ----------------------------------------------------------------------------------

    def _penalises(self, previous_ids: Sequence[int] | torch.Tensor) -> bool:
        return self.params.repetition_penalty != 1.0 and len(previous_ids) > 0

    def _penalised(self, logits: torch.Tensor, previous_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        x = _vector(logits).to(torch.float32, copy=True)
        penalty = self.params.repetition_penalty
        if self._penalises(previous_ids):
            ids = torch.as_tensor(previous_ids, dtype=torch.long, device=x.device).flatten().unique()
            ids = ids[(ids >= 0) & (ids < x.numel())]  # ids past the logits (padding rows) carry no score
            scores = x[ids]
            x[ids] = torch.where(scores < 0, scores * penalty, scores / penalty)
        return x

    def _candidates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Surviving (logit, token id) pairs after temperature, top-k, top-p and min-p.

        Works on the survivors of top-k only (a few dozen instead of the whole vocabulary),
        which gives the same distribution as transformers' full-width masks because masked
        tokens have zero probability there.
        """
        p = self.params
        x = x / p.temperature
        if 0 < p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            indices = torch.nonzero(x >= kth).flatten()  # ties with the k-th survive, as in transformers
            values = x[indices]
        else:
            indices = torch.arange(x.numel(), device=x.device)
            values = x
        keep = torch.ones_like(values, dtype=torch.bool)
        if p.top_p < 1.0:
            # transformers' TopPLogitsWarper: sort ascending, drop the low tail whose cumulative
            # probability is <= 1 - top_p, always keep the most likely token.
            sorted_values, order = torch.sort(values, descending=False)
            cumulative = torch.softmax(sorted_values, dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= (1 - p.top_p)
            drop_sorted[-1] = False
            keep &= ~drop_sorted.scatter(0, order, drop_sorted)
        if p.min_p > 0.0:
            masked = values.masked_fill(~keep, float("-inf"))
            probs = torch.softmax(masked, dim=-1)
            threshold = p.min_p * probs.max()
            drop = probs < threshold
            drop[torch.argmax(masked)] = False
            keep &= ~drop
        return values[keep], indices[keep]

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen


def _argmax(x: torch.Tensor) -> int:
    """torch.argmax's index (the first maximum; NaN counts as the maximum), through NumPy for
    float32 on the CPU: half the time of torch's dispatch on caches a decode step has just
    streamed its weights through (0.05 against 0.11 ms a token, the 16k-vocabulary benchmark
    model on a 2-core Zen 5), which is every greedy token of `hybridmoe run`."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return int(x.numpy().argmax())
    return int(torch.argmax(x))


def _vector(logits: torch.Tensor) -> torch.Tensor:
    """[vocab] from [vocab] or [1, vocab]."""
    if logits.dim() == 2 and logits.shape[0] == 1:
        logits = logits[0]
    if logits.dim() != 1:
        raise ValueError(f"expected logits of shape [vocab], got {tuple(logits.shape)}")
    return logits


class StopStringMatcher:
    """Cuts streamed text at the first stop string.

    ``feed`` returns the text that can safely be shown: anything that could still be the start
    of a stop string is held back until later text decides. When a stop string appears,
    ``stopped`` becomes true, ``matched`` names it, and neither it nor anything after it is
    ever returned. ``flush`` returns what is held back once the stream ends without a stop.
    """

    def __init__(self, stop: Iterable[str]):
        self.stop: tuple[str, ...] = tuple(s for s in stop if s)
        self.stopped = False
        self.matched: str | None = None
        self._held = ""

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        if not self.stop:
            self._held = ""
            return text
        first = None
        for s in self.stop:
            at = text.find(s)
            if at >= 0 and (first is None or at < first[0] or (at == first[0] and len(s) > len(first[1]))):
                first = (at, s)
        if first is not None:
            self.stopped, self.matched, self._held = True, first[1], ""
            return text[: first[0]]
        hold = self._partial_suffix(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest end of ``text`` that is a proper start of some stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
