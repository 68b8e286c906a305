"""Which model a path means: the one rule for GGUF sets, split parts, projectors and folders.

Inspection, the engine's weights and tokenizer, and the llama.cpp backend all ask
``resolve_model_files`` and so always open the same file. A path may be:

* a GGUF file (named ``.gguf`` or starting with the GGUF magic), alone or any part of a split
  ``-0000k-of-0000N.gguf`` set: the set, opened from its first part;
* a folder holding config.json and safetensors shards: the checkpoint;
* a folder holding one GGUF model (a file or a split set), next to which multimodal projector
  files (``mmproj`` in the name) may lie: that model; config.json there without safetensors
  does not change it;
* a folder holding config.json alone, or a bare config.json: the config (planning before the
  download).

Two GGUF models in one folder are refused with one message naming both: the user gives the
path of the file to use. Nothing here parses a GGUF header; it only looks at names and, for a
file without the ``.gguf`` suffix, its first four bytes.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.gguf_reader import GGUF_MAGIC, SPLIT_NAME, split_parts
from hybridmoe.backend.models.safetensors_files import checkpoint_files

__all__ = ["ModelFiles", "is_gguf_file", "is_projector", "resolve_model_files"]

MODEL_PATH_HINT = "Give a model folder (with config.json), a .gguf file or a config.json."


@dataclass(frozen=True)
class ModelFiles:
    """What a path means. ``path`` is what a reader opens: the first part of a GGUF set, the
    checkpoint folder, or the config.json; ``files`` every file of the model (the parts of a
    GGUF set, the safetensors shards, or the config.json)."""

    kind: str  # "gguf", "safetensors" or "config"
    path: Path
    files: tuple[Path, ...]


def is_projector(name: str) -> bool:
    """A multimodal projector (``mmproj-...gguf``, ``...-mmproj-f16.gguf``): a GGUF file, but
    not a language model. Matched anywhere in the name, as llama.cpp's and Hugging Face's
    repositories place it either first or last."""
    return "mmproj" in name.lower()


def is_gguf_file(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic (whatever its name)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


def resolve_model_files(path: str | os.PathLike[str]) -> ModelFiles:
    """The model at ``path`` (see the module doc). Raises ``ModelError`` for a path that does
    not exist, a folder with no model or two, a split set with a part missing, or a file that
    is neither GGUF nor JSON."""
    p = Path(path).expanduser()
    if not p.exists():
        raise _not_found(p)
    if p.is_dir():
        return _in_folder(p)
    if p.suffix.lower() == ".gguf" or is_gguf_file(p):
        parts = tuple(split_parts(p))
        return ModelFiles("gguf", parts[0], parts)
    if p.suffix.lower() == ".json":
        return ModelFiles("config", p, (p,))
    raise ModelError(f"{p} is neither a model folder, a .gguf file nor a config.json.", MODEL_PATH_HINT)


def _in_folder(folder: Path) -> ModelFiles:
    config = folder / "config.json"
    has_config = config.is_file()
    if has_config and (shards := checkpoint_files(folder)):
        return ModelFiles("safetensors", folder, tuple(shards))
    models, projectors = _gguf_models(folder)
    if len(models) > 1:
        listed = ", ".join(m.name for m in models)
        raise ModelError(f"{folder} holds several GGUF models ({listed}).",
                         f"Give the path of the one to use, for example {models[0]}.")
    if models:
        parts = tuple(split_parts(models[0]))
        return ModelFiles("gguf", parts[0], parts)
    if has_config:
        return ModelFiles("config", config, (config,))
    skipped = f" ({', '.join(projectors)}: a multimodal projector, not a language model)" if projectors else ""
    raise ModelError(f"{folder} holds neither config.json nor a .gguf model file{skipped}.",
                     "Give the folder a model was downloaded into, or the model file itself.")


def _gguf_models(folder: Path) -> tuple[list[Path], list[str]]:
    """The GGUF models of a folder, one file each (a split set by its first part when present,
    so a message names the file to give), and the projector files left out."""
    models: dict[str, Path] = {}
    projectors: list[str] = []
    for f in sorted(folder.glob("*.gguf")):
        if is_projector(f.name):
            projectors.append(f.name)
            continue
        m = SPLIT_NAME.match(f.name)
        key = m.group("stem") if m else f.name
        if key not in models or (m and m.group("no") == "00001"):
            models[key] = f
    return list(models.values()), projectors


def _not_found(p: Path) -> ModelError:
    """Why ``p`` cannot be opened: absent, a broken symbolic link, or a loop of links."""
    if p.is_symlink():
        try:
            os.stat(p)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return ModelError(f"{p} is a loop of symbolic links: following it never reaches a file or folder.",
                                  f"Point the link at the model (ln -sfn MODEL {p}), or give the model's own path.")
        return ModelError(f"{p} is a symbolic link to {os.readlink(p)}, which does not exist.", MODEL_PATH_HINT)
    return ModelError(f"{p} does not exist.", MODEL_PATH_HINT)
