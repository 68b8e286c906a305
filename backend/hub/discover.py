"""Models already on this machine: ``list_local_models()``.

Where it looks:

* the Hugging Face cache (``scan_cache_dir``): the model store of the settings and
  HF_HUB_CACHE; a safetensors checkpoint or one entry per GGUF set of each repo;
* directories registered with ``hybridmoe models --add DIR``: a checkpoint directory, a
  Hugging Face cache, or a tree of model folders and loose GGUF files;
* LM Studio's store (``~/.lmstudio/models``, older ``~/.cache/lm-studio/models``), GGUF only;
* Ollama's store (``$OLLAMA_MODELS`` or ``~/.ollama/models``): each tag's manifest names
  its model layer, a GGUF blob ``blobs/sha256-<hex>``;
* the settings' default model, when it lies outside all of these (a path typed in the setup
  wizard): `hybridmoe models` and the terminal UI list the same models.

Everything is read in place and nothing is copied or written: other tools' stores stay
theirs. Each model is inspected (headers only) for its family and quantization; a model
that cannot be read is listed with the reason (``LocalModel.problem``) instead of failing
the listing.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from hybridmoe.backend.errors import HybridMoeError
from hybridmoe.backend.hub import gguf_sets
from hybridmoe.backend.hub.local import LocalModel
from hybridmoe.backend.hub.selection import RepoFile, is_safetensors_checkpoint, select

log = logging.getLogger(__name__)

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_DEFAULT_REGISTRY = "registry.ollama.ai"
# How deep below a registered or LM Studio directory models are looked for
# (LM Studio: models/<publisher>/<repo>/<file>.gguf).
MAX_DEPTH = 4


def list_local_models(*, cache_dirs: Iterable[str | os.PathLike[str]] | None = None,
                      directories: Iterable[str | os.PathLike[str]] | None = None,
                      lmstudio: bool = True, ollama: bool = True, inspect: bool = True,
                      given: Iterable[str | os.PathLike[str]] | None = None) -> list[LocalModel]:
    """Every model found, each once (by real path). ``cache_dirs`` / ``directories``
    default to the configured cache(s) and the registered directories; ``given`` (paths the
    user chose, by default the settings' default model) are listed first when no search
    found them."""
    if cache_dirs is None:
        cache_dirs = default_cache_dirs()
    if directories is None:
        from hybridmoe.backend.hub.registry import registered_dirs

        directories = registered_dirs()
    found: list[LocalModel] = []
    for d in cache_dirs:
        found += scan_hf_cache(Path(d))
    for d in directories:
        found += scan_directory(Path(d), source="directory")
    if lmstudio:
        for d in lmstudio_dirs():
            found += scan_directory(d, source="lmstudio", gguf_only=True)
    if ollama:
        found += scan_ollama(ollama_dir())
    if given is None:
        from hybridmoe.backend import settings

        given = [settings.load().default_model]
    unique: dict[str, LocalModel] = {}
    for m in found:
        unique.setdefault(os.path.realpath(m.path), m)
    chosen = [given_path(p) for p in given if p and os.path.realpath(p) not in unique and Path(p).exists()]
    models = chosen + list(unique.values())
    return [describe(m) for m in models] if inspect else models


def given_path(path: str | os.PathLike[str]) -> LocalModel:
    """A model the user pointed at by path (source "path"): listed, never deleted by the app
    (no ``files``: those around it are not known to be the model's alone)."""
    p = Path(path)
    files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
    return LocalModel(name=p.name, path=p, kind="gguf" if p.suffix == ".gguf" else "safetensors",
                      size_bytes=sum(f.stat().st_size for f in files), source="path")


def default_cache_dirs() -> list[Path]:
    from huggingface_hub import constants

    from hybridmoe.backend.hub.cache import default_cache_dir

    dirs = [default_cache_dir(), Path(constants.HF_HUB_CACHE)]
    return list(dict.fromkeys(Path(os.path.abspath(d.expanduser())) for d in dirs))


def lmstudio_dirs() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def ollama_dir() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models").expanduser()


# ---- inspection ------------------------------------------------------------------------------


def describe(model: LocalModel) -> LocalModel:
    """Family and quantization from the files' headers; the reason when they cannot be read."""
    if model.problem:
        return model
    from hybridmoe.backend.models import inspect_model

    try:
        inspected = inspect_model(model.path)
    except HybridMoeError as error:
        return replace(model, problem=error.what)
    except Exception as error:
        log.warning("inspecting %s failed", model.path, exc_info=True)
        return replace(model, problem=f"cannot be read ({type(error).__name__}: {error})")
    return replace(model, family=inspected.spec.family,
                   quantization=model.quantization or inspected.spec.expert_format)


# ---- the Hugging Face cache --------------------------------------------------------------------


def scan_hf_cache(cache_dir: Path, source: str = "hf-cache") -> list[LocalModel]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except (CacheNotFound, ValueError, OSError):
        return []
    for warning in info.warnings:
        log.info("Hugging Face cache: %s", warning)
    models = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        models += _repo_models(repo, source)
    return models


def _repo_models(repo, source: str) -> list[LocalModel]:
    """The checkpoint of the newest snapshot that has one, and every GGUF set (newest
    snapshot first, each quantization once)."""
    out: list[LocalModel] = []
    seen_sets: set[str] = set()
    have_checkpoint = False
    revisions = sorted(repo.revisions, key=lambda r: (bool(r.refs), r.last_modified), reverse=True)
    for rev in revisions:
        snapshot = Path(rev.snapshot_path)
        files = [RepoFile(Path(f.file_path).relative_to(snapshot).as_posix(), f.size_on_disk) for f in rev.files]
        paths = [f.path for f in files]
        if not have_checkpoint and is_safetensors_checkpoint(paths):
            chosen = select(files, None, repo.repo_id)
            out.append(LocalModel(
                name=repo.repo_id, path=snapshot, kind="safetensors", size_bytes=chosen.total_bytes,
                source=source, repo_id=repo.repo_id, revision=rev.commit_hash,
                files=tuple(snapshot / f.path for f in chosen.files),
                problem=_missing_shards(snapshot, set(paths), f"hybridmoe pull {repo.repo_id}"),
            ))
            have_checkpoint = True
        for s in gguf_sets.gguf_sets((f.path, f.size) for f in files):
            if s.label.upper() in seen_sets:
                continue
            seen_sets.add(s.label.upper())
            out.append(_gguf_model(f"{repo.repo_id}:{s.label}", snapshot, s, source, repo_id=repo.repo_id,
                                   revision=rev.commit_hash,
                                   finish=f"hybridmoe pull {repo.repo_id} --quant {s.label}"))
    return out


def _missing_shards(snapshot: Path, present: set[str], finish: str) -> str | None:
    """An interrupted pull leaves a snapshot with some shards: say so, and how to finish."""
    from hybridmoe.backend.models.safetensors_files import read_index

    index = snapshot / "model.safetensors.index.json"
    if "model.safetensors.index.json" not in present:
        return None
    try:
        shards = set(read_index(index).values())
    except HybridMoeError:
        return None  # inspection reports the damaged index
    missing = sorted(shards - present)
    if not missing:
        return None
    return (f"incomplete: {len(missing)} of {len(shards)} shards are missing ({missing[0]}"
            f"{', ...' if len(missing) > 1 else ''}); `{finish}` downloads the rest")


def _gguf_model(name: str, root: Path, s: gguf_sets.GGUFSet, source: str, *, repo_id: str | None = None,
                revision: str | None = None, finish: str | None = None) -> LocalModel:
    problem = None
    if not s.complete:
        problem = f"incomplete: {len(s.files)} of the {s.expected_parts} parts of the set are here"
        if finish:
            problem += f"; `{finish}` downloads the rest"
    return LocalModel(
        name=name, path=root / s.first, kind="gguf", size_bytes=s.size_bytes, source=source,
        quantization=s.label, repo_id=repo_id, revision=revision, files=tuple(root / f for f in s.files),
        problem=problem,
    )


# ---- directories (registered, LM Studio) ---------------------------------------------------------


def scan_directory(root: Path, *, source: str, gguf_only: bool = False) -> list[LocalModel]:
    """Checkpoint folders and GGUF sets at most MAX_DEPTH levels below ``root``."""
    root = Path(os.path.abspath(root.expanduser()))
    if not root.is_dir():
        return []
    if not gguf_only and any(p.name.startswith("models--") for p in _children(root)):
        return scan_hf_cache(root, source=source)  # a Hugging Face cache registered as a directory
    models: list[LocalModel] = []
    loose: list[tuple[str, int]] = []
    for directory, names in _walk(root):
        rel = directory.relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        files = [RepoFile(prefix + n, _size(directory / n)) for n in names]
        if not gguf_only and is_safetensors_checkpoint(names):
            chosen = select([RepoFile(n, _size(directory / n)) for n in names], None, str(directory))
            models.append(LocalModel(
                name=directory.name if rel != "." else root.name, path=directory, kind="safetensors",
                size_bytes=chosen.total_bytes, source=source,
                files=tuple(directory / f.path for f in chosen.files),
            ))
        loose += [(f.path, f.size or 0) for f in files if gguf_sets.is_gguf_name(f.path)]
    for s in gguf_sets.gguf_sets(loose):
        parent = Path(s.first).parent.as_posix()
        name = f"{parent}:{s.label}" if parent not in ("", ".") else Path(s.first).name
        models.append(_gguf_model(name, root, s, source))
    return models


def _children(directory: Path) -> list[Path]:
    try:
        return list(directory.iterdir())
    except OSError:
        return []


def _walk(root: Path) -> Iterator[tuple[Path, list[str]]]:
    """(directory, file names) for ``root`` and its subfolders, hidden ones skipped; a
    folder holding a checkpoint is not descended into (its subfolders are not models)."""
    for directory, dirs, names in os.walk(root):
        here = Path(directory)
        depth = len(here.relative_to(root).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if depth < MAX_DEPTH else []
        if is_safetensors_checkpoint(names):
            dirs[:] = []
        yield here, sorted(names)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# ---- Ollama ------------------------------------------------------------------------------------


def scan_ollama(models_dir: Path) -> list[LocalModel]:
    """One model per tag: ``manifests/<registry>/<namespace>/<model>/<tag>`` (JSON) names
    its GGUF in the layer of media type OLLAMA_MODEL_LAYER, stored as ``blobs/sha256-<hex>``."""
    manifests = models_dir / "manifests"
    if not manifests.is_dir():
        return []
    models = []
    for manifest in sorted(manifests.glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        registry, namespace, model, tag = manifest.relative_to(manifests).parts
        name = f"{model}:{tag}" if namespace == "library" else f"{namespace}/{model}:{tag}"
        if registry != OLLAMA_DEFAULT_REGISTRY:
            name = f"{registry}/{namespace}/{model}:{tag}"
        models.append(_ollama_model(name, manifest, models_dir / "blobs", tag))
    return models


def _ollama_model(name: str, manifest: Path, blobs: Path, tag: str) -> LocalModel:
    def unusable(problem: str, path: Path = manifest, size: int = 0) -> LocalModel:
        return LocalModel(name=name, path=path, kind="gguf", size_bytes=size, source="ollama", problem=problem)

    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        layers = data["layers"]
        layer = next(x for x in layers if x.get("mediaType") == OLLAMA_MODEL_LAYER)
        algorithm, _, digest = layer["digest"].partition(":")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return unusable(f"Ollama manifest {manifest} cannot be read")
    except StopIteration:
        return unusable("the Ollama manifest names no model layer (an adapter or projector only?)")
    blob = blobs / f"{algorithm}-{digest}"
    size = layer.get("size") if isinstance(layer.get("size"), int) else _size(blob)
    if not blob.is_file():
        return unusable(f"its model blob {blob} is missing (run `ollama pull {name}`)", blob, size)
    label = gguf_sets.quant_label(f"{tag}.gguf")
    return LocalModel(name=name, path=blob, kind="gguf", size_bytes=size, source="ollama",
                      quantization=label if label != tag else None, files=(blob,))
