"""Fakes of the model boundary for the terminal UI: a backend whose session streams scripted
text slowly and honours cancel, a downloader that reports progress, can be cancelled and
resumes from what it wrote, and a Services that plugs them in. Everything else is real:
settings and state files, the planner, (a slice of) the catalogue, the SQLite history.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from hybridmoe.app.services import Services
from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.hardware.overrides import apply_overrides
from hybridmoe.backend.hardware.presets import preset
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.hub.meter import DownloadProgress
from hybridmoe.backend.session import Cancelled, CancelToken, Done, Progress, Stats, TextPiece
from hybridmoe.backend.units import GiB

ANSWER = ["Hello", "! ", "Here ", "is ", "some ", "code:\n\n", "```python\n", "print('hi')\n", "```\n\n", "Done."]


def workstation():
    """One 96 GB GPU and 128 GiB of RAM: a model is split between them. Detected, as
    detect() reports it (not a described machine)."""
    return this_machine(apply_overrides(preset("4x RTX PRO 6000"), gpus=1, ram=128 * GiB))


def this_machine(profile):
    return replace(profile, described=False, name="this machine")


class FakeSession:
    def __init__(self, script: list[str], delay: float, max_parallel: int = 1):
        self.script, self.delay = script, delay
        # As the engine: as many generations at once as the plan's KV cache holds conversations.
        self.max_parallel = max_parallel
        self.decode_path = "decode: native chain, all 3 layers"
        self.backend, self.counts_experts = "engine", False  # as the engine, but counting nothing
        self.calls: list[list] = []
        self.closed = False

    def generate(self, messages, sampling, cancel: CancelToken | None = None):
        self.calls.append(list(messages))
        sent: list[str] = []
        reason = "stop"
        for piece in self.script:
            if cancel is not None and cancel.cancelled:
                reason = "cancelled"
                break
            time.sleep(self.delay)
            sent.append(piece)
            yield TextPiece(piece, (len(sent),))
        if cancel is not None and cancel.cancelled:
            reason = "cancelled"
        prompt_tokens = sum(len(m.content.split()) for m in messages)
        yield Done(reason, "".join(sent), tuple(range(len(sent))), Stats(
            prompt_tokens=prompt_tokens, generated_tokens=len(sent), time_to_first_token_s=self.delay,
            prefill_tokens_per_s=1000.0, decode_tokens_per_s=42.0, main_device_expert_share=0.625,
            peak_memory_bytes={"host": 3 * GiB, "cuda:0": 80 * GiB}, backend="fake"))

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    """load() reports a few layers of progress; each session streams ``script``."""

    def __init__(self, script: list[str] | None = None, delay: float = 0.005, load_delay: float = 0.005,
                 hold_load: bool = False):
        self.script = script or ANSWER
        self.delay, self.load_delay = delay, load_delay
        self.hold_load = hold_load  # load() stops after its first layer until cancelled
        self.sessions: list[FakeSession] = []
        self.loads: list[tuple] = []

    def load(self, model_path, plan, on_progress=None, cancel=None) -> FakeSession:
        self.loads.append((Path(model_path), plan))
        for layer in range(1, 5):
            if cancel is not None:
                cancel.raise_if_cancelled("loading the model")
            time.sleep(self.load_delay)
            if on_progress:
                on_progress(Progress("load", layer, 4, unit="layers", message=f"building layer {layer} of 4"))
            while self.hold_load and cancel is not None and not cancel.cancelled:
                time.sleep(0.01)
        session = FakeSession(self.script, self.delay, plan.workload.users)
        self.sessions.append(session)
        return session


@dataclass
class FakeDownloader:
    """``pull`` writes ``size`` bytes in chunks under ``root``; a cancelled pull keeps them and
    the next pull (by this or a new instance on the same root) continues from there. The
    "model" it delivers is the catalogue's config.json of the repository's model."""

    root: Path
    size: int = 64 * 1024 * 1024
    chunk: int = 4 * 1024 * 1024
    delay: float = 0.002
    hold_at: int | None = None  # stop writing at this many bytes and wait for a cancel
    pulls: list[tuple[str, str | None, int]] = field(default_factory=list)

    def _dir(self, repo: str) -> Path:
        return self.root / repo.replace("/", "--")

    def pull(self, repo, quant, on_progress, cancel: CancelToken | None) -> LocalModel:
        directory = self._dir(repo)
        directory.mkdir(parents=True, exist_ok=True)
        blob = directory / "weights.partial"
        done = blob.stat().st_size if blob.exists() else 0
        self.pulls.append((repo, quant, done))
        with open(blob, "ab") as f:
            while done < self.size:
                while self.hold_at is not None and done >= self.hold_at and not (cancel and cancel.cancelled):
                    time.sleep(0.01)
                if cancel is not None and cancel.cancelled:
                    raise Cancelled(f"the download of {repo} was cancelled; {done} of {self.size} bytes are on disk",
                                    "Run the same command again to resume where it stopped.")
                time.sleep(self.delay)
                n = min(self.chunk, self.size - done)
                f.write(b"\0" * n)
                f.flush()
                done += n
                if on_progress:
                    on_progress(DownloadProgress("download", done, self.size, unit="B", rate_bytes_per_s=50e6,
                                                 eta_s=(self.size - done) / 50e6, file="weights", files_done=0,
                                                 files_total=1))
        config = directory / "config.json"
        shutil.copyfile(_catalogue_config(repo), config)
        return LocalModel(name=repo, path=config, kind="safetensors", size_bytes=self.size, source="hf-cache",
                          repo_id=repo, files=(config, blob))


def _catalogue_config(repo: str) -> Path:
    from hybridmoe.backend.hub import catalogue

    entry = catalogue.load().find(repo)
    if entry is None:
        raise HybridMoeError(f"{repo} is not on the (fake) Hub", "Only catalogue repositories exist here.")
    return entry.config_path


class FakeServices(Services):
    """Real settings, state, planner and a slice of the real catalogue; fake hardware,
    downloads, conversions and backend; a model store that is a list."""

    CATALOGUE_IDS = ("qwen3-30b-a3b", "olmoe-1b-7b", "kimi-k2.6")

    def __init__(self, root: Path, *, hardware=None, backend: FakeBackend | None = None,
                 downloader: FakeDownloader | None = None, local: list[LocalModel] | None = None):
        self.root = Path(root)
        self.hardware = hardware or workstation()
        self.backend = backend or FakeBackend()
        self.downloader = downloader or FakeDownloader(self.root / "hub")
        self.local = list(local or [])
        self.detect_error: BaseException | None = None
        self.detect_calls = 0
        self.deleted: list[LocalModel] = []

    def detect_hardware(self, measure_bandwidth: bool, *, wait: bool = False, on_wait=None):
        self.detect_calls += 1
        if self.detect_error is not None:
            raise self.detect_error
        return self.hardware

    def list_local_models(self):
        return list(self.local)

    def catalogue(self):
        from hybridmoe.backend.hub import catalogue

        full = catalogue.load()
        return catalogue.Catalogue(tuple(full.find(i) for i in self.CATALOGUE_IDS), full.path)

    def rank_catalogue(self, hardware, workload):
        from hybridmoe.backend.hub import catalogue

        return catalogue.rank_for(hardware, workload, catalogue=self.catalogue())

    def pull(self, repo, quant, on_progress, cancel):
        model = self.downloader.pull(repo, quant, on_progress, cancel)
        self.local.append(model)
        return model

    def convert(self, model, quant, on_progress, cancel):
        out = self.root / "converted" / f"{model.name.replace('/', '--')}-{quant.upper()}"
        out.mkdir(parents=True, exist_ok=True)
        for i in range(1, 5):
            if cancel is not None:
                cancel.raise_if_cancelled("the conversion")
            on_progress(Progress("convert", i * 1000, 4000, unit="B"))
        shutil.copyfile(model.path, out / "config.json")
        return out / "config.json"

    def delete_model(self, model):
        self.deleted.append(model)
        self.local = [m for m in self.local if m.path != model.path]
        return model.size_bytes

    def load_session(self, model_path, plan, on_progress, cancel, on_notice=None):
        return self.backend.load(model_path, plan, on_progress, cancel)


def local_model(root: Path, catalogue_id: str = "qwen3-30b-a3b", name: str | None = None) -> LocalModel:
    """A "model on disk": the catalogue's config.json copied into ``root``."""
    from hybridmoe.backend.hub import catalogue

    entry = catalogue.load().find(catalogue_id)
    directory = Path(root) / (name or entry.repo.replace("/", "--"))
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "config.json"
    config.write_text(json.dumps(json.loads(entry.config_path.read_text())))
    return LocalModel(name=name or entry.repo, path=config, kind="safetensors", size_bytes=60 * GiB,
                      source="directory", family=entry.family, files=(config,))
