"""``inspect_model``: what a model on disk (or only its config) is and what it weighs.

Accepts a checkpoint directory (config.json + safetensors shards), a GGUF file (the first
or any part of a split set), a directory holding one GGUF model, or a bare config.json
(planning before the download); which file a path means is decided by
``model_files.resolve_model_files``, the rule every loader follows. Reads headers and metadata
only, never tensor data.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.families import spec_from_config, spec_from_gguf
from hybridmoe.backend.models.formats import SAFETENSORS_DTYPES, get_format
from hybridmoe.backend.models.gguf_files import SPLIT_NAME, read_gguf
from hybridmoe.backend.models.inventory import TensorClass, TensorInventory
from hybridmoe.backend.models.model_files import ModelFiles, resolve_model_files
from hybridmoe.backend.models.safetensors_files import TensorRecord, read_checkpoint
from hybridmoe.backend.models.spec import ModelSpec
from hybridmoe.backend.models.tensors import (
    check_complete,
    classify_hf,
    gguf_storage_formats,
    inventory_from_config,
    inventory_from_records,
)

@dataclass(frozen=True)
class InspectedModel:
    spec: ModelSpec
    inventory: TensorInventory
    path: Path  # what was inspected, as given
    kind: str  # "safetensors", "gguf" or "config"
    files: tuple[Path, ...]  # weight files read (the config file for kind "config")

    @property
    def load_path(self) -> Path:
        """What a loader opens: the first part of the GGUF set, the checkpoint folder, or the
        config.json (``resolve_model_files`` chose it; a loader never chooses again)."""
        return self.path if self.kind == "safetensors" else self.files[0]


def inspected(model: InspectedModel | str | os.PathLike[str]) -> InspectedModel:
    """``model`` itself if it was inspected already, else the inspection of the path. The
    backends take either: a command that inspected the model to plan it hands it on, so its
    headers are not read a second time."""
    return model if isinstance(model, InspectedModel) else inspect_model(model)


def inspect_model(path: str | os.PathLike[str], *, expert_format: str | None = None,
                  other_format: str | None = None) -> InspectedModel:
    """Spec and tensor inventory of the model at `path`.

    `expert_format` / `other_format` size the model as if stored in those formats (a planned
    conversion, or a download not yet made); by default the inventory is what the files hold,
    or for a bare config what the published checkpoint holds.
    """
    p = Path(path).expanduser()
    try:
        return _inspect_path(p, expert_format, other_format)
    except OSError as exc:  # a folder or file we may not read: the user can fix that
        raise _unreadable(exc, p) from exc


def _unreadable(exc: OSError, given: Path) -> ModelError:
    """The message for an OS error met while reading the model at ``given``."""
    where = Path(exc.filename or given)
    if isinstance(exc, PermissionError):
        where = _denying_folder(where)
        return ModelError(f"Cannot read {where}: permission denied.",
                          f"Give your user read access to the model's folder and files (`ls -ld {where}` "
                          "shows who may read it), or run as a user who may.")
    return ModelError(f"Cannot read {where}: {exc.strerror or exc}.", "Check that the model's files are readable.")


def _denying_folder(path: Path) -> Path:
    """The first folder on the way to ``path`` that we may not list or enter, else ``path``:
    the one whose permissions to change."""
    for folder in (*reversed(path.parents), path):
        if folder.is_dir() and not os.access(folder, os.R_OK | os.X_OK):
            return folder
    return path


def _inspect_path(p: Path, expert_format: str | None, other_format: str | None) -> InspectedModel:
    found = resolve_model_files(p)
    if found.kind == "gguf":
        return _inspect_gguf(found, expert_format, other_format, given=p)
    if found.kind == "safetensors":
        return _inspect_checkpoint(found.path, expert_format, other_format)
    return _inspect_config(found.path, expert_format, other_format, given=p)


def load_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelError(f"Cannot read {path}: {exc.strerror or exc}.", "Check that the file is readable.") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}).",
                         "The file is damaged; download config.json again from the model repository.") from exc
    if not isinstance(config, dict):
        raise ModelError(f"{path} does not hold a JSON object.",
                         "Download config.json again from the model repository.")
    return config


def model_name(path: Path, config: dict[str, Any] | None = None) -> str:
    """A readable name: ``org/model`` for a Hugging Face cache snapshot or an
    ``org__model.json`` config, else the folder or file name."""
    directory = path if path.is_dir() else path.parent
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent.name.removeprefix("models--").replace("--", "/")
    if path.is_file() and path.suffix == ".json" and path.name != "config.json":
        return path.stem.replace("__", "/")
    if config and isinstance(config.get("_name_or_path"), str) and config["_name_or_path"].count("/") == 1:
        return config["_name_or_path"]
    return directory.name if path.is_dir() or path.name == "config.json" else path.stem


def _resized(spec: ModelSpec, inventory: TensorInventory, expert_format: str | None,
             other_format: str | None) -> TensorInventory:
    """The files' inventory, or one computed from the config when other formats were asked."""
    wants_other = other_format is not None and get_format(other_format).name != spec.other_format
    wants_expert = expert_format is not None and get_format(expert_format).name != spec.expert_format
    if not (wants_expert or wants_other):
        return inventory
    resized = inventory_from_config(spec, expert_format=expert_format, other_format=other_format)
    note = f"the files hold experts in {spec.expert_format}; sizes are for the requested formats"
    return replace(resized, files=inventory.files, notes=resized.notes + (note,))


def _inspect_config(path: Path, expert_format: str | None, other_format: str | None, *, given: Path) -> InspectedModel:
    """A bare config.json, or a folder holding only one (planning before the download): sized
    from the config as the published checkpoint holds it."""
    config = load_config(path)
    spec = spec_from_config(config, model_name(path, config), source=str(path))
    inventory = inventory_from_config(spec, expert_format=expert_format, other_format=other_format)
    return InspectedModel(spec, inventory, given, "config", (path,))


def _inspect_checkpoint(directory: Path, expert_format: str | None, other_format: str | None) -> InspectedModel:
    config_path = directory / "config.json"
    config = load_config(config_path)
    spec = spec_from_config(config, model_name(directory, config), source=str(config_path))
    files, records = read_checkpoint(directory)
    spec = _with_stored_float_formats(spec, records)
    inventory = inventory_from_records(records, spec, source="safetensors", files=[str(f) for f in files])
    check_complete(spec, records, str(directory))
    inventory = _resized(spec, inventory, expert_format, other_format)
    return InspectedModel(spec, inventory, directory, "safetensors", tuple(files))


def _with_stored_float_formats(spec: ModelSpec, records: list[TensorRecord]) -> ModelSpec:
    """For unquantized checkpoints, the float type the tensors really have (a config may say
    bfloat16 over float32 tensors, or name no dtype at all)."""

    def stored(classes: tuple[TensorClass, ...], declared: str) -> str:
        if get_format(declared).kind != "float":
            return declared
        counts: dict[str, int] = {}
        for r in records:
            if len(r.shape) >= 2 and classify_hf(r.name, spec.num_layers).cls in classes:
                counts[r.dtype] = counts.get(r.dtype, 0) + r.nbytes
        if not counts:
            return declared
        fmt = SAFETENSORS_DTYPES.get(max(counts, key=counts.get), (None, None))[1]
        return fmt if fmt and get_format(fmt).kind == "float" else declared

    return replace(
        spec,
        expert_format=stored((TensorClass.ROUTED_EXPERTS,), spec.expert_format),
        other_format=stored((TensorClass.ATTENTION, TensorClass.DENSE_FFN, TensorClass.SHARED_EXPERTS),
                            spec.other_format),
    )


def _inspect_gguf(found: ModelFiles, expert_format: str | None, other_format: str | None, *,
                  given: Path) -> InspectedModel:
    contents = read_gguf(found.path)
    first = contents.files[0]
    name = contents.metadata.get("general.name")
    if not isinstance(name, str) or not name:
        m = SPLIT_NAME.match(first.name)
        name = m.group("stem") if m else first.stem
    shapes = {t.name: t.shape for t in contents.tensors}
    spec = spec_from_gguf(contents.metadata, name, source=str(first), tensor_shapes=shapes)
    ef, of = gguf_storage_formats(contents.tensors, contents.metadata, spec.num_layers)
    spec = replace(spec, expert_format=ef, other_format=of, torch_dtype="bfloat16")
    inventory = inventory_from_records(contents.tensors, spec, source="gguf",
                                       files=[str(f) for f in contents.files])
    inventory = _resized(spec, inventory, expert_format, other_format)
    return InspectedModel(spec, inventory, given, "gguf", contents.files)
