"""The backend verbs the terminal UI calls, gathered in one object the App receives.

This is the seam for tests: the App never imports a backend verb directly, it calls
``app.services.<verb>``. ``Services`` is the real implementation; tests pass a subclass that
fakes the model boundary (a backend whose session streams scripted text, a downloader that
reports progress without a network) and keeps everything else real: settings files, the
planner, the catalogue, the SQLite history.

Every method may block (disk, network, model loading) and is called from worker threads,
never from the UI thread, except the few documented as fast.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from backend import settings as settings_module
from backend.hardware.profile import HardwareProfile
from backend.hub.local import LocalModel
from backend.plan import Plan, Workload
from backend.session import CancelToken, ProgressCallback, Session
from backend.settings import Settings


class Services:
    """The real backend. Subclass and override to fake part of it."""

    # ---- settings and where things live (fast: called on the UI thread) ------------------------

    def load_settings(self) -> Settings:
        return settings_module.load()

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

    def detect_hardware(self, measure_bandwidth: bool) -> HardwareProfile:
        from backend.hardware import detect

        return detect(measure_bandwidth=measure_bandwidth, model_dir=self.load_settings().model_store_path)

    def list_local_models(self) -> list[LocalModel]:
        from backend.hub import list_local_models

        return list_local_models()

    def preset_names(self) -> tuple[str, ...]:
        """Machines to plan for besides this one (``hybridmoe plan --hardware PRESET``)."""
        from backend.hardware.presets import preset_names

        return tuple(preset_names())

    def preset(self, name: str) -> HardwareProfile:
        from backend.hardware.presets import preset

        return preset(name)

    def model_dirs(self) -> list[Path]:
        """The folders searched for models besides the model store (``hybridmoe models --add``)."""
        from backend.hub import registry

        return registry.registered_dirs()

    def add_model_dir(self, directory: str | Path) -> Path:
        from backend.hub import registry

        return registry.add_dir(directory)

    def remove_model_dir(self, directory: str | Path) -> Path:
        """Stop searching ``directory``; the models in it are not touched."""
        from backend.hub import registry

        return registry.remove_dir(directory)

    def catalogue(self):
        """backend.hub.catalogue.Catalogue: the models hybridmoe knows by name."""
        from backend.hub import catalogue

        return catalogue.load()

    def rank_catalogue(self, hardware: HardwareProfile, workload: Workload) -> list:
        """[backend.hub.catalogue.Ranked]: what fits ``hardware``, fastest first."""
        from backend.hub import catalogue

        return catalogue.rank_for(hardware, workload)

    def resolve_model(self, text: str) -> Path:
        """A path, catalogue name or local model name -> what inspect_model opens."""
        from backend.hub.catalogue import model_path

        return model_path(text)

    def inspect_model(self, path: str | Path):
        """backend.models.InspectedModel (headers only; fast enough for a worker)."""
        from backend.models import inspect_model

        return inspect_model(path)

    def make_plan(self, spec, inventory, hardware: HardwareProfile, workload: Workload) -> Plan:
        """The planner: milliseconds, so the plan editor calls it on every keystroke."""
        from backend.plan import make

        return make(spec, inventory, hardware, workload)

    # ---- getting models ----------------------------------------------------------------------

    def pull(self, repo: str, quant: str | None, on_progress: ProgressCallback | None,
             cancel: CancelToken | None) -> LocalModel:
        """Download into the model store; a cancelled pull resumes when called again."""
        from backend.hub import pull

        return pull(repo, quant=quant, on_progress=on_progress, cancel=cancel)

    def convert(self, model: LocalModel, quant: str, on_progress: ProgressCallback | None,
                cancel: CancelToken | None) -> Path:
        """A safetensors checkpoint -> one GGUF file in ``converted_dir()``; returns its path."""
        from backend.convert import to_gguf
        from backend.hub import registry

        out_dir = self.converted_dir()
        out_dir.mkdir(parents=True, exist_ok=True)
        registry.add_dir(out_dir)  # so `list_local_models` (and `hybridmoe models`) find the result
        stem = re.sub(r"[^A-Za-z0-9._-]+", "--", model.name).strip("-") or "model"
        out = out_dir / f"{stem}-{quant.upper()}.gguf"
        return to_gguf(model.path, out, quant=quant, on_progress=on_progress, cancel=cancel)

    def convert_quants(self) -> tuple[str, ...]:
        from backend.convert import QUANTS

        return tuple(QUANTS)

    def delete_model(self, model: LocalModel) -> int:
        """Remove the files of ``model``; returns the bytes freed. The caller has confirmed."""
        from app.model_files import delete_model_files

        return delete_model_files(model)

    # ---- running -----------------------------------------------------------------------------

    def load_session(self, model_path: str | Path, plan: Plan, on_progress: ProgressCallback | None,
                     cancel: CancelToken | None, on_notice: Callable[[str], None] | None = None) -> Session:
        """A session on the backend the plan names; "auto" is the embedded engine, falling
        back to llama.cpp when the engine cannot serve the model (``on_notice`` says so)."""
        from backend.backends import load_session

        def fallback(why) -> None:
            if on_notice is not None:
                on_notice(f"The embedded engine cannot serve this model ({why.what}); using llama.cpp.")

        return load_session("auto", model_path, plan, on_progress, cancel, on_fallback=fallback)


def _slug(text: str) -> str:
    """A file name for a model path: readable tail plus enough of the path to stay unique."""
    import hashlib

    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(text).name or text).strip("_")[:60] or "model"
    return f"{tail}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"
