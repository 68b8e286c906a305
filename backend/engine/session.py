"""The embedded engine behind the Backend/Session protocol (backend/session.py).

EngineBackend.load() reads the model the Plan describes (weights through mmap, experts
placed per the Plan, a KV cache for the plan's conversations), EngineSession.generate()
turns messages into a stream of events: render the chat template, prefill in chunks (after
the longest prefix the cache holds), sample, detokenize without splitting characters, stop
on end tokens or stop strings. Up to ``max_parallel`` generations run at once from as many
threads, each decode step running all of them together (``batching``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from hybridmoe.backend.text.chat_template import ChatTemplate, TemplateFile
from hybridmoe.backend.engine.batching import Batcher
from hybridmoe.backend.engine.model import MoeTransformer, build_model
from hybridmoe.backend.engine.plan_layout import build_kwargs
from hybridmoe.backend.text.sampling import SamplingParams
from hybridmoe.backend.text.tokenizer import Tokenizer, load_tokenizer
from hybridmoe.backend.formats.weights import open_weights
from hybridmoe.backend.errors import ModelError, UsageError
from hybridmoe.backend.text.generation import (
    fitting_prompt_ids,
    Prefilled,
    host_peak_rss,
    max_new_tokens,
    raw_prompt_ids,
    stream,
)
from hybridmoe.backend.models import InspectedModel, inspected
from hybridmoe.backend.plan.plan import Plan
from hybridmoe.backend.session import (
    Cancelled,
    CancelToken,
    Done,
    Message,
    Progress,
    ProgressCallback,
    Stats,
    TextPiece,
)


class EngineBackend:
    name = "engine"

    def load(self, model: InspectedModel | str | Path, plan: Plan, on_progress: ProgressCallback | None = None,
             cancel: CancelToken | None = None, *, device: str | None = None,
             chat_template: TemplateFile | None = None) -> EngineSession:
        """``model``: a path, or the InspectedModel the caller planned with (then its files are
        not resolved or inspected again). ``chat_template``: rendered instead of the model's own."""
        model = inspected(model)
        if model.kind == "config":
            raise ModelError(f"{model.path} is a config.json without weights", "Download the model first (`hybridmoe pull`).")
        spec = model.spec
        if tuple(plan.moe_layers) != tuple(spec.moe_layers) or plan.n_routed_experts != spec.n_routed_experts:
            raise UsageError(
                f"the plan was made for {plan.model}, whose layers differ from {spec.name}",
                f"Make a plan for this model: `hybridmoe plan {model.path} --save FILE`.",
            )
        if plan.workload.context > spec.max_context:
            raise UsageError(f"the plan's context ({plan.workload.context}) exceeds {spec.name}'s {spec.max_context} tokens")

        def progress(done: int, total: int) -> None:
            if cancel is not None:
                cancel.raise_if_cancelled("loading the model")
            if on_progress is not None:
                on_progress(Progress("load", done, total, unit="layers", message=f"building layer {done} of {total}"))

        weights = open_weights(model.load_path)
        # A GGUF's vocabulary is read from the mapping the weights were just opened on, not by
        # parsing the header again.
        tokenizer = load_tokenizer(model.path, gguf_metadata=weights.metadata if model.kind == "gguf" else None)
        net = build_model(
            spec.config,
            weights,
            device=device,
            max_context=plan.workload.context,
            sequences=plan.workload.users,
            name=spec.name,
            on_progress=progress,
            **build_kwargs(plan, device),
        )
        return EngineSession(net, tokenizer, ChatTemplate.for_tokenizer(tokenizer, chat_template), plan, model.path)


class EngineSession:
    def __init__(self, model: MoeTransformer, tokenizer: Tokenizer, template: ChatTemplate, plan: Plan, path: Path):
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.plan = plan
        self.path = path
        self.context = plan.workload.context
        # Generations at once: the conversations the plan sized the KV cache for.
        self.backend, self.counts_experts = "engine", True
        self.max_parallel = model.max_sequences
        self.decode_path = model.decode_plan().summary()
        self.batcher = Batcher(model, chunk=plan.workload.prefill_chunk, slots=self.max_parallel)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        text = self.template.render([{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True)
        return fitting_prompt_ids(self.tokenizer, text, self.context)

    def generate(self, messages: Sequence[Message], sampling: SamplingParams,
                 cancel: CancelToken | None = None) -> Iterator[TextPiece | Done]:
        yield from self._generate(self.prompt_ids(messages), self.template.stop_strings, sampling, cancel)

    def complete(self, prompt: str, sampling: SamplingParams,
                 cancel: CancelToken | None = None) -> Iterator[TextPiece | Done]:
        """The continuation of ``prompt`` taken as it is, without the chat template."""
        yield from self._generate(raw_prompt_ids(self.tokenizer, prompt, self.context), (), sampling, cancel)

    def _generate(self, ids: list[int], stop_strings: Sequence[str], sampling: SamplingParams,
                  cancel: CancelToken | None) -> Iterator[TextPiece | Done]:
        max_new = max_new_tokens(len(ids), self.context, sampling)
        started = time.perf_counter()
        try:
            generation = self.batcher.start(ids, cancel)
        except Cancelled:  # while it waited for a slot: nothing was generated
            yield Done("cancelled", "", (), Stats(len(ids), 0, None, None, None, backend="engine"))
            return
        try:
            logits, computed = generation.prefill(cancel)
            prefilled = Prefilled(ids, logits, computed, started, time.perf_counter() - started)
            for event in stream(
                prefilled,
                sampling,
                detokenizer=self.tokenizer.detokenizer(),
                stop_strings=stop_strings,
                is_stop=self.tokenizer.stop_ids.__contains__,
                forward=generation.decode,
                max_new=max_new,
                cancel=cancel,
                backend="engine",
                expert_share=self.model.stats.main_share,
                peak_memory=lambda: peak_memory(self.model.device),
                model=str(self.path),
            ):
                if isinstance(event, Done):
                    # Its slot frees now, not when the caller next asks for an event (the
                    # others' steps no longer wait for a token it will not hand in).
                    generation.finish()
                yield event
        finally:
            generation.finish()

    def save_expert_stats(self, path) -> None:
        self.model.stats.save(path)

    def close(self) -> None:
        if self.model is None:
            return
        self.batcher.close()
        if self.model.scheduler is not None:
            self.model.scheduler.close()  # its CPU-expert and copier threads
        self.model = None


def peak_memory(device: torch.device) -> dict[str, int]:
    peaks = {"host": host_peak_rss()}
    if device.type == "cuda":
        peaks[str(device)] = torch.cuda.max_memory_allocated(device)
    return peaks
