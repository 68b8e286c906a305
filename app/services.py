"""The backend verbs the terminal UI calls, gathered in one object the App receives.

This is the seam for tests: the App never imports a backend verb directly, it calls
``hybridmoe.app.services.<verb>``. ``Services`` is the real implementation; tests pass a subclass that
fakes the model boundary (a backend whose session streams scripted text, a downloader that
reports progress without a network) and keeps everything else real: settings files, the
planner, the catalogue, the SQLite history.

Every method may block (disk, network, model loading) and is called from worker threads,
never from the UI thread, except the few documented as fast.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridmoe.backend import settings as settings_module
from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.hardware.profile import HardwareProfile
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.plan import ExpertStats, Plan, Workload
from hybridmoe.backend.session import CancelToken, ProgressCallback, Session
from hybridmoe.backend.settings import Settings

log = logging.getLogger(__name__)

BANDWIDTH_UNKNOWN = "memory.bandwidth_measured_bytes_per_s"


class _Turns:
    """Model work in this process (loading a model, an answer, a benchmark) and the memory
    bandwidth probe take turns. A probe beside an answer would measure a machine busy with
    the model, and it runs on the thread pool that computes the model's CPU experts; it
    must never change that pool (or torch's) under a running model either.

    The answers of a session that decodes several conversations together share the turn
    (``shared``): they run beside each other, never beside exclusive work. An exclusive
    turn that waits goes before shared turns asked for after it, so that a steady stream of
    requests cannot keep a benchmark waiting for ever; the shared holders it waits for need
    nothing from it to end, so neither can wait on the other for good.

    One per process, not per Services: the machine is one, whoever asks."""

    def __init__(self):
        self.changed = threading.Condition()
        self.exclusive = False
        self.shared = 0  # holders of a shared turn
        self.exclusive_waiting = 0
        self.holder = ""  # what holds the turn, for "waiting for ..." messages

    def take(self, what: str, shared: bool) -> str:
        """Takes the turn and returns "", or returns what holds it (untaken)."""
        with self.changed:
            if self.exclusive or (self.shared and not shared) or (shared and self.exclusive_waiting):
                return self.holder or "other work"
            if shared:
                self.shared += 1
            else:
                self.exclusive = True
            self.holder = self.holder or what
            return ""

    def give_back(self, shared: bool) -> None:
        with self.changed:
            if shared:
                self.shared -= 1
            else:
                self.exclusive = False
            if not self.exclusive and not self.shared:
                self.holder = ""
            self.changed.notify_all()


_TURNS = _Turns()
_WAIT_POLL_S = 0.05  # how often a waiting turn looks at its cancel token


class Services:
    """The real backend. Subclass and override to fake part of it."""

    # ---- settings and where things live (fast: called on the UI thread) ------------------------

    def load_settings(self) -> Settings:
        """The settings to use; never fails on a bad file (``read_settings`` says what is wrong)."""
        return settings_module.load()

    def read_settings(self) -> settings_module.LoadedSettings:
        """The settings and the problems of the settings file, for the App to show once."""
        return settings_module.read()

    def save_settings(self, settings: Settings) -> None:
        settings.save()

    def data_dir(self) -> Path:
        return settings_module.data_dir()

    def plan_path(self, model_path: str | Path) -> Path:
        """Where the saved plan of a model lives: one TOML per model path in the data dir."""
        # Absolute but symlinks kept: a GGUF in the Hugging Face cache is a symlink to a blob
        # whose name says nothing.
        key = os.path.abspath(Path(model_path).expanduser())
        return self.data_dir() / "plans" / f"{_slug(key)}.toml"

    def converted_dir(self) -> Path:
        """Where conversions are written; registered as a model directory so they are listed."""
        return self.data_dir() / "models"

    # ---- hardware, models, catalogue ---------------------------------------------------------

    def remember_rates(self, plan, stats) -> None:
        """After an answer: keep the engine's decode read rate and prompt rate for this machine
        (CPU-only plans; later plans expect them, docs/sizing.md §6)."""
        from hybridmoe.backend.plan.expected import remember_rates

        remember_rates(plan, stats)

    def detect_hardware(self, measure_bandwidth: bool, *, wait: bool = False,
                        on_wait: Callable[[str], None] | None = None) -> HardwareProfile:
        """This machine. The bandwidth probe takes its turn with model work: while a model
        loads, answers or is benchmarked, it is skipped (the profile says why), or with
        ``wait`` it waits for that work to end (``on_wait`` hears what it waits for). The probe
        runs once per process (every plan then shows the same speed); ``wait``, which the
        Hardware screen's Ctrl+D asks for, takes a new reading."""
        from hybridmoe.backend.hardware import detect

        store = self.load_settings().model_store_path
        if not measure_bandwidth:
            return detect(measure_bandwidth=False, model_dir=store)
        with self.model_turn("measuring the memory bandwidth", wait=wait, on_wait=on_wait) as busy_with:
            if busy_with:
                profile = detect(measure_bandwidth=False, model_dir=store)
                why = (f"not measured: the model was busy ({busy_with}); "
                       "Ctrl+D on the Hardware screen measures it when the model is idle")
                return dataclasses.replace(profile, unknown={**profile.unknown, BANDWIDTH_UNKNOWN: why})
            return detect(measure_bandwidth=True, model_dir=store, remeasure=wait)

    @contextmanager
    def model_turn(self, what: str, *, wait: bool = True, cancel: CancelToken | None = None,
                   on_wait: Callable[[str], None] | None = None, shared: bool = False) -> Iterator[str]:
        """Hold this process's turn for model work (``what``: a few words) in a ``with``.

        Yields "" once the turn is held. When other work holds it: with ``wait`` False,
        yields what holds it, without the turn; else ``on_wait`` hears what holds it, the
        call waits, and a ``cancel`` meanwhile raises Cancelled. ``shared``: the turn of one
        of several answers the model computes together, held beside the others."""
        holder = _TURNS.take(what, shared)
        if holder:
            if not wait:
                yield holder
                return
            if on_wait is not None:
                on_wait(holder)
            self._wait_for_turn(what, shared, cancel)
        try:
            yield ""
        finally:
            _TURNS.give_back(shared)

    @staticmethod
    def _wait_for_turn(what: str, shared: bool, cancel: CancelToken | None) -> None:
        with _TURNS.changed:
            if not shared:
                _TURNS.exclusive_waiting += 1
            try:
                while _TURNS.take(what, shared):
                    if cancel is not None:
                        cancel.raise_if_cancelled(what)
                    _TURNS.changed.wait(_WAIT_POLL_S)
            finally:
                if not shared:
                    _TURNS.exclusive_waiting -= 1
                    _TURNS.changed.notify_all()  # shared turns held back by this one may go

    def list_local_models(self) -> list[LocalModel]:
        from hybridmoe.backend.hub import list_local_models

        return list_local_models()

    def preset_names(self) -> tuple[str, ...]:
        """Machines to plan for besides this one (``hybridmoe plan --hardware PRESET``)."""
        from hybridmoe.backend.hardware.presets import preset_names

        return tuple(preset_names())

    def preset(self, name: str) -> HardwareProfile:
        from hybridmoe.backend.hardware.presets import preset

        return preset(name)

    def model_dirs(self) -> list[Path]:
        """The folders searched for models besides the model store (``hybridmoe models --add``)."""
        from hybridmoe.backend.hub import registry

        return registry.registered_dirs()

    def add_model_dir(self, directory: str | Path) -> Path:
        from hybridmoe.backend.hub import registry

        return registry.add_dir(directory)

    def remove_model_dir(self, directory: str | Path) -> Path:
        """Stop searching ``directory``; the models in it are not touched."""
        from hybridmoe.backend.hub import registry

        return registry.remove_dir(directory)

    def catalogue(self):
        """hybridmoe.backend.hub.catalogue.Catalogue: the models hybridmoe knows by name."""
        from hybridmoe.backend.hub import catalogue

        return catalogue.load()

    def rank_catalogue(self, hardware: HardwareProfile, workload: Workload) -> list:
        """[hybridmoe.backend.hub.catalogue.Ranked]: what fits ``hardware``, fastest first."""
        from hybridmoe.backend.hub import catalogue

        return catalogue.rank_for(hardware, workload)

    def resolve_model(self, text: str) -> Path:
        """A path, catalogue name or local model name -> what inspect_model opens."""
        from hybridmoe.backend.hub.catalogue import model_path

        return model_path(text)

    def inspect_model(self, path: str | Path):
        """hybridmoe.backend.models.InspectedModel (headers only; fast enough for a worker)."""
        from hybridmoe.backend.models import inspect_model

        return inspect_model(path)

    def make_plan(self, spec, inventory, hardware: HardwareProfile, workload: Workload) -> Plan:
        """The planner: milliseconds, so the plan editor calls it on every keystroke."""
        from hybridmoe.backend.plan import make

        return make(spec, inventory, hardware, workload)

    # ---- getting models ----------------------------------------------------------------------

    def pull(self, repo: str, quant: str | None, on_progress: ProgressCallback | None,
             cancel: CancelToken | None) -> LocalModel:
        """Download into the model store; a cancelled pull resumes when called again."""
        from hybridmoe.backend.hub import pull

        return pull(repo, quant=quant, on_progress=on_progress, cancel=cancel)

    def convert(self, model: LocalModel, quant: str, on_progress: ProgressCallback | None,
                cancel: CancelToken | None) -> Path:
        """A safetensors checkpoint -> one GGUF file in ``converted_dir()``; returns its path.

        A file of that name written after every file of the checkpoint is a finished
        conversion of it (files appear there only once complete): it is used as it is, rather
        than spending hours to write it again (Resume after a conversion that ended). An older
        one is never replaced unasked: the error says how to delete it first."""
        from hybridmoe.backend.convert import is_current_conversion, to_gguf
        from hybridmoe.backend.errors import HybridMoeError
        from hybridmoe.backend.hub import registry

        out_dir = self.converted_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        registry.add_dir(out_dir)  # so `list_local_models` (and `hybridmoe models`) find the result
        stem = re.sub(r"[^A-Za-z0-9._-]+", "--", model.name).strip("-") or "model"
        out = out_dir / f"{stem}-{quant.upper()}.gguf"
        if is_current_conversion(out, model.path):
            log.info("%s is already converted to %s; using it", model.path, out)
            return out
        if out.exists():
            raise HybridMoeError(f"{out} already exists, and is older than the checkpoint {model.path}.",
                                 "Delete it in Models (select it, then d) to convert again, or use it as it is.")
        return to_gguf(model.path, out, quant=quant, on_progress=on_progress, cancel=cancel)

    def convert_quants(self) -> tuple[str, ...]:
        from hybridmoe.backend.convert import QUANTS

        return tuple(QUANTS)

    def delete_model(self, model: LocalModel) -> int:
        """Remove the files of ``model``; returns the bytes freed. The caller has confirmed."""
        from hybridmoe.app.model_files import delete_model_files

        return delete_model_files(model)

    # ---- what the model did: expert usage, benchmarks ----------------------------------------

    def expert_stats_path(self, model_path: str | Path) -> Path:
        """The usage file of a model: how often each routed expert was chosen, summed over
        every chat that recorded it (counts only, never text); one JSON per model path."""
        key = os.path.abspath(Path(model_path).expanduser())
        return self.data_dir() / "expert-stats" / f"{_slug(key)}.json"

    def expert_counts(self, session) -> ExpertStats | None:
        """Everything the session's model has counted since it was loaded; None for a
        backend that does not count (llama.cpp)."""
        if not session.counts_experts:
            return None
        # The session writes the planner's file format; reading it back keeps the app on
        # the Session's public verbs.
        with tempfile.TemporaryDirectory(prefix="hybridmoe-stats-") as tmp:
            path = Path(tmp) / "counts.json"
            session.save_expert_stats(path)
            return ExpertStats.load(path)

    def add_expert_counts(self, model_path: str | Path, counts: ExpertStats) -> Path:
        """Add ``counts`` to the model's usage file (created on first use)."""
        path = self.expert_stats_path(model_path)
        if path.exists():
            try:
                counts = ExpertStats.load(path).merged(counts)
            except ModelError as error:
                # Damaged, or another model's (the files at this path were replaced): what it
                # held cannot be added to; keep it aside, start again.
                log.warning("setting aside %s: %s", path, error.what)
                path.replace(path.with_suffix(".json.damaged"))
        counts.save(path)
        return path

    # Sizes of the benchmark, as `hybridmoe bench generate` has them by default.
    bench_sizes = {"prompt_tokens": 512, "gen_tokens": 64, "repeats": 2, "rounds": 2}

    def bench_backends(self, model_path: str | Path) -> tuple[str, ...]:
        """The engine always; llama.cpp too for a GGUF file, when llama-cpp-python is installed."""
        import importlib.util

        path = Path(model_path)
        if path.suffix == ".gguf" and importlib.util.find_spec("llama_cpp") is not None:
            return ("engine", "llamacpp")
        return ("engine",)

    def benchmark(self, model_path: str | Path, on_progress: ProgressCallback | None,
                  cancel: CancelToken | None) -> dict:
        """`hybridmoe bench generate`: prefill and decode tokens/s of each backend, each in a
        process of its own; the summary ``bench_table`` prints."""
        from hybridmoe.backend.bench.generate import measure

        with self.model_turn("a benchmark", cancel=cancel):
            return measure(str(model_path), backends=self.bench_backends(model_path), on_progress=on_progress,
                           cancel=cancel, **self.bench_sizes)

    def bench_table(self, summary: dict) -> str:
        from hybridmoe.backend.bench.generate import table

        return table(summary)

    # ---- running -----------------------------------------------------------------------------

    def load_session(self, model, plan: Plan, on_progress: ProgressCallback | None,
                     cancel: CancelToken | None, on_notice: Callable[[str], None] | None = None) -> Session:
        """A session on the backend the plan names; "auto" is the embedded engine, falling
        back to llama.cpp when the engine cannot serve the model (``on_notice`` says so).
        ``model``: a path, or the InspectedModel the plan was made from (not read again)."""
        from hybridmoe.backend.backends import load_session

        from hybridmoe.backend.backends import BACKEND_NAMES

        said = {"backend": "engine", "reason": ""}

        def fallback(why) -> None:
            said["backend"] = "llamacpp"
            if on_notice is not None:
                on_notice(f"The embedded engine cannot serve this model ({why.what}); using llama.cpp.")

        def chosen(backend: str, reason: str) -> None:  # the plan named the backend, not the user here
            said.update(backend=backend, reason=reason)
            if on_notice is not None:
                on_notice(f"Backend: {BACKEND_NAMES[backend]}, because {reason}.")

        session = load_session("auto", model, plan, on_progress, cancel, on_fallback=fallback, on_choice=chosen)
        slow = plan.engine_slow_path
        if on_notice is not None and said["backend"] == "engine" and slow and slow not in said["reason"]:
            on_notice(f"Slow path: {slow}. The llama.cpp backend reads them in place.")
        return session


def _slug(text: str) -> str:
    """A file name for a model path: readable tail plus enough of the path to stay unique."""
    import hashlib

    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(text).name or text).strip("_")[:60] or "model"
    return f"{tail}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"
