"""The catalogue of models hybridmoe knows by name (``assets/catalogue.toml``).

    load() -> Catalogue                 entries, found by id ("kimi-k2.6") or repo id
    Catalogue.find(name) -> entry | None
    rank_for(hardware, workload) -> [Ranked]   what fits this machine, fastest first
    model_path(text) -> Path            a path, catalogue name or local model name -> inspectable path

The TOML holds names, repositories and published sizes; everything that follows from a
model's config.json (family, context length, the checkpoint's size, the size of a GGUF
quantization nobody published) is computed here through hybridmoe.backend.models, so the catalogue
cannot drift from the planner's arithmetic.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path

from hybridmoe.backend.errors import HybridMoeError, ModelError, UsageError
from hybridmoe.backend.hub.local import names_a_path
from hybridmoe.backend.units import fmt_bytes, parse_bytes

CATALOGUE_FILE = "catalogue.toml"


def assets_dir() -> Path:
    """The data files installed as ``hybridmoe.assets`` (the repository's ``assets/`` folder;
    in an editable install the folder itself)."""
    from importlib.resources import files

    return Path(str(files("hybridmoe.assets")))


@dataclass(frozen=True)
class Quant:
    """A quantization worth offering, with its size published or computed."""

    name: str  # as in GGUF file names
    format: str | None  # storage format of the routed experts (None: not computable)
    published_bytes: int | None = None
    source: str = ""


@dataclass(frozen=True)
class Size:
    bytes: int
    source: str  # where a published number comes from, or "computed from config.json (...)"
    published: bool


@dataclass(frozen=True)
class CatalogueEntry:
    id: str
    name: str
    repo: str
    config_path: Path
    gguf_repos: tuple[str, ...] = ()
    quants: tuple[Quant, ...] = ()
    checkpoint_bytes: int | None = None  # published size of the official repository
    checkpoint_source: str = ""
    notes: str = ""
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    # ---- computed from the config ---------------------------------------------------------

    def inspect(self, expert_format: str | None = None):
        """hybridmoe.backend.models.InspectedModel of the config (sized for ``expert_format``)."""
        key = ("inspect", expert_format)
        if key not in self._cache:
            from hybridmoe.backend.models import inspect_model

            self._cache[key] = inspect_model(self.config_path, expert_format=expert_format)
        return self._cache[key]

    @property
    def spec(self):
        return self.inspect().spec

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def context(self) -> int:
        return self.spec.max_context

    def checkpoint_size(self) -> Size:
        computed = self.inspect().inventory.total_bytes
        if self.checkpoint_bytes is not None:
            return Size(self.checkpoint_bytes, self.checkpoint_source, True)
        return Size(computed, f"computed from config.json ({self.spec.expert_format} experts)", False)

    def quant(self, name: str) -> Quant | None:
        for q in self.quants:
            if q.name.upper() == name.upper():
                return q
        return None

    def quant_size(self, q: Quant) -> Size | None:
        if q.published_bytes is not None:
            return Size(q.published_bytes, q.source, True)
        if q.format is None:
            return None
        return Size(self.inspect(q.format).inventory.total_bytes,
                    f"computed from config.json ({q.format} experts)", False)

    def to_dict(self) -> dict:
        ck = self.checkpoint_size()
        quants = {}
        for q in self.quants:
            s = self.quant_size(q)
            quants[q.name] = {"format": q.format, "bytes": s.bytes if s else None,
                              "published": s.published if s else False, "source": s.source if s else ""}
        return {
            "id": self.id, "name": self.name, "repo": self.repo, "gguf_repos": list(self.gguf_repos),
            "family": self.family, "context": self.context, "config": str(self.config_path),
            "checkpoint": {"format": self.spec.expert_format, "bytes": ck.bytes, "published": ck.published,
                           "source": ck.source},
            "quants": quants, "notes": self.notes,
        }


@dataclass(frozen=True)
class Catalogue:
    entries: tuple[CatalogueEntry, ...]
    path: Path

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @cached_property
    def _index(self) -> dict[str, CatalogueEntry]:
        index: dict[str, CatalogueEntry] = {}
        for e in self.entries:
            for key in (e.id, e.repo, e.repo.split("/", 1)[-1], *e.gguf_repos):
                index.setdefault(key.lower(), e)
        return index

    def find(self, name: str) -> CatalogueEntry | None:
        """By id ("kimi-k2.6"), official or GGUF repo id, or model name ("Kimi-K2.6"); any case."""
        return self._index.get(name.strip().lower())

    def ids(self) -> list[str]:
        return [e.id for e in self.entries]


@lru_cache(maxsize=4)
def load(path: str | os.PathLike[str] | None = None) -> Catalogue:
    """The catalogue (default: the shipped one). Raises ModelError naming a malformed entry."""
    path = Path(path) if path is not None else assets_dir() / CATALOGUE_FILE
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelError(f"the model catalogue {path} is missing",
                         "The installation is incomplete; reinstall hybridmoe.") from e
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ModelError(f"the model catalogue {path} cannot be read: {e}", "Reinstall hybridmoe.") from e
    entries = []
    seen: set[str] = set()
    for i, raw in enumerate(data.get("model", [])):
        where = f"{path}: model #{i + 1} ({raw.get('id', '?')})"
        try:
            entry = _entry(raw, path.parent)
        except (KeyError, TypeError, ValueError, HybridMoeError) as e:
            raise ModelError(f"{where} is malformed: {e}", "Fix the catalogue file.") from e
        if entry.id in seen:
            raise ModelError(f"{where}: id {entry.id!r} is used twice", "Fix the catalogue file.")
        seen.add(entry.id)
        entries.append(entry)
    return Catalogue(tuple(entries), path)


def _entry(raw: dict, base: Path) -> CatalogueEntry:
    from hybridmoe.backend.models.formats import get_format

    def fmt_of(name: str, explicit: str | None) -> str | None:
        if explicit is not None:
            return get_format(explicit).name
        try:
            return get_format(name).name
        except HybridMoeError:
            return None  # a name that is not a storage format (unsloth's UD-* mixes)

    quants = tuple(
        Quant(
            name=q["name"],
            format=fmt_of(q["name"], q.get("format")),
            published_bytes=parse_bytes(q["size"]) if "size" in q else None,
            source=q.get("source", ""),
        )
        for q in raw.get("quant", [])
    )
    checkpoint = raw.get("checkpoint", {})
    config = base / raw["config"]
    if not config.is_file():
        raise ValueError(f"config {config} does not exist")
    return CatalogueEntry(
        id=raw["id"],
        name=raw["name"],
        repo=raw["repo"],
        config_path=config,
        gguf_repos=tuple(raw.get("gguf_repos", ())),
        quants=quants,
        checkpoint_bytes=parse_bytes(checkpoint["size"]) if "size" in checkpoint else None,
        checkpoint_source=checkpoint.get("source", ""),
        notes=raw.get("notes", ""),
    )


# ---- ranking ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ranked:
    entry: CatalogueEntry
    option: str  # "checkpoint" or a quantization name
    size_bytes: int
    plan: object  # hybridmoe.backend.plan.Plan
    context: int  # the workload's context, capped at the model's

    @property
    def tokens_per_s(self) -> float | None:
        """The plan's expected decode speed (its bound where no expected figure is known)."""
        return self.plan.decode_tokens_per_s_expected or self.plan.decode_tokens_per_s_upper_bound

    @property
    def bound_tokens_per_s(self) -> float | None:
        return self.plan.decode_tokens_per_s_upper_bound


def rank_for(hardware, workload=None, *, catalogue: Catalogue | None = None) -> list[Ranked]:
    """Catalogue entries that fit ``hardware``, fastest first (the plan's expected decode speed).

    Each entry is represented by the best-quality variant that fits: the published
    checkpoint first (nothing is lost to re-quantization), then each computable
    quantization smaller than it, largest first. Every model is planned at its own default
    context (as `hybridmoe plan MODEL` plans it), never at another model's.
    """
    ranked = [r for entry in catalogue or load() if (r := fitting_variant(entry, hardware, workload)) is not None]
    return sorted(ranked, key=lambda r: -(r.tokens_per_s or 0.0))


def fitting_variant(entry: CatalogueEntry, hardware, workload=None) -> Ranked | None:
    """The variant of ``entry`` the catalogue offers for ``hardware`` (as ``rank_for``
    ranks it): the best quality that fits; None when none does."""
    from hybridmoe.backend.plan import Workload, make

    workload = workload or Workload()
    checkpoint = entry.checkpoint_size().bytes
    candidates = [("checkpoint", None, checkpoint)]
    smaller = []
    for q in entry.quants:
        size = entry.quant_size(q)
        if q.format is not None and size is not None and size.bytes < checkpoint:
            smaller.append((q.name, q.format, size.bytes))
    candidates += sorted(smaller, key=lambda c: -c[2])
    # The model's own default context: the default, or the model's maximum when that is less
    # (a chat's context belongs to the model it was set for, not to every model listed).
    wl = replace(workload, context=min(Workload().context, entry.context))
    for option, fmt, size in candidates:
        model = entry.inspect(fmt)
        try:
            plan = make(model.spec, model.inventory, hardware, wl)
        except HybridMoeError:  # a workload this model cannot take at all
            continue
        if plan.fits:
            return Ranked(entry, option, size, plan, wl.context)
    return None


# ---- names on the command line -----------------------------------------------------------------


def model_path(text: str) -> Path:
    """What ``hybridmoe inspect/plan MODEL`` should open for ``text``: an existing path as is;
    a catalogue name ("kimi-k2.6", "moonshotai/Kimi-K2.6") -> its shipped config.json; a local
    model's name as ``hybridmoe models`` lists it -> its files."""
    path = Path(text).expanduser()
    if names_a_path(path):  # a broken or looping link too: inspect_model says what is wrong with it
        return path
    entry = load().find(text)
    if entry is not None:
        return entry.config_path
    from hybridmoe.backend.hub.discover import list_local_models

    for m in list_local_models(inspect=False):
        if m.name.lower() == text.strip().lower() and m.problem is None:
            return m.path
    if text.startswith(("/", ".", "~")) or text.endswith((".json", ".gguf")) or text.count("/") > 1:
        return path  # a path that does not exist: inspect_model says so
    pull = f" To use a Hub repository, download it first: `hybridmoe pull {text}`." if "/" in text else ""
    raise UsageError(
        f"{text!r} is neither a file, a catalogue name nor a local model.",
        "`hybridmoe models --catalogue` lists the names hybridmoe knows; `hybridmoe models` the models on disk."
        + pull,
    )


@dataclass(frozen=True)
class PullChoice:
    """What ``hybridmoe pull NAME`` downloads, and why in a sentence ("" for a repo id)."""

    repo: str
    quant: str | None
    why: str = ""


def pull_choice(name: str, quant: str | None, hardware) -> PullChoice:
    """For a catalogue name without ``quant``: the variant the catalogue list shows as fitting
    ``hardware`` (a GGUF quantization, or the checkpoint), not always the checkpoint (a 57 GiB
    download on a machine with 32 GiB); the checkpoint, said not to fit, when nothing does."""
    if "/" in name or quant is not None:
        return PullChoice(pull_target(name, quant), quant)
    entry = load().find(name)
    if entry is None:
        pull_target(name)  # the error for a name that is nothing
    best = fitting_variant(entry, hardware)
    if best is None:
        return PullChoice(entry.repo, None, f"no variant of {entry.name} fits this machine; downloading the "
                          f"checkpoint ({fmt_bytes(entry.checkpoint_size().bytes)}) from {entry.repo} anyway")
    if best.option == "checkpoint":
        return PullChoice(entry.repo, None, f"{entry.name}: the checkpoint ({fmt_bytes(best.size_bytes)}) fits this "
                          "machine")
    if not entry.gguf_repos:  # the quantization is made here, from the checkpoint
        return PullChoice(entry.repo, None, f"{entry.name}: {best.option} fits this machine; downloading the "
                          f"checkpoint, which `hybridmoe convert DIR --quant {best.option.lower()}` then converts")
    return PullChoice(entry.gguf_repos[0], best.option,
                      f"{entry.name}: {best.option} ({fmt_bytes(best.size_bytes)}) is the largest variant that fits "
                      f"this machine (`--quant` chooses another)")


def runnable_path(text: str) -> Path:
    """What ``hybridmoe run/serve -m MODEL`` loads: as ``model_path``, except that a catalogue
    name means its copy on this disk (a download of its repository or one of its GGUF
    repositories), never the bundled config.json, which holds no weights."""
    path = Path(text).expanduser()
    entry = None if names_a_path(path) else load().find(text)
    if entry is None:
        return model_path(text)
    from hybridmoe.backend.hub.discover import list_local_models

    repos = {entry.repo.lower(), *(r.lower() for r in entry.gguf_repos)}
    for m in list_local_models():
        if m.usable and (m.repo_id or "").lower() in repos:
            return m.path
    raise UsageError(f"{entry.name} ({entry.id}) is not on this machine yet",
                     f"`hybridmoe pull {entry.id}` downloads the variant that fits this machine.")


def pull_target(name: str, quant: str | None = None) -> str:
    """The repository ``hybridmoe pull NAME`` downloads: NAME itself when it is a repo id
    (organisation/name); for a catalogue name, the official repository, or with a
    quantization the first GGUF repository the catalogue lists."""
    if "/" in name:
        return name
    entry = load().find(name)
    if entry is None:
        raise UsageError(
            f"{name!r} is neither a Hugging Face repository id (organisation/name) nor a catalogue name.",
            "`hybridmoe models --catalogue` lists the names hybridmoe knows.",
        )
    if quant is None:
        return entry.repo
    if not entry.gguf_repos:
        raise UsageError(
            f"The catalogue knows no GGUF repository of {entry.name}.",
            f"Give a GGUF repository id instead of {name!r}, or drop --quant to download {entry.repo}.",
        )
    return entry.gguf_repos[0]
