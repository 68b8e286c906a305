"""``LocalModel``: one model on this machine's disks, wherever it came from.

``pull`` returns one; ``list_local_models`` returns one per model it finds in the Hugging
Face cache, in registered directories, and (read-only) in LM Studio's and Ollama's stores.
``path`` is what ``hybridmoe.backend.models.inspect_model`` and the backends take: a checkpoint
directory (config.json + safetensors) or the first file of a GGUF set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Where a model was found; also what the CLI prints in its SOURCE column.
SOURCES = ("hf-cache", "directory", "lmstudio", "ollama", "path")


@dataclass(frozen=True)
class LocalModel:
    name: str  # "moonshotai/Kimi-K2.6", "unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M", "qwen3:30b"
    path: Path
    kind: str  # "safetensors" or "gguf", as InspectedModel.kind
    size_bytes: int  # of the files that make up the model (a GGUF set, or shards + tokenizer)
    source: str  # one of SOURCES
    quantization: str | None = None  # GGUF name ("Q4_K_M") or storage format ("int4_g32", "bf16")
    family: str | None = None  # hybridmoe.backend.models family ("deepseek", "qwen3_moe", ...)
    repo_id: str | None = None  # Hugging Face repo, when known
    revision: str | None = None  # commit hash of a Hugging Face cache snapshot
    files: tuple[Path, ...] = ()
    problem: str | None = None  # why it cannot be used as it is (unreadable, incomplete, unsupported)
    note: str = ""  # something worth telling that is not a problem ("offline: cached copy used")

    @property
    def usable(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "format": self.kind,  # the JSON key `models --json` has always printed
            "size_bytes": self.size_bytes,
            "source": self.source,
            "quantization": self.quantization,
            "family": self.family,
            "repo_id": self.repo_id,
            "revision": self.revision,
            "files": [str(f) for f in self.files],
            "usable": self.usable,
            "problem": self.problem,
            "note": self.note,
        }


def names_a_path(path: Path) -> bool:
    """Whether something on disk answers to ``path``: a file, a folder, or a symbolic link even
    when it is broken or loops, and a path below a folder we may not search (opening it then
    says why it cannot be used, rather than taking the text for a model name)."""
    try:
        return path.exists() or path.is_symlink()
    except PermissionError:
        return True
