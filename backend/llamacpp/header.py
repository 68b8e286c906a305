"""What a GGUF says about itself, read before llama.cpp loads it.

The backend checks the Plan against the file (the same MoE layers and expert count, override
patterns that match real tensors) before asking llama.cpp to place hundreds of gigabytes.
The header is read by the project's GGUF reader (``hybridmoe.backend.models.gguf_reader``), the one
the inspector and the engine use: it reads a 150k-token vocabulary's header in well under a
second, and checks what ggml's own reader checks (magic, version, sizes, alignment, each
tensor inside the file) without loading llama.cpp's libraries. Tensors of ggml types newer
than the installed gguf-py are let through here: llama.cpp may know them, and says so if not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridmoe.backend.errors import ModelError
from hybridmoe.backend.models.gguf_reader import GGUF_MAGIC, GGUFError, open_gguf_set
from hybridmoe.backend.models.inspect import InspectedModel
from hybridmoe.backend.models.model_files import resolve_model_files
from hybridmoe.backend.plan.llamacpp import EXPERT_TENSORS

_EXPERT_TENSOR = re.compile(rf"^blk\.(\d+)\.{EXPERT_TENSORS}\.")


@dataclass(frozen=True)
class GGUFHeader:
    path: Path  # the file llama.cpp is given (the first part of a split set)
    files: tuple[Path, ...]
    values: dict[str, Any]  # scalar metadata (strings and numbers) of the first part
    tensor_names: tuple[str, ...]  # of every part

    @property
    def architecture(self) -> str:
        return str(self.values.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.architecture}.{key}", default)

    @property
    def block_count(self) -> int:
        return int(self.arch_value("block_count", 0) or 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Blocks with routed-expert tensors, without the NextN/MTP blocks some converters keep
        at the end (llama.cpp does not run them for plain decoding, and plans leave them out)."""
        last = self.block_count - int(self.arch_value("nextn_predict_layers", 0) or 0)
        layers = {int(m.group(1)) for name in self.tensor_names if (m := _EXPERT_TENSOR.match(name))}
        return tuple(sorted(i for i in layers if not self.block_count or i < last))

    def chat_templates(self) -> dict[str, str]:
        """"default" (tokenizer.chat_template) and the named ones (tokenizer.chat_template.NAME)."""
        out = {}
        for key, value in self.values.items():
            if isinstance(value, str) and (key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template.")):
                out[key.removeprefix("tokenizer.chat_template").lstrip(".") or "default"] = value
        return out


def resolve_gguf(model: InspectedModel | str | Path) -> Path:
    """The GGUF file llama.cpp should open for ``model``: the first part of the set
    ``resolve_model_files`` chooses (llama.cpp finds the other parts from it), or of the model
    inspected already. Anything else gets a message saying what llama.cpp needs."""
    if isinstance(model, InspectedModel):
        if model.kind == "gguf":
            return model.load_path
        model = model.path
    path = Path(model).expanduser()
    if path.is_file():
        _check_magic(path)
    found = resolve_model_files(path)
    if found.kind != "gguf":
        raise ModelError(
            f"{path} is a Hugging Face checkpoint; the llama.cpp backend reads GGUF files only.",
            "Run it with `--backend engine`, or convert it to GGUF first.",
        )
    return found.path


def _check_magic(path: Path) -> None:
    """A file given to llama.cpp is GGUF whatever its name; said in llama.cpp's terms."""
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"{path} cannot be read: {exc.strerror or exc}.", "Check that the file is readable.") from exc
    if magic != GGUF_MAGIC:
        raise ModelError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); the llama.cpp backend reads GGUF files only.",
            "Give a .gguf file, or run a Hugging Face checkpoint with `--backend engine`.",
        )


def read_header(model: InspectedModel | str | Path) -> GGUFHeader:
    path = resolve_gguf(model)
    try:
        files = open_gguf_set(path, allow_unknown_types=True)
    except GGUFError as exc:
        if not exc.damaged:
            raise  # not GGUF, unreadable, big-endian, version 1: the reader's own words
        # Worded as llama.cpp's own refusal of a damaged file is (session.load_error).
        raise ModelError(f"{exc.path} is damaged or incomplete: {exc.problem}.", "Download the file again.") from None
    try:
        first = files[0]
        values = {key: first[key] for key, field in first.fields.items() if not field.is_array}
        names = tuple(t.name for g in files for t in g.tensors)
    finally:
        for g in files:
            g.close()
    return GGUFHeader(path, tuple(g.path for g in files), values, names)
